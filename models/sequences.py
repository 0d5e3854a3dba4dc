"""The stateful example models (Triton's ``sequence_batching``), graphs and configs.

- ``simple_sequence``: Triton's example of that name, with control inputs
  START and READY: ``OUTPUT = INPUT + START`` (READY is always 1 on a request
  the server runs). Triton's sequence client examples expect exactly this.
- ``simple_dyna_sequence``: adds END and CORRID (UINT64):
  ``OUTPUT = INPUT + START + END * CORRID``, so the last request of a sequence
  comes back with its sequence id added.
- ``simple_string_dyna_sequence``: Triton's string-id twin of the last
  (its CORRID control is ``TYPE_STRING``): sequence ids are strings, and the
  one added at END must read as a decimal integer (``"1002"``), as Triton's
  ``dyna_sequence`` backend requires.
- ``accumulate``: implicit state (``sequence_batching.state``): ``OUTPUT`` is
  the running sum of the sequence's ``INPUT``s; the worker feeds the previous
  sum back on ``ACC_IN`` (zeros at START) and keeps ``ACC_OUT`` for the next.

Every model is batchable (batch-size 1 per request, as Triton's sequence
batcher requires) and keeps an idle sequence for 10 s.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper
from tritonclient.grpc import model_config_pb2 as mc

IR_VERSION = 10
OPSET = 17
MAX_BATCH_SIZE = 8
IDLE_US = 10_000_000
_Kind = mc.ModelSequenceBatching.Control


def _model(name: str, nodes: list[onnx.NodeProto], inputs: list[tuple[str, int]], outputs: list[str]) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        name,
        [helper.make_tensor_value_info(n, t, ["batch", 1]) for n, t in inputs],
        [helper.make_tensor_value_info(n, TensorProto.INT32, ["batch", 1]) for n in outputs],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="infergate-models")
    model.ir_version = IR_VERSION  # newer onnx writes an IR version onnxruntime rejects
    return model


def _config(name: str) -> mc.ModelConfig:
    config = mc.ModelConfig(name=name, platform="onnxruntime_onnx", backend="onnxruntime", max_batch_size=MAX_BATCH_SIZE)
    config.input.add(name="INPUT", data_type=mc.TYPE_INT32, dims=[1])
    config.output.add(name="OUTPUT", data_type=mc.TYPE_INT32, dims=[1])
    config.sequence_batching.max_sequence_idle_microseconds = IDLE_US
    config.sequence_batching.direct.SetInParent()
    config.instance_group.add(count=1, kind=mc.ModelInstanceGroup.KIND_AUTO)
    return config


def _flag(config: mc.ModelConfig, name: str, kind: int) -> None:
    config.sequence_batching.control_input.add(name=name).control.add(kind=kind, int32_false_true=[0, 1])


def simple_sequence() -> tuple[onnx.ModelProto, mc.ModelConfig]:
    nodes = [
        helper.make_node("Add", ["INPUT", "START"], ["sum"]),
        helper.make_node("Mul", ["sum", "READY"], ["OUTPUT"]),
    ]
    model = _model("simple_sequence", nodes, [("INPUT", TensorProto.INT32), ("START", TensorProto.INT32),
                                              ("READY", TensorProto.INT32)], ["OUTPUT"])
    config = _config("simple_sequence")
    _flag(config, "START", _Kind.CONTROL_SEQUENCE_START)
    _flag(config, "READY", _Kind.CONTROL_SEQUENCE_READY)
    return model, config


def _dyna_sequence(name: str, corrid_onnx: int, corrid_config: int) -> tuple[onnx.ModelProto, mc.ModelConfig]:
    nodes = [
        helper.make_node("Cast", ["CORRID"], ["corrid"], to=TensorProto.INT32),
        helper.make_node("Mul", ["END", "corrid"], ["end_corrid"]),
        helper.make_node("Add", ["INPUT", "START"], ["sum"]),
        helper.make_node("Add", ["sum", "end_corrid"], ["total"]),
        helper.make_node("Mul", ["total", "READY"], ["OUTPUT"]),
    ]
    model = _model(
        name, nodes,
        [("INPUT", TensorProto.INT32), ("START", TensorProto.INT32), ("END", TensorProto.INT32),
         ("READY", TensorProto.INT32), ("CORRID", corrid_onnx)],
        ["OUTPUT"],
    )
    config = _config(name)
    _flag(config, "START", _Kind.CONTROL_SEQUENCE_START)
    _flag(config, "END", _Kind.CONTROL_SEQUENCE_END)
    _flag(config, "READY", _Kind.CONTROL_SEQUENCE_READY)
    config.sequence_batching.control_input.add(name="CORRID").control.add(
        kind=_Kind.CONTROL_SEQUENCE_CORRID, data_type=corrid_config
    )
    return model, config


def simple_dyna_sequence() -> tuple[onnx.ModelProto, mc.ModelConfig]:
    return _dyna_sequence("simple_dyna_sequence", TensorProto.UINT64, mc.TYPE_UINT64)


def simple_string_dyna_sequence() -> tuple[onnx.ModelProto, mc.ModelConfig]:
    # ONNX's Cast parses the decimal string id, as Triton's dyna_sequence backend requires of string ids.
    return _dyna_sequence("simple_string_dyna_sequence", TensorProto.STRING, mc.TYPE_STRING)


def _accumulate(name: str) -> tuple[onnx.ModelProto, mc.ModelConfig]:
    nodes = [
        helper.make_node("Add", ["ACC_IN", "INPUT"], ["OUTPUT"]),
        helper.make_node("Identity", ["OUTPUT"], ["ACC_OUT"]),
    ]
    model = _model(name, nodes, [("INPUT", TensorProto.INT32), ("ACC_IN", TensorProto.INT32)],
                   ["OUTPUT", "ACC_OUT"])
    config = _config(name)
    config.sequence_batching.state.add(input_name="ACC_IN", output_name="ACC_OUT", data_type=mc.TYPE_INT32, dims=[1])
    return model, config


def accumulate() -> tuple[onnx.ModelProto, mc.ModelConfig]:
    model, config = _accumulate("accumulate")
    config.sequence_batching.state[0].initial_state.add(name="zero", data_type=mc.TYPE_INT32, dims=[1], zero_data=True)
    return model, config


SEED = 100


def accumulate_seeded() -> tuple[onnx.ModelProto, mc.ModelConfig]:
    model, config = _accumulate("accumulate_seeded")
    config.sequence_batching.state[0].initial_state.add(name="seed", data_type=mc.TYPE_INT32, dims=[1],
                                                         data_file="seed.bin")
    return model, config


SEQUENCE_MODELS: tuple[Callable[[], tuple[onnx.ModelProto, mc.ModelConfig]], ...] = (
    simple_sequence, simple_dyna_sequence, simple_string_dyna_sequence, accumulate, accumulate_seeded,
)
SEQUENCE_MODEL_NAMES = (
    "simple_sequence", "simple_dyna_sequence", "simple_string_dyna_sequence", "accumulate", "accumulate_seeded",
)
# Files beside a model's config, by model: path inside the model directory -> bytes.
SEQUENCE_MODEL_FILES: dict[str, dict[str, bytes]] = {
    "accumulate_seeded": {"initial_state/seed.bin": np.array([SEED], dtype="<i4").tobytes()},
}
