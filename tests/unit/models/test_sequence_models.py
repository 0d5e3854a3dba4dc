"""The stateful example models of models/sequences.py: graphs run by ONNX
Runtime as the worker feeds them, and configs that say which inputs the
server fills in."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
from tritonclient.grpc import model_config_pb2 as mc

from models.sequences import accumulate, simple_dyna_sequence, simple_sequence, simple_string_dyna_sequence
from execution.sequences import server_filled_inputs


def _run(model, feeds: dict[str, int | str]) -> int:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    arrays = {
        name: np.array([[value]], dtype=np.object_ if isinstance(value, str) else np.uint64 if name == "CORRID"
                       else np.int32) for name, value in feeds.items()
    }
    return int(session.run(["OUTPUT"], arrays)[0][0][0])


def test_simple_sequence_is_input_plus_start() -> None:
    model, config = simple_sequence()
    assert server_filled_inputs(config) == {"START", "READY"}
    assert _run(model, {"INPUT": 10, "START": 1, "READY": 1}) == 11
    assert _run(model, {"INPUT": 10, "START": 0, "READY": 1}) == 10


def test_dyna_sequence_adds_corrid_on_end() -> None:
    model, config = simple_dyna_sequence()
    assert server_filled_inputs(config) == {"START", "END", "READY", "CORRID"}
    corrid = [c for c in config.sequence_batching.control_input if c.name == "CORRID"][0].control[0]
    assert corrid.data_type == mc.TYPE_UINT64
    assert _run(model, {"INPUT": 1, "START": 0, "END": 1, "READY": 1, "CORRID": 1000}) == 1001
    assert _run(model, {"INPUT": 1, "START": 0, "END": 0, "READY": 1, "CORRID": 1000}) == 1


def test_string_dyna_sequence_takes_a_string_corrid() -> None:
    model, config = simple_string_dyna_sequence()
    assert server_filled_inputs(config) == {"START", "END", "READY", "CORRID"}
    corrid = [c for c in config.sequence_batching.control_input if c.name == "CORRID"][0].control[0]
    assert corrid.data_type == mc.TYPE_STRING
    assert _run(model, {"INPUT": 1, "START": 0, "END": 1, "READY": 1, "CORRID": "1002"}) == 1003
    assert _run(model, {"INPUT": 1, "START": 1, "END": 0, "READY": 1, "CORRID": "1002"}) == 2


def test_accumulate_adds_input_to_its_state() -> None:
    model, config = accumulate()
    state = config.sequence_batching.state[0]
    assert (state.input_name, state.output_name) == ("ACC_IN", "ACC_OUT")
    assert server_filled_inputs(config) == {"ACC_IN"}
    assert _run(model, {"INPUT": 5, "ACC_IN": 7}) == 12
    assert [o.name for o in config.output] == ["OUTPUT"]  # the state output is the worker's, not the client's
