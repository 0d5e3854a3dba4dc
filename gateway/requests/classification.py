"""Triton's classification extension: an output requested with
``classification: K`` comes back as its top K entries, each the BYTES string
``"value:index"`` or ``"value:index:label"``.

Done at the gateway, after the batch is split back into requests: workers run
the model as usual (Triton workers and ours alike), and batches mix requests
with and without classification freely. Labels come from the output's
``label_filename`` in the model's ``config.pbtxt``, read from the gateway's
``model_repository`` (``infergate up`` sets it; a gateway in front of remote
workers needs a copy of the repository, or answers without labels).

As Triton: per batch row for a batched model (shape ``[rows, k]``), else one
row (``[k]``); ``k`` is at most the row's element count; values are printed
as C++'s ``std::to_string`` prints them (``%f`` for floats).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import numpy as np
from tritonclient.grpc import model_config_pb2

from gateway.types import InferRequest, InferResponse, Tensor
from protos import codec
from protos.errors import InvalidArgument

log = logging.getLogger(__name__)

PARAMETER = "classification"
_NUMPY = {
    "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
    "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64,
    "FP32": np.float32, "FP64": np.float64,
}


def class_count(value: object, name: str) -> int:
    """The K of an output's ``classification`` parameter."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgument(f"Unable to set 'classification' for output '{name}': expected a non-negative "
                              f"integer, got {value!r}")
    return value


class LabelFiles:
    """Label files of the models in one repository, read once per change of the file."""

    def __init__(self, repository: str) -> None:
        self._repository = repository
        self._cache: dict[str, tuple[float, list[str]]] = {}
        self._warned: set[str] = set()

    def labels(self, model: str, filename: str) -> list[str]:
        if not filename:
            return []
        if not self._repository:
            self._warn_once(model, f"no model repository is configured to read '{filename}' from")
            return []
        path = os.path.join(self._repository, model, filename)
        try:
            mtime = os.stat(path).st_mtime
            hit = self._cache.get(path)
            if hit is not None and hit[0] == mtime:
                return hit[1]
            with open(path, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except OSError as exc:
            self._warn_once(model, f"cannot read label file {path}: {exc.strerror}")
            return []
        self._cache[path] = (mtime, lines)
        return lines

    def _warn_once(self, model: str, why: str) -> None:
        if model not in self._warned:
            self._warned.add(model)
            log.warning("classification of model '%s' answers without labels: %s", model, why)


def _format(value: np.generic) -> str:
    if isinstance(value, np.floating):
        return f"{float(value):f}"
    return str(int(value))


def top_k(values: np.ndarray, k: int, labels: Sequence[str]) -> list[str]:
    """The ``k`` largest of a flat array as Triton's strings; ties keep index order."""
    order = np.lexsort((np.arange(values.size), -values.astype(np.float64)))[:k]
    out = []
    for index in order.tolist():
        text = f"{_format(values[index])}:{index}"
        if index < len(labels) and labels[index]:
            text += f":{labels[index]}"
        out.append(text)
    return out


def classify(tensor: Tensor, k: int, labels: Sequence[str], batched: bool) -> Tensor:
    """``tensor`` replaced by its top-``k`` BYTES tensor."""
    dtype = _NUMPY.get(tensor.datatype)
    if dtype is None:
        raise InvalidArgument(
            f"class result not available for output due to unsupported type '{tensor.datatype}'"
        )
    values = np.frombuffer(tensor.data, dtype=dtype)
    rows = tensor.shape[0] if batched and tensor.shape else 0
    per_row = values.reshape(rows, -1) if rows else values.reshape(1, -1)
    count = min(k, per_row.shape[1])
    strings = [s.encode() for row in per_row for s in top_k(row, count, labels)]
    shape = (rows, count) if rows else (count,)
    return Tensor(tensor.name, "BYTES", shape, codec.serialize_bytes_tensor(np.array(strings, dtype=np.object_)), dict(tensor.parameters))


def apply_classification(
    request: InferRequest, response: InferResponse, config: model_config_pb2.ModelConfig, files: LabelFiles
) -> InferResponse:
    """``response`` with each output the request asked to classify replaced by its top-K strings (a new response)."""
    wanted = {o.name: o.classification for o in request.outputs if o.classification}
    if not wanted:
        return response
    label_names = {o.name: o.label_filename for o in config.output}
    batched = config.max_batch_size > 0
    outputs = []
    for tensor in response.outputs:
        k = wanted.get(tensor.name)
        if k:
            labels = files.labels(request.model, label_names.get(tensor.name, ""))
            tensor = classify(tensor, k, labels, batched)
        outputs.append(tensor)
    return InferResponse(response.model, response.version, response.id, outputs, dict(response.parameters))
