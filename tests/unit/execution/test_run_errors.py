"""Tests for execution/backends/run_errors.py: ONNX Runtime's real run failures,
classified as the request's fault or the server's, with clean messages."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from protos.errors import Internal, InvalidArgument
from tests.poison_models import MAX_SEQUENCE, encoder_model, fill_model, pair_model
from execution.backends.run_errors import classify_run_error, clean_message


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def failure(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> Exception:
    with pytest.raises(Exception) as info:
        session(model).run(None, feeds)
    return info.value  # type: ignore[return-value]


def ones(*shape: int) -> np.ndarray:
    return np.ones(shape, np.float32)


@pytest.mark.parametrize(("model", "feeds", "cause"), [
    # Batch sizes that cannot broadcast: ONNX Runtime raises Fail, not InvalidArgument.
    (pair_model, {"A": ones(2, 4), "B": ones(3, 4)}, "Add node: Attempting to broadcast an axis by a dimension other than 1. 2 by 3"),
    # A sequence past the position table (ONNX Runtime turns that Gather into a Slice, so Add fails).
    (encoder_model, {"TOKENS": np.zeros((1, MAX_SEQUENCE + 1), np.int64)}, f"by {MAX_SEQUENCE + 1}"),
    # A token id past the vocabulary.
    (encoder_model, {"TOKENS": np.array([[1, 99]], np.int64)}, "idx=99 must be within the inclusive range"),
    # A shape the session checks at its inputs.
    (pair_model, {"A": ones(2, 5), "B": ones(2, 5)}, "Got invalid dimensions for input: B"),
])
def test_request_faults_are_invalid_argument_with_the_cause(model, feeds, cause) -> None:  # type: ignore[no-untyped-def]
    error = classify_run_error(failure(model(), feeds))
    assert isinstance(error, InvalidArgument)
    assert cause in error.message
    assert "/" not in error.message.replace("inputs/outputs", "") and ".h:" not in error.message
    assert "[ONNXRuntimeError]" not in error.message and "was false" not in error.message


def test_memory_failure_is_the_servers_fault_with_its_cause() -> None:
    error = classify_run_error(failure(fill_model(), {"SIZE": np.array([1 << 45], np.int64)}))
    assert isinstance(error, Internal)
    assert "Failed to allocate memory" in error.message and "bfc_arena" not in error.message


def test_unknown_exceptions_are_internal_with_their_type() -> None:
    error = classify_run_error(RuntimeError("/opt/build/src/thing.cc:12 something broke"))
    assert isinstance(error, Internal) and error.message.endswith("something broke")


def test_clean_message_keeps_what_the_user_can_act_on() -> None:
    raw = ("[ONNXRuntimeError] : 1 : FAIL : Non-zero status code returned while running Reshape node. "
           "Name:'reshape_3' Status Message: /src/onnxruntime/core/providers/cpu/tensor/reshape_helper.h:91 "
           "onnxruntime::ReshapeHelper::ReshapeHelper(const onnxruntime::TensorShape&, bool) "
           "input_shape_size == requested_shape_size was false. The input tensor cannot be reshaped. "
           "Model at /home/someone/models/bert/1/model.onnx")
    assert clean_message(raw) == ("Reshape node 'reshape_3': The input tensor cannot be reshaped. "
                                  "Model at model.onnx")
