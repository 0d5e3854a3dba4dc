"""Request inputs built from the model's own metadata.

Owns the model signature as the bench sees it (:class:`ModelSignature`, read
from ModelMetadata + ModelConfig over gRPC or HTTP), shape resolution
(``--shape`` for dynamic dims, ``-b`` for the batch dimension), and the three
input sources: seeded random data, zeros, or a perf_analyzer JSON data file
(``{"data": [{"INPUT0": [...], ...}, ...]}``). The result is a list of
:data:`Payload`: raw row-major tensors, encoded once into each protocol's
wire form by ``loadtest.clients`` and reused for every request.

As in perf_analyzer, random data is generated once and reused; integer inputs
are drawn from ``--int-range`` (default [0, 100)) so token-id inputs stay
inside any reasonable vocabulary. With a JSON file and a batching model each
``data`` entry is one row (no batch dim), and a request of batch size B takes
B consecutive entries, cycling.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.config import BenchError
from protos import codec, json_codec

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    datatype: str
    dims: tuple[int, ...]  # without the batch dimension; -1 is variable


@dataclass(frozen=True, slots=True)
class ModelSignature:
    name: str
    version: str
    max_batch_size: int  # 0: the model does not batch, shapes are full shapes
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]


@dataclass(frozen=True, slots=True)
class InputTensor:
    name: str
    datatype: str
    shape: tuple[int, ...]  # full shape sent on the wire, batch dim included
    raw: bytes  # row-major, little-endian; BYTES length-prefixed


Payload = tuple[InputTensor, ...]


def _specs(entries: Sequence[Any], batching: bool) -> tuple[TensorSpec, ...]:
    specs = []
    for entry in entries:
        get = entry.get if isinstance(entry, Mapping) else lambda key, e=entry: getattr(e, key)
        shape = tuple(int(d) for d in get("shape"))
        if batching:
            shape = shape[1:]  # metadata shapes carry the batch dim (-1) first
        specs.append(TensorSpec(str(get("name")), str(get("datatype")), shape))
    return tuple(specs)


def make_signature(metadata: Any, max_batch_size: int | None) -> ModelSignature:
    """Signature from a ModelMetadataResponse proto or its HTTP JSON form.

    ``max_batch_size`` comes from the model config; None when the server has
    no config endpoint, in which case the model is treated as non-batching.
    """
    get = metadata.get if isinstance(metadata, Mapping) else lambda key: getattr(metadata, key)
    if max_batch_size is None:
        log.warning("no model config from the server: treating %s as a non-batching model", get("name"))
        max_batch_size = 0
    batching = max_batch_size > 0
    versions = list(get("versions") or [])
    return ModelSignature(
        name=str(get("name")),
        version=str(versions[-1]) if versions else "",
        max_batch_size=int(max_batch_size),
        inputs=_specs(get("inputs") or [], batching),
        outputs=_specs(get("outputs") or [], batching),
    )


def resolve_dims(sig: ModelSignature, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Per-input dims (no batch dim) with every -1 filled from ``--shape``."""
    known = {spec.name for spec in sig.inputs}
    unknown = sorted(set(shapes) - known)
    if unknown:
        raise BenchError(f"--shape names unknown input(s) {', '.join(unknown)}; "
                         f"{sig.name} has {', '.join(sorted(known))}")
    out: dict[str, tuple[int, ...]] = {}
    for spec in sig.inputs:
        given = shapes.get(spec.name)
        if given is None:
            if any(d < 0 for d in spec.dims):
                raise BenchError(
                    f"input {spec.name} has a variable shape {list(spec.dims)}; "
                    f"give one with --shape {spec.name}:" + ",".join("8" if d < 0 else str(d) for d in spec.dims)
                )
            out[spec.name] = spec.dims
            continue
        if len(given) != len(spec.dims) or any(d >= 0 and d != g for d, g in zip(spec.dims, given, strict=True)):
            dims = ",".join(map(str, given))
            raise BenchError(f"--shape {spec.name}:{dims} does not fit its shape {list(spec.dims)}")
        out[spec.name] = given
    return out


def _random_values(spec: TensorSpec, shape: tuple[int, ...], rng: np.random.Generator,
                   int_range: tuple[int, int], string_length: int) -> np.ndarray:
    count = math.prod(shape)
    if spec.datatype == "BYTES":
        letters = np.frombuffer(string.ascii_lowercase.encode(), dtype=np.uint8)
        picks = letters[rng.integers(0, len(letters), size=(count, string_length))]
        return np.array([row.tobytes() for row in picks], dtype=object).reshape(shape)
    dtype = codec.numpy_dtype(spec.datatype)
    if dtype.kind == "b":
        return rng.integers(0, 2, size=shape).astype(dtype)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        low, high = max(int_range[0], int(info.min)), min(int_range[1], int(info.max) + 1)
        if low >= high:
            raise BenchError(f"--int-range {int_range[0]}:{int_range[1]} holds no {spec.datatype} value "
                             f"for input {spec.name}")
        return rng.integers(low, high, size=shape, dtype=np.int64).astype(dtype)
    return rng.random(size=shape, dtype=np.float64).astype(dtype)


def _to_raw(datatype: str, values: np.ndarray) -> bytes:
    if datatype == "BYTES":
        return codec.serialize_bytes_tensor(values)
    return np.ascontiguousarray(values).tobytes()


def _generated(sig: ModelSignature, dims: Mapping[str, tuple[int, ...]], batch_size: int, kind: str,
               seed: int, int_range: tuple[int, int], string_length: int) -> Payload:
    rng = np.random.default_rng(seed)
    tensors = []
    for spec in sig.inputs:
        shape = ((batch_size,) if sig.max_batch_size > 0 else ()) + dims[spec.name]
        if kind == "zero":
            values = (np.full(shape, b"", dtype=object) if spec.datatype == "BYTES"
                      else np.zeros(shape, dtype=codec.numpy_dtype(spec.datatype)))
        else:
            values = _random_values(spec, shape, rng, int_range, string_length)
        tensors.append(InputTensor(spec.name, spec.datatype, shape, _to_raw(spec.datatype, values)))
    return tuple(tensors)


def _entry_tensor(spec: TensorSpec, default_dims: tuple[int, ...] | None, value: Any,
                  where: str) -> tuple[tuple[int, ...], bytes]:
    """(shape, raw) of one input in one data entry."""
    shape: tuple[int, ...] | None = default_dims
    if isinstance(value, Mapping):
        if "shape" in value:
            shape = tuple(int(d) for d in value["shape"])
        if "b64" in value:
            if shape is None:
                raise BenchError(f"{where}: give a 'shape' for input {spec.name} (its shape is variable)")
            try:
                raw = base64.b64decode(value["b64"], validate=True)
                codec.validate_raw(spec.datatype, shape, raw, name=spec.name)
            except (ValueError, codec.CodecError) as exc:
                raise BenchError(f"{where}: {exc}") from None
            return shape, raw
        if "content" not in value:
            raise BenchError(f"{where}: input {spec.name} needs 'content' or 'b64'")
        value = value["content"]
    if shape is None:
        raise BenchError(f"{where}: give a 'shape' for input {spec.name} or --shape {spec.name}:DIMS")
    count, needed = _leaves(value), math.prod(shape)
    if count != needed:  # the server's words ("Shape does not match ...") name no numbers
        raise BenchError(f"{where}: input {spec.name} has {count} value(s); shape {list(shape)} expected {needed}")
    try:
        return shape, json_codec.json_to_raw(spec.datatype, shape, value, name=spec.name)
    except codec.CodecError as exc:
        raise BenchError(f"{where}: {exc}") from None


def _leaves(value: Any) -> int:
    """How many values a JSON tensor's (possibly nested) data holds."""
    if isinstance(value, list):
        return sum(_leaves(v) for v in value)
    return 1


def load_data_file(path: str | Path, sig: ModelSignature, shapes: Mapping[str, tuple[int, ...]],
                   batch_size: int) -> list[Payload]:
    """Payloads from a perf_analyzer JSON data file."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise BenchError(f"--input-data {path}: {exc}") from None
    entries = doc.get("data") if isinstance(doc, Mapping) else None
    if not isinstance(entries, list) or not entries:
        raise BenchError(f'--input-data {path}: expected {{"data": [{{"INPUT": [...]}}, ...]}} '
                         "with at least one entry")
    if any(isinstance(e, list) for e in entries):
        raise BenchError(f"--input-data {path}: sequence (stream) data is not supported; give one object per request")
    known = {spec.name for spec in sig.inputs}
    if set(shapes) - known:
        raise BenchError(f"--shape names unknown input(s) {', '.join(sorted(set(shapes) - known))}")
    # Dims of each input when the entry does not say: --shape, else the model's own if fixed.
    defaults: dict[str, tuple[int, ...] | None] = {}
    for spec in sig.inputs:
        dims = tuple(shapes.get(spec.name, spec.dims))
        defaults[spec.name] = None if any(d < 0 for d in dims) else dims
    rows: list[dict[str, tuple[tuple[int, ...], bytes]]] = []
    for index, entry in enumerate(entries):
        where = f"--input-data {path}, entry {index}"
        if not isinstance(entry, Mapping):
            raise BenchError(f"{where}: expected an object of input name -> data")
        extra = sorted(set(entry) - known)
        missing = sorted(known - set(entry))
        if extra or missing:
            raise BenchError(f"{where}: " + "; ".join(
                part for part in (f"unknown input(s) {', '.join(extra)}" if extra else "",
                                  f"missing input(s) {', '.join(missing)}" if missing else "") if part))
        rows.append({s.name: _entry_tensor(s, defaults[s.name], entry[s.name], where) for s in sig.inputs})
    if sig.max_batch_size == 0:
        return [tuple(InputTensor(s.name, s.datatype, *row[s.name]) for s in sig.inputs) for row in rows]
    payloads: list[Payload] = []
    for first in range(0, len(rows), batch_size):
        picked = [rows[(first + r) % len(rows)] for r in range(batch_size)]
        tensors = []
        for spec in sig.inputs:
            row_shapes = {p[spec.name][0] for p in picked}
            if len(row_shapes) != 1:
                raise BenchError(f"--input-data {path}: entries {first}..{first + batch_size - 1} give input "
                                 f"{spec.name} different shapes {sorted(row_shapes)}; they cannot form one batch")
            shape = (batch_size,) + row_shapes.pop()
            tensors.append(InputTensor(spec.name, spec.datatype, shape, b"".join(p[spec.name][1] for p in picked)))
        payloads.append(tuple(tensors))
    return payloads


def build_payloads(sig: ModelSignature, *, batch_size: int, input_data: str = "random",
                   shapes: Mapping[str, tuple[int, ...]] | None = None, seed: int = 0,
                   int_range: tuple[int, int] = (0, 100), string_length: int = 16) -> list[Payload]:
    """The request payloads for a run, from random data, zeros or a JSON file."""
    shapes = shapes or {}
    if sig.max_batch_size == 0 and batch_size > 1:
        raise BenchError(f"model {sig.name} does not batch (max_batch_size 0); use -b 1")
    if sig.max_batch_size > 0 and batch_size > sig.max_batch_size:
        raise BenchError(f"-b {batch_size} is over model {sig.name}'s max_batch_size {sig.max_batch_size}")
    if input_data in ("random", "zero"):
        dims = resolve_dims(sig, shapes)
        return [_generated(sig, dims, batch_size, input_data, seed, int_range, string_length)]
    return load_data_file(input_data, sig, shapes, batch_size)
