"""Shard models as files: building each shard's ONNX model and tensor specs,
its Triton ``config.pbtxt``, and writing/reading a whole split as a model
repository.

Directory layout written by :func:`write_split` (a Triton model repository
plus the plan)::

    DIR/plan.json
    DIR/<model>.tp2.r0.s0/config.pbtxt
    DIR/<model>.tp2.r0.s0/1/model.onnx
    ...

Each shard's ``path`` in the plan is relative to ``DIR``. The configs use
``max_batch_size: 0`` with full shapes (-1 for dynamic dims), so they are
valid for Triton's ONNX Runtime backend as written and for load-with-override.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from google.protobuf import text_format
from onnx import helper
from tritonclient.grpc import model_config_pb2
from tritonclient.utils import np_to_triton_dtype, triton_to_np_dtype

from splitter.layout import State
from splitter.plan import Plan, Shard, TensorSpec
from splitter.probe import Probe
from splitter.sizes import InputHints, SizePlan

PLAN_FILE = "plan.json"


@dataclass(frozen=True, slots=True)
class SplitResult:
    """A plan and the shard models it names (``models[shard.name]``), plus
    the input sizes it was probed at and the hints it was given (verification
    uses both)."""

    plan: Plan
    models: dict[str, onnx.ModelProto]
    sizes: SizePlan | None = None
    hints: InputHints | None = None

    def model_bytes(self, shard: str) -> bytes:
        return self.models[shard].SerializeToString()


def datatype(dtype: np.dtype) -> str:
    """The KServe datatype of a numpy dtype."""
    return str(np_to_triton_dtype(np.dtype(dtype)))


def tensor_spec(found: Probe, name: str, state: State, n: int) -> TensorSpec:
    """A tensor's spec as one rank holds it in ``state``."""
    shape = list(found.spec_shape(name))
    if state.kind == "S" and shape[state.axis] > 0:
        shape[state.axis] //= n
    elif state.kind == "S":
        shape[state.axis] = -1
    return TensorSpec(name, datatype(found.dtypes[name]), tuple(shape))


def signature_value_info(spec: TensorSpec) -> onnx.ValueInfoProto:
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(triton_to_np_dtype(spec.datatype)))
    dims = [d if d >= 0 else f"{spec.name}_d{i}" for i, d in enumerate(spec.shape)]
    return helper.make_tensor_value_info(spec.name, elem, dims)


def build_shard(
    original: onnx.ModelProto,
    name: str,
    nodes: list[onnx.NodeProto],
    inputs: tuple[TensorSpec, ...],
    outputs: tuple[TensorSpec, ...],
    initializers: list[onnx.TensorProto],
) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, name, [signature_value_info(s) for s in inputs], [signature_value_info(s) for s in outputs], initializer=initializers
    )
    model = helper.make_model(graph, opset_imports=list(original.opset_import), ir_version=original.ir_version)
    model.functions.extend(original.functions)
    model.producer_name = "infergate-split"
    return model


def shard_config(shard: Shard) -> model_config_pb2.ModelConfig:
    """The Triton model configuration for one shard."""
    config = model_config_pb2.ModelConfig(name=shard.name, backend="onnxruntime", max_batch_size=0)
    config.platform = "onnxruntime_onnx"
    for spec, target in [(s, config.input.add()) for s in shard.inputs] + [(s, config.output.add()) for s in shard.outputs]:
        target.name = spec.name
        target.data_type = model_config_pb2.DataType.Value("TYPE_STRING" if spec.datatype == "BYTES" else f"TYPE_{spec.datatype}")
        target.dims.extend(spec.shape)
    return config


def write_split(result: SplitResult, directory: Path) -> Path:
    """Write every shard in Triton layout plus ``plan.json``; returns the plan's path."""
    directory.mkdir(parents=True, exist_ok=True)
    for shard in result.plan.shards():
        target = directory / shard.path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(result.model_bytes(shard.name))
        (directory / shard.name / "config.pbtxt").write_text(text_format.MessageToString(shard_config(shard)))
    path = directory / PLAN_FILE
    path.write_text(result.plan.to_json())
    return path


def load_split(directory: Path) -> SplitResult:
    plan = Plan.from_json((directory / PLAN_FILE).read_bytes())
    models = {shard.name: onnx.load(str(directory / shard.path)) for shard in plan.shards()}
    return SplitResult(plan, models)
