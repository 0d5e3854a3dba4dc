"""The worker's own ``triton_python_backend_utils`` (execution/backends/python_api.py):
Triton's names and meanings for tensors, requests, responses, the response
sender, errors, the config helpers, type tables, BYTES (de)serialisers and
the logger."""

from __future__ import annotations

import json
import logging
import threading

import numpy as np
import pytest

from execution.backends import python_api as pb


class Sink:
    def __init__(self) -> None:
        self.sent: list[tuple[pb.InferenceResponse | None, bool]] = []
        self.cancel = threading.Event()

    def send(self, response: pb.InferenceResponse | None, final: bool) -> None:
        self.sent.append((response, final))

    def cancelled(self) -> bool:
        return self.cancel.is_set()


def test_tensor_keeps_name_array_and_type() -> None:
    array = np.arange(4, dtype=np.int32)
    tensor = pb.Tensor("OUT", array)
    assert tensor.name() == "OUT" and tensor.as_numpy() is array and tensor.triton_dtype() == 8
    assert pb.Tensor("S", np.array([b"a"], dtype=np.object_)).triton_dtype() == 13
    assert pb.Tensor("V", np.zeros(2, np.uint8), triton_dtype=2).as_numpy().dtype == np.uint8
    with pytest.raises(pb.TritonModelException, match="np.object_"):
        pb.Tensor("T", np.array(["text"]))
    with pytest.raises(pb.TritonModelException):
        pb.Tensor("L", [1, 2])  # type: ignore[arg-type]


def test_request_accessors() -> None:
    sink = Sink()
    sender = pb.InferenceResponseSender(sink)
    tensor = pb.Tensor("IN", np.array([3], np.int32))
    request = pb.InferenceRequest([tensor], "id-1", 0, ["OUT"], {"p": 1}, sender, "square_int32", 1)
    assert request.inputs() == [tensor] and request.request_id() == "id-1"
    assert request.requested_output_names() == ["OUT"] and json.loads(request.parameters()) == {"p": 1}
    assert pb.get_input_tensor_by_name(request, "IN") is tensor and pb.get_input_tensor_by_name(request, "NO") is None
    assert request.get_response_sender() is sender and not request.is_cancelled()
    sink.cancel.set()
    assert request.is_cancelled() and sender.is_cancelled()
    with pytest.raises(pb.TritonModelException):
        pb.InferenceRequest([], "x").get_response_sender()


def test_response_and_error() -> None:
    out = pb.Tensor("OUT", np.array([1], np.int32))
    response = pb.InferenceResponse(output_tensors=[out])
    assert response.output_tensors() == [out] and not response.has_error() and response.error() is None
    assert pb.get_output_tensor_by_name(response, "OUT") is out and pb.get_output_tensor_by_name(response, "X") is None
    error = pb.TritonError("bad input", pb.TritonError.INVALID_ARG)
    failed = pb.InferenceResponse(output_tensors=[], error=error)
    assert failed.has_error() and failed.error() is error
    assert error.message() == str(error) == "bad input" and error.code() == 3
    assert pb.TritonError("x").code() == pb.TritonError.INTERNAL
    with pytest.raises(pb.TritonModelException, match="must be a list"):
        pb.InferenceResponse(output_tensors=out)  # type: ignore[arg-type]
    assert pb.TritonModelException("why").message() == "why"


def test_sender_closes_on_the_final_flag() -> None:
    sink = Sink()
    sender = pb.InferenceResponseSender(sink)
    first = pb.InferenceResponse([pb.Tensor("OUT", np.array([1], np.int32))])
    sender.send(first)
    sender.send(flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
    assert sink.sent == [(first, False), (None, True)] and sender.closed
    with pytest.raises(pb.TritonModelException, match="closed"):
        sender.send(first)
    with pytest.raises(pb.TritonModelException, match="must be provided"):
        pb.InferenceResponseSender(Sink()).send()
    with pytest.raises(pb.TritonModelException):
        pb.InferenceResponseSender(Sink()).send("not a response")  # type: ignore[arg-type]


def test_config_helpers() -> None:
    config = {
        "input": [{"name": "IN", "data_type": "TYPE_INT32", "dims": [1]}],
        "output": [{"name": "OUT", "data_type": "TYPE_UINT32", "dims": [1]}],
        "model_transaction_policy": {"decoupled": True},
    }
    assert pb.get_input_config_by_name(config, "IN") == config["input"][0]  # type: ignore[index]
    assert pb.get_output_config_by_name(config, "OUT")["data_type"] == "TYPE_UINT32"  # type: ignore[index]
    assert pb.get_output_config_by_name(config, "NO") is None and pb.get_input_config_by_name({}, "IN") is None
    assert pb.using_decoupled_model_transaction_policy(config)
    assert not pb.using_decoupled_model_transaction_policy({"model_transaction_policy": {"decoupled": False}})
    assert not pb.using_decoupled_model_transaction_policy({})


def test_type_tables() -> None:
    assert pb.triton_string_to_numpy("TYPE_INT32") is np.int32
    assert pb.triton_string_to_numpy("TYPE_STRING") is np.object_
    assert pb.triton_to_numpy_type(11) is np.float32 and pb.triton_to_numpy_type(99) is None
    assert pb.numpy_to_triton_type(np.uint32) == 4 and pb.numpy_to_triton_type(np.bytes_) == 13
    assert pb.numpy_to_triton_type(np.object_) == 13


def test_bytes_round_trip() -> None:
    items = np.array([b"", b"abc", "t\u00e9xt".encode()], dtype=np.object_)
    flat = pb.serialize_byte_tensor(items)
    assert flat is not None and flat.dtype == np.uint8
    assert flat.tobytes()[:4] == b"\x00\x00\x00\x00"
    assert pb.deserialize_bytes_tensor(flat.tobytes()).tolist() == items.tolist()
    assert pb.serialize_byte_tensor(np.zeros(2, np.int32)) is None


def test_logger_writes_to_the_worker_log(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="workers.python_model"):
        pb.Logger.log_info("one")
        pb.Logger.log_warn("two")
        pb.Logger.log_error("three")
        pb.Logger.log("four", pb.LogLevel.VERBOSE)
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.INFO, "one"), (logging.WARNING, "two"), (logging.ERROR, "three"), (logging.DEBUG, "four"),
    ]
