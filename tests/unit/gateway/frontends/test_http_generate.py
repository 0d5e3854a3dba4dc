"""Triton's generate extension without sockets: the body's mapping onto the
model's inputs and request parameters, the response object, the event
framing, and the refusals in Triton's words.

The endpoints over a real socket: tests/integration/gateway/test_generate_fake_core.py
(a fake core with decoupled models) and test_generate_e2e.py (real processes).
"""

from __future__ import annotations

import numpy as np
import orjson
import pytest
from tritonclient.grpc import service_pb2

from gateway.frontends.http_generate import (
    NOT_ONE_RESPONSE,
    fit_shape,
    generate_request,
    generate_response_json,
    input_specs,
    parse_generate_body,
    sse_error,
    sse_event,
)
from gateway.types import InferRequest, InferResponse, Tensor
from protos import codec
from protos.errors import Internal, InvalidArgument, Unsupported

SIMPLE = {"INPUT0": ("INT32", (-1, 16)), "INPUT1": ("INT32", (-1, 16))}
TEXT = {"text_input": ("BYTES", (1,)), "max_tokens": ("INT32", (1,))}


def _request(doc: dict, inputs: dict, model: str = "m") -> InferRequest:
    return generate_request(doc, model=model, version="", inputs=inputs)


def _message(doc: dict, inputs: dict) -> str:
    with pytest.raises(InvalidArgument) as info:
        _request(doc, inputs)
    return info.value.message


# --- the body ------------------------------------------------------------------------


def test_body_that_is_not_json_is_refused_in_tritons_words() -> None:
    with pytest.raises(InvalidArgument, match=r"^failed to parse the request JSON buffer: .* at 0$"):
        parse_generate_body(b"nope")
    with pytest.raises(InvalidArgument, match=r"^failed to parse the request JSON buffer: .* at \d+$"):
        parse_generate_body(b'{"a": ')


def test_empty_body_is_an_empty_document() -> None:
    with pytest.raises(InvalidArgument) as info:
        parse_generate_body(b"")
    assert info.value.message == "failed to parse the request JSON buffer: The document is empty. at 0"


@pytest.mark.parametrize("body", [b"[1, 2]", b'"text"', b"3", b"null"])
def test_body_that_is_not_an_object_has_no_members(body: bytes) -> None:
    with pytest.raises(InvalidArgument) as info:
        parse_generate_body(body)
    assert info.value.message == "attempt to get members for non-object"


# --- inputs --------------------------------------------------------------------------


def test_list_fills_the_variable_batch_dim_of_a_batched_model() -> None:
    req = _request({"INPUT0": list(range(16)), "INPUT1": [1] * 16}, SIMPLE, model="simple")
    first, second = req.inputs
    assert (first.name, first.datatype, first.shape) == ("INPUT0", "INT32", (1, 16))
    assert np.frombuffer(first.data, "<i4").tolist() == list(range(16))
    assert second.shape == (1, 16) and req.model == "simple" and req.outputs == []


def test_scalar_is_one_element_and_strings_become_bytes_tensors() -> None:
    req = _request({"text_input": "héllo", "max_tokens": 5}, TEXT)
    text, tokens = req.inputs
    assert (text.datatype, text.shape) == ("BYTES", (1,))
    assert codec.deserialize_bytes_tensor(text.data).tolist() == ["héllo".encode()]
    assert np.frombuffer(tokens.data, "<i4").tolist() == [5] and tokens.shape == (1,)


def test_string_list_on_a_variable_dim() -> None:
    req = _request({"INPUT0": ["a", "bc", ""]}, {"INPUT0": ("BYTES", (-1,))})
    assert req.inputs[0].shape == (3,)
    assert codec.deserialize_bytes_tensor(req.inputs[0].data).tolist() == [b"a", b"bc", b""]


@pytest.mark.parametrize(("shape", "count", "want"), [
    ((-1, 16), 32, (2, 16)),
    ((-1, -1), 6, (1, 6)),
    ((2, -1), 6, (2, 3)),
    ((-1,), 0, (0,)),
    ((3,), 3, (3,)),
    ((), 1, ()),
])
def test_fit_shape_follows_tritons_two_passes(shape: tuple, count: int, want: tuple) -> None:
    assert fit_shape("X", shape, count) == want


@pytest.mark.parametrize(("shape", "count"), [((-1, 16), 15), ((4,), 3), ((), 2), ((2, 2), 8)])
def test_a_count_the_shape_cannot_hold_is_refused(shape: tuple, count: int) -> None:
    with pytest.raises(InvalidArgument) as info:
        fit_shape("X", shape, count)
    assert info.value.message == "The schema can not convert input 'X' to tensor with proper shape"


@pytest.mark.parametrize(("datatype", "value", "words"), [
    ("INT32", [1.5], "Unable to parse 'data': attempt to access JSON non-signed-integer as signed-integer"),
    ("INT32", ["1"], "Unable to parse 'data': attempt to access JSON non-signed-integer as signed-integer"),
    ("INT32", [True], "Unable to parse 'data': attempt to access JSON non-signed-integer as signed-integer"),
    ("UINT32", [-1], "Unable to parse 'data': attempt to access JSON non-unsigned-integer as unsigned-integer"),
    ("BOOL", [1], "Unable to parse 'data': attempt to access JSON non-boolean as boolean"),
    ("FP32", ["x"], "Unable to parse 'data': attempt to access JSON non-number as double"),
    ("BYTES", [1], "Unable to parse JSON bytes array: attempt to access JSON non-string as string"),
    ("INT32", [[1]], "Unable to parse 'data': Shape does not match true shape of 'data' field"),
    ("FP16", [1.0], "receiving FP16 data via JSON is not supported. Please use the binary data format for input X"),
])
def test_values_the_datatype_cannot_hold_are_refused_in_tritons_words(datatype: str, value: list,
                                                                       words: str) -> None:
    assert _message({"X": value}, {"X": (datatype, (-1,))}) == words


def test_integers_out_of_range_are_refused_not_wrapped() -> None:
    assert "out of range for INT8" in _message({"X": [300]}, {"X": ("INT8", (-1,))})


def test_numbers_of_every_kind() -> None:
    specs = {"B": ("BOOL", (-1,)), "U": ("UINT64", (-1,)), "F": ("FP32", (-1,)), "D": ("FP64", (-1,))}
    req = _request({"B": [True, False], "U": [2**64 - 1], "F": [1, 2.5], "D": 0.25}, specs)
    b, u, f, d = req.inputs
    assert np.frombuffer(b.data, np.bool_).tolist() == [True, False]
    assert np.frombuffer(u.data, "<u8").tolist() == [2**64 - 1]
    assert np.frombuffer(f.data, "<f4").tolist() == [1.0, 2.5]
    assert np.frombuffer(d.data, "<f8").tolist() == [0.25] and d.shape == (1,)


# --- parameters and id ---------------------------------------------------------------


def test_keys_that_are_not_inputs_become_request_parameters() -> None:
    req = _request({"text_input": "x", "stream": False, "temperature": 0.5, "top_k": 3, "mode": "fast"}, TEXT)
    assert req.parameters == {"stream": False, "temperature": 0.5, "top_k": 3, "mode": "fast"}
    assert [t.name for t in req.inputs] == ["text_input"]


def test_parameters_object_maps_inputs_and_parameters_alike() -> None:
    req = _request({"text_input": "x", "parameters": {"max_tokens": 7, "temperature": 0}}, TEXT)
    assert [t.name for t in req.inputs] == ["text_input", "max_tokens"]
    assert np.frombuffer(req.inputs[1].data, "<i4").tolist() == [7]
    assert req.parameters == {"temperature": 0}


def test_id_is_the_request_id() -> None:
    req = _request({"id": "req-7", "text_input": "x"}, TEXT)
    assert req.id == "req-7" and "id" not in req.parameters
    assert _message({"id": 7}, TEXT) == "Unable to parse 'id': attempt to access JSON non-string as string"


@pytest.mark.parametrize(("doc", "words"), [
    ({"parameters": [1]}, "Expected JSON object for keyword: 'parameters': attempt to access JSON non-object as object"),
    ({"parameters": {"p": [1]}},
     "Converting keyword: 'parameters': parameter 'p' has invalid type. It should be either 'int', 'bool', or 'string'."),
    ({"p": None}, "parameter 'p' has invalid type. It should be either 'int', 'bool', or 'string'."),
    ({"p": {"a": 1}}, "parameter 'p' has invalid type. It should be either 'int', 'bool', or 'string'."),
    ({"parameters": {"max_tokens": "x"}},
     "Converting keyword: 'parameters': Unable to parse 'data': attempt to access JSON non-signed-integer as "
     "signed-integer"),
])
def test_bad_parameters_are_refused_in_tritons_words(doc: dict, words: str) -> None:
    assert _message(doc, TEXT) == words


def test_an_input_named_parameters_clashes_with_the_keyword() -> None:
    words = _message({"parameters": {}}, {"parameters": ("INT32", (1,))})
    assert words == "Keyword 'parameters' for nested schema also given as input tensor name"


def test_input_specs_read_the_model_metadata() -> None:
    meta = service_pb2.ModelMetadataResponse(name="m", inputs=[
        service_pb2.ModelMetadataResponse.TensorMetadata(name="IN", datatype="INT32", shape=[-1, 4])])
    assert input_specs(meta) == {"IN": ("INT32", (-1, 4))}


# --- responses -----------------------------------------------------------------------


def _tensor(name: str, arr: np.ndarray) -> Tensor:
    datatype, shape, data = codec.encode(arr)
    return Tensor(name=name, datatype=datatype, shape=tuple(shape), data=data)


def test_response_has_model_version_id_parameters_and_each_output_by_name_in_byte_order() -> None:
    request = InferRequest(model="m", version="", id="r1", inputs=[], outputs=[])
    response = InferResponse(model="m", version="1", id="r1", outputs=[
        _tensor("b_out", np.array([1, 2, 3], np.int32)),
        _tensor("OUT", np.array([[7]], np.int32)),
        _tensor("TEXT", np.array([b"hi"], dtype=object)),
    ], parameters={"tokens": 3, "triton_final_response": False})
    doc = generate_response_json(response, request)
    assert doc == {"OUT": 7, "TEXT": "hi", "b_out": [1, 2, 3], "id": "r1", "model_name": "m",
                   "model_version": "1", "tokens": 3}
    assert list(doc) == ["OUT", "TEXT", "b_out", "id", "model_name", "model_version", "tokens"]


def test_response_without_an_id_has_none_and_reserved_names_win() -> None:
    request = InferRequest(model="m", version="2", id="", inputs=[], outputs=[])
    response = InferResponse(model="", version="", id="", outputs=[_tensor("model_name", np.array([1], np.int8))],
                             parameters={"model_version": "x"})
    assert generate_response_json(response, request) == {"model_name": "m", "model_version": "2"}


def test_response_parameter_of_bytes_is_unsupported() -> None:
    request = InferRequest(model="m", version="", id="", inputs=[], outputs=[])
    response = InferResponse(model="m", version="1", id="", outputs=[], parameters={"blob": b"\x00"})
    with pytest.raises(Unsupported, match="Response parameter 'blob' has type 'TRITONSERVER_PARAMETER_BYTES'"):
        generate_response_json(response, request)


def test_malformed_output_is_the_models_fault() -> None:
    request = InferRequest(model="m", version="", id="", inputs=[], outputs=[])
    response = InferResponse(model="m", version="1", id="", outputs=[
        Tensor(name="OUT", datatype="INT32", shape=(2,), data=b"\x00")])
    with pytest.raises(Internal, match="malformed output"):
        generate_response_json(response, request)


# --- framing -------------------------------------------------------------------------


def test_sse_event_is_one_data_line_and_a_blank_line() -> None:
    event = sse_event({"OUT": 1, "text": "a\nb"})
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert event.count(b"\n") == 2  # a newline inside a string is escaped by JSON
    assert orjson.loads(event[len(b"data: "):]) == {"OUT": 1, "text": "a\nb"}


def test_sse_error_carries_tritons_error_object() -> None:
    assert sse_error(NOT_ONE_RESPONSE) == b'data: {"error":"' + NOT_ONE_RESPONSE.encode() + b'"}\n\n'
