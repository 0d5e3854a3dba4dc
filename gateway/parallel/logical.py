"""Logical models as the gateway config declares them: the parsed
declaration, where the source ONNX file comes from, and the signature the
logical model shows clients.

A logical model is served by the gateway under its own name with its
source's signature -- inputs, outputs, ``max_batch_size``, batching -- while
its work runs as shard models on workers::

    model_repository: models          # or `infergate up --model-repository`
    models:
      encoder_tp2:
        from: encoder                 # <model_repository>/encoder/<version>/model.onnx
        tensor_parallel: 2
        collectives: peer             # (default) ranks exchange partial sums directly; `gateway`: the star
      big_pp2:
        path: /models/big.onnx        # or a file; relative paths are relative to the config file
        pipeline_parallel: 2
        replicas: 2
        max_batch_size: 8             # batches along dim 0 (a bare file has no config to say so)
      recognizer_tp2:
        from: recognizer
        tensor_parallel: 2
        input_shapes: {image: "batch,3,48,width:320"}   # as `infergate split --input-shape`
        input_values: {sr: sr16k.npy}                    # as --input-values (relative to the config file)

Signature, in order of preference: the source model as the workers serve it
(so ``encoder_tp2`` answers metadata exactly as ``encoder`` does), else the
source's ``config.pbtxt`` for ``max_batch_size`` plus the plan's tensors.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2, service_pb2

from gateway.fleet.cluster import ModelInfo
from gateway.parallel.decoder_source import generation_signature, is_generation_source
from gateway.settings import ConfigError
from splitter.plan import Plan
from splitter.sizes import InputHints, load_values, parse_dims

log = logging.getLogger(__name__)

PLATFORM = "infergate_parallel"
# Config parameter naming the layout of a logical model (its clear mark).
LOGICAL_PARAM = "infergate_logical"
VERSION = "1"


class ParallelConfigError(ConfigError):
    """A logical model cannot be built: its source is missing or cannot be split."""


@dataclass(frozen=True, slots=True)
class LogicalSpec:
    name: str
    source: str  # repository model name ("" when `path` is given)
    path: str  # ONNX file ("" when `source` is given)
    version: str  # source version directory ("" = the highest)
    tensor_parallel: int
    pipeline_parallel: int
    replicas: int
    max_inflight: int  # batches in flight at once (0 = derived from the layout)
    max_batch_size: int | None
    input_shapes: tuple[tuple[str, tuple[int | str | tuple[str, int], ...]], ...] = ()
    input_values: tuple[tuple[str, str], ...] = ()  # input -> .npy path
    # "peer": ranks exchange partial results between themselves, one gateway
    # call per rank; "gateway": the gateway runs every segment and joins (the star).
    collectives: str = "peer"

    @classmethod
    def from_settings(cls, name: str, settings: Mapping[str, Any]) -> LogicalSpec:
        mbs = settings.get("max_batch_size")
        shapes = settings.get("input_shapes") or {}
        values = settings.get("input_values") or {}
        if not isinstance(shapes, Mapping) or not isinstance(values, Mapping):
            raise ParallelConfigError(f"models.{name}: input_shapes and input_values map input names to "
                                      "dims (\"batch,3,48,width:320\" or a list) and to .npy files")
        collectives = str(settings.get("collectives", "peer"))
        if collectives not in ("peer", "gateway"):
            raise ParallelConfigError(f"models.{name}.collectives: 'peer' (workers exchange partial results "
                                      f"directly) or 'gateway' (the gateway joins them), not {collectives!r}")
        try:
            parsed = tuple((str(k), parse_dims(v)) for k, v in shapes.items())
        except ValueError as e:
            raise ParallelConfigError(f"models.{name}.input_shapes: {e}") from None
        return cls(
            name=name,
            source=str(settings.get("from") or ""),
            path=str(settings.get("path") or ""),
            version=str(settings.get("version") or ""),
            tensor_parallel=int(settings.get("tensor_parallel", 1)),
            pipeline_parallel=int(settings.get("pipeline_parallel", 1)),
            replicas=int(settings.get("replicas", 1)),
            max_inflight=int(settings.get("max_inflight", 0)),
            max_batch_size=None if mbs is None else int(mbs),
            input_shapes=parsed,
            input_values=tuple((str(k), str(v)) for k, v in values.items()),
            collectives=collectives,
        )

    def hints(self) -> InputHints:
        """The declared input shapes and values, for the splitter (reads the .npy files: blocking I/O)."""
        try:
            values = {k: load_values(k, Path(path)) for k, path in self.input_values}
        except ValueError as e:
            raise ParallelConfigError(f"models.{self.name}.input_values: {e}") from None
        return InputHints(dict(self.input_shapes), values)

    def describe(self) -> dict[str, Any]:
        return {
            "source": self.source or self.path,
            "tensor_parallel": self.tensor_parallel,
            "pipeline_parallel": self.pipeline_parallel,
            "replicas": self.replicas,
            "collectives": self.collectives,
        }

    def summary(self) -> str:
        return (f"logical model: {self.source or Path(self.path).name} split tp{self.tensor_parallel} "
                f"x pp{self.pipeline_parallel}, {self.replicas} replica group(s)")


def read_source(spec: LogicalSpec, repository: str) -> tuple[bytes, model_config_pb2.ModelConfig | None]:
    """The source model's ONNX bytes and, for a repository model, its config.pbtxt (blocking I/O)."""
    if spec.path:
        try:
            return Path(spec.path).read_bytes(), None
        except OSError as e:
            raise ParallelConfigError(f"models.{spec.name}: cannot read {spec.path}: {e.strerror}") from None
    if not repository:
        raise ParallelConfigError(
            f"models.{spec.name}: 'from: {spec.source}' needs the model repository (config key "
            "'model_repository', or `infergate up --model-repository`); or give 'path:' to the .onnx file")
    model_dir = Path(repository) / spec.source
    config: model_config_pb2.ModelConfig | None = None
    config_path = model_dir / "config.pbtxt"
    if config_path.is_file():
        config = model_config_pb2.ModelConfig()
        try:
            text_format.Parse(config_path.read_text(encoding="utf-8"), config)
        except text_format.ParseError as e:
            log.warning("models.%s: ignoring unreadable %s: %s", spec.name, config_path, e)
            config = None
    filename = (config.default_model_filename if config is not None else "") or "model.onnx"
    versions = sorted(int(p.name) for p in model_dir.glob("*") if p.name.isdigit() and (p / filename).is_file())
    if spec.version:
        chosen = spec.version
    elif versions:
        chosen = str(versions[-1])
    else:
        raise ParallelConfigError(f"models.{spec.name}: no {filename} under {model_dir}/<version>/")
    file = model_dir / chosen / filename
    try:
        return file.read_bytes(), config
    except OSError as e:
        raise ParallelConfigError(f"models.{spec.name}: cannot read {file}: {e.strerror}") from None


def signature(
    spec: LogicalSpec,
    plan: Plan,
    served_source: ModelInfo | None,
    repo_config: model_config_pb2.ModelConfig | None,
) -> tuple[model_config_pb2.ModelConfig, service_pb2.ModelMetadataResponse]:
    """The logical model's config and metadata: its source's signature under its own name."""
    config = model_config_pb2.ModelConfig()
    metadata = service_pb2.ModelMetadataResponse()
    if is_generation_source(repo_config):
        # Its shards run the decoder step; the gateway generates (gateway.parallel.generation).
        assert repo_config is not None
        config, metadata = generation_signature(spec.name, repo_config)
    elif served_source is not None:
        config.CopyFrom(served_source.config)
        metadata.CopyFrom(served_source.metadata)
    else:
        max_batch = spec.max_batch_size if spec.max_batch_size is not None else (
            repo_config.max_batch_size if repo_config is not None else 0)
        if max_batch > 0 and any(not t.shape or t.shape[0] != -1 for t in plan.inputs):
            log.warning("models.%s: inputs have no dynamic first dimension; serving it unbatched", spec.name)
            max_batch = 0
        if repo_config is not None:
            config.CopyFrom(repo_config)
            del config.input[:]
            del config.output[:]
        config.max_batch_size = max(max_batch, 0)
        skip = 1 if max_batch > 0 else 0
        for specs, target, meta in ((plan.inputs, config.input, metadata.inputs),
                                    (plan.outputs, config.output, metadata.outputs)):
            for t in specs:
                data_type = "TYPE_STRING" if t.datatype == "BYTES" else f"TYPE_{t.datatype}"
                target.add(name=t.name, data_type=model_config_pb2.DataType.Value(data_type), dims=list(t.shape[skip:]))
                meta.add(name=t.name, datatype=t.datatype, shape=list(t.shape))
    if spec.max_batch_size is not None and config.max_batch_size > 0:
        config.max_batch_size = spec.max_batch_size
    if not is_generation_source(repo_config):
        _check_tensors(spec, plan, metadata)
    config.name = spec.name
    config.platform = PLATFORM
    config.backend = ""
    config.default_model_filename = ""
    del config.instance_group[:]
    config.parameters[LOGICAL_PARAM].string_value = json.dumps(spec.describe())
    metadata.name = spec.name
    metadata.platform = PLATFORM
    metadata.versions[:] = [VERSION]
    return config, metadata


def _check_tensors(spec: LogicalSpec, plan: Plan, metadata: service_pb2.ModelMetadataResponse) -> None:
    want = sorted(t.name for t in plan.inputs), sorted(t.name for t in plan.outputs)
    got = sorted(t.name for t in metadata.inputs), sorted(t.name for t in metadata.outputs)
    if want != got:
        raise ParallelConfigError(
            f"models.{spec.name}: the served source's tensors {got} differ from the ONNX file's {want}")
