"""The REST frontend's pieces without sockets: body decoding and encoding,
bounded decompression, the management JSON, and the error middleware.

The same surface over a real socket, driven by tritonclient, is in
tests/integration/gateway/test_http_api_fake_core.py.
"""

from __future__ import annotations

import gzip
import json
import logging
import zlib
from typing import Any

import numpy as np
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.grpc import model_config_pb2, service_pb2

from gateway.frontends.http_api import error_middleware
from gateway.frontends.http_codec import DecodedInfer, decode_infer_request, encode_infer_response
from gateway.frontends.http_compression import choose_encoding, inflate_bounded
from gateway.frontends.http_json import load_parameters, message_to_json, repository_index_to_json
from gateway.types import InferRequest, InferResponse, RequestedOutput, Tensor
from protos import codec
from protos.errors import (
    Internal,
    InvalidArgument,
    ModelNotFound,
    Overloaded,
    PayloadTooLarge,
    Unsupported,
)


def _binary(doc: dict[str, Any], *blobs: bytes) -> tuple[bytes, int]:
    header = orjson.dumps(doc)
    return header + b"".join(blobs), len(header)


# --- decoding ---------------------------------------------------------------


def test_binary_inputs_are_zero_copy_slices_of_the_body() -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    s = codec.serialize_bytes_tensor(np.array([b"xy", b""], dtype=object))
    doc = {"inputs": [
        {"name": "A", "datatype": "FP32", "shape": [2, 3], "parameters": {"binary_data_size": a.nbytes}},
        {"name": "S", "datatype": "BYTES", "shape": [2], "parameters": {"binary_data_size": len(s), "tag": "t"}},
    ]}
    body, header_length = _binary(doc, a.tobytes(), s)
    req = decode_infer_request(body, header_length, model="m").request
    first, second = req.inputs
    assert isinstance(first.data, memoryview) and first.data.obj is body
    assert bytes(first.data) == a.tobytes() and first.shape == (2, 3)
    assert bytes(second.data) == s and second.parameters == {"tag": "t"}  # binary_data_size consumed


def test_json_data_flat_or_nested_becomes_raw_bytes() -> None:
    for data in ([1, 2, 3, 4], [[1, 2], [3, 4]]):
        doc = {"inputs": [{"name": "X", "datatype": "INT16", "shape": [2, 2], "data": data}]}
        (tensor,) = decode_infer_request(orjson.dumps(doc), None, model="m").request.inputs
        assert tensor.data == np.array([1, 2, 3, 4], dtype="<i2").tobytes()
    doc = {"inputs": [{"name": "B", "datatype": "BOOL", "shape": [3], "data": [True, False, True]}]}
    (tensor,) = decode_infer_request(orjson.dumps(doc), None, model="m").request.inputs
    assert tensor.data == b"\x01\x00\x01"


def test_parameters_are_consumed_or_passed_through() -> None:
    doc = {"id": "r1", "parameters": {"priority": 3, "timeout": 250_000, "binary_data_output": True,
                                      "sequence_id": 9, "note": "x"},
           "inputs": [{"name": "X", "datatype": "INT8", "shape": [1], "data": [1]}],
           "outputs": [{"name": "Y", "parameters": {"binary_data": False, "extra": 1}}, {"name": "Z"}]}
    decoded = decode_infer_request(orjson.dumps(doc), None, model="m", version="4", now=100.0)
    req = decoded.request
    assert decoded.binary_data_output is True
    assert (req.model, req.version, req.id, req.priority, req.timeout_us) == ("m", "4", "r1", 3, 250_000)
    assert req.deadline == pytest.approx(100.25)
    assert req.parameters == {"sequence_id": 9, "note": "x"}
    assert req.outputs == [RequestedOutput("Y", False, {"extra": 1}), RequestedOutput("Z", None, {})]
    no_timeout = decode_infer_request(orjson.dumps({"inputs": []}), None, model="m", now=5.0).request
    assert no_timeout.deadline is None and no_timeout.timeout_us == 0


@pytest.mark.parametrize("doc,error", [
    ({"inputs": [], "parameters": {"triton_x": 1}}, InvalidArgument),
    ({"inputs": [], "outputs": [{"name": "Y", "parameters": {"classification": "3"}}]}, InvalidArgument),
    ({"inputs": [{"name": "X", "datatype": "FP32", "shape": [1],
                  "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 4}}]}, Unsupported),
    ({"inputs": [{"name": "X", "datatype": "FP32", "shape": [True], "data": [1.0]}]}, InvalidArgument),
    ({"inputs": [{"name": "X", "datatype": "FP32", "shape": [1]}]}, InvalidArgument),
    ({"inputs": [], "outputs": [{"name": "Y"}, {"name": "Y"}]}, InvalidArgument),
    ({"inputs": [], "parameters": {"binary_data_output": "yes"}}, InvalidArgument),
])
def test_rejections(doc: dict[str, Any], error: type[Exception]) -> None:
    with pytest.raises(error):
        decode_infer_request(orjson.dumps(doc), None, model="m")


def test_binary_size_checks() -> None:
    doc = {"inputs": [{"name": "X", "datatype": "INT32", "shape": [2], "parameters": {"binary_data_size": 8}}]}
    body, n = _binary(doc, b"\0" * 8)
    decode_infer_request(body, n, model="m")
    with pytest.raises(InvalidArgument, match="only 4 bytes"):
        decode_infer_request(body[:-4], n, model="m")
    with pytest.raises(InvalidArgument, match="no input claims"):
        decode_infer_request(body + b"\0", n, model="m")
    with pytest.raises(InvalidArgument, match="Inference-Header-Content-Length"):
        decode_infer_request(body, len(body) + 1, model="m")


# --- encoding ---------------------------------------------------------------


def _decoded(outputs: list[RequestedOutput], binary_default: bool, rid: str = "") -> DecodedInfer:
    return DecodedInfer(InferRequest("m", "", rid, [], outputs), binary_default)


def _response(rid: str = "") -> InferResponse:
    a = np.array([1.5, 2.5], dtype=np.float32).tobytes()
    b = codec.serialize_bytes_tensor(np.array(["hé"], dtype=object))
    return InferResponse("m", "3", rid, [Tensor("A", "FP32", (2,), a), Tensor("B", "BYTES", (1,), b)])


def test_all_json_when_nothing_asks_for_binary() -> None:
    encoded = encode_infer_response(_response("r"), _decoded([], False))
    assert encoded.header_length is None and encoded.parts == ()
    doc = orjson.loads(encoded.header)
    assert doc == {"model_name": "m", "model_version": "3", "id": "r", "outputs": [
        {"name": "A", "datatype": "FP32", "shape": [2], "data": [1.5, 2.5]},
        {"name": "B", "datatype": "BYTES", "shape": [1], "data": ["hé"]}]}


def test_binary_by_default_with_per_output_override() -> None:
    response = _response()
    # A listed output without binary_data is JSON: binary_data_output only decides when none is listed.
    encoded = encode_infer_response(
        response, _decoded([RequestedOutput("A"), RequestedOutput("B", binary_data=False)], True, "q")
    )
    assert orjson.loads(encoded.header)["outputs"][0]["data"] == [1.5, 2.5]
    encoded = encode_infer_response(
        response, _decoded([RequestedOutput("A", binary_data=True), RequestedOutput("B", binary_data=False)], True, "q")
    )
    assert encoded.parts[0] is response.outputs[0].data  # appended as is, not copied
    assert encoded.header_length == len(encoded.header)
    doc = orjson.loads(encoded.header)
    assert doc["id"] == "q"  # falls back to the request's id
    assert doc["outputs"][0]["parameters"] == {"binary_data_size": 8} and "data" not in doc["outputs"][0]
    assert doc["outputs"][1]["data"] == ["hé"]
    assert encoded.size == len(encoded.header) + 8


def test_per_output_binary_true_without_default() -> None:
    encoded = encode_infer_response(_response(), _decoded([RequestedOutput("B", binary_data=True)], False))
    doc = orjson.loads(encoded.header)
    assert "data" in doc["outputs"][0] and doc["outputs"][1]["parameters"]["binary_data_size"] == 7
    assert len(encoded.parts) == 1


def test_malformed_output_is_internal() -> None:
    bad = InferResponse("m", "1", "", [Tensor("A", "FP32", (2,), b"\0" * 7)])
    with pytest.raises(Internal, match="output 'A'"):
        encode_infer_response(bad, _decoded([], True))


# --- compression ------------------------------------------------------------

PAYLOAD = b'{"inputs": []}' * 100


@pytest.mark.parametrize("encoding,compressed", [
    ("gzip", gzip.compress(PAYLOAD)),
    ("gzip", gzip.compress(PAYLOAD[:700]) + gzip.compress(PAYLOAD[700:])),  # two members
    ("deflate", zlib.compress(PAYLOAD)),
    ("deflate", zlib.compressobj(wbits=-15).compress(PAYLOAD) + zlib.compressobj(wbits=-15).flush()),
])
def test_inflate(encoding: str, compressed: bytes) -> None:
    if encoding == "deflate" and not compressed.startswith(b"x"):  # raw deflate
        c = zlib.compressobj(wbits=-15)
        compressed = c.compress(PAYLOAD) + c.flush()
    assert inflate_bounded(compressed, encoding, len(PAYLOAD)) == PAYLOAD


def test_inflate_bounds_and_damage() -> None:
    bomb = gzip.compress(b"\0" * (8 << 20))
    with pytest.raises(PayloadTooLarge):
        inflate_bounded(bomb, "gzip", 1 << 20)
    with pytest.raises(InvalidArgument, match="truncated"):
        inflate_bounded(gzip.compress(PAYLOAD)[:-20], "gzip", 1 << 20)
    with pytest.raises(InvalidArgument, match="garbage"):
        inflate_bounded(zlib.compress(PAYLOAD) + b"junk", "deflate", 1 << 20)
    with pytest.raises(InvalidArgument, match="not valid gzip"):
        inflate_bounded(b"\x1f\x8bnot really", "gzip", 1 << 20)


@pytest.mark.parametrize("header,expected", [
    ("", "identity"), ("gzip", "gzip"), ("deflate, gzip", "deflate"), ("gzip;q=0.5, deflate;q=0.8", "deflate"),
    ("br", "identity"), ("identity;q=1, gzip;q=0.9", "identity"), ("gzip;q=abc, deflate;q=0.1", "deflate"),
])
def test_choose_encoding(header: str, expected: str) -> None:
    assert choose_encoding(header) == expected


# --- management JSON --------------------------------------------------------


def test_message_to_json_matches_protobuf_json_but_with_integer_int64() -> None:
    cfg = model_config_pb2.ModelConfig(name="m", max_batch_size=4)
    cfg.input.add(name="X", data_type=model_config_pb2.TYPE_FP16, dims=[-1, 3])
    cfg.dynamic_batching.max_queue_delay_microseconds = 2**40
    cfg.parameters["k"].string_value = "v"
    out = message_to_json(cfg)
    assert out["input"][0]["dims"] == [-1, 3] and out["input"][0]["data_type"] == "TYPE_FP16"
    assert out["dynamic_batching"]["max_queue_delay_microseconds"] == 2**40
    assert out["parameters"] == {"k": {"string_value": "v"}}
    assert "sequence_batching" not in out and "version_policy" not in out
    from google.protobuf import json_format

    reference = json_format.MessageToDict(cfg, preserving_proto_field_name=True,
                                          always_print_fields_with_no_presence=True)
    assert reference["input"][0]["dims"] == ["-1", "3"]  # what we must not send
    assert out == _int64_as_numbers(reference, out)  # otherwise the very same document


def _int64_as_numbers(reference: Any, ours: Any) -> Any:
    """``reference`` with the int64 strings protobuf writes turned into numbers where ``ours`` has them."""
    if isinstance(reference, dict) and isinstance(ours, dict):
        return {k: _int64_as_numbers(v, ours.get(k)) for k, v in reference.items()}
    if isinstance(reference, list) and isinstance(ours, list) and len(ours) == len(reference):
        return [_int64_as_numbers(r, o) for r, o in zip(reference, ours)]
    if isinstance(reference, str) and type(ours) is int:
        return int(reference)
    return reference


def test_statistics_print_unset_messages() -> None:
    stats = service_pb2.ModelStatisticsResponse()
    stats.model_stats.add(name="m", version="1")
    out = message_to_json(stats, include_unset_messages=True)
    assert out["model_stats"][0]["inference_stats"]["queue"] == {"count": 0, "ns": 0}
    assert "inference_stats" not in message_to_json(stats)["model_stats"][0]


def test_repository_index_and_load_parameters() -> None:
    index = service_pb2.RepositoryIndexResponse()
    index.models.add(name="a")
    index.models.add(name="b", version="2", state="READY")
    assert repository_index_to_json(index) == [{"name": "a"}, {"name": "b", "version": "2", "state": "READY"}]
    params = load_parameters({"parameters": {"config": "{}", "file:1/m.onnx": "AAE=", "flag": True, "n": 3}})
    assert params["file:1/m.onnx"].bytes_param == b"\x00\x01"
    assert params["config"].string_param == "{}"
    assert params["flag"].bool_param is True and params["n"].int64_param == 3
    for bad in ({"config": 1}, {"file:x": "@@"}, {"n": 2**64}, {"x": [1]}):
        with pytest.raises(InvalidArgument):
            load_parameters({"parameters": bad})


# --- the error middleware -----------------------------------------------------


async def _through(exc: BaseException) -> web.StreamResponse:
    async def handler(request: web.Request) -> web.StreamResponse:
        raise exc

    return await error_middleware(make_mocked_request("POST", "/v2/models/m/infer"), handler)


async def test_middleware_maps_errors(caplog: pytest.LogCaptureFixture) -> None:
    resp = await _through(ModelNotFound("unknown model 'm'"))
    assert resp.status == 400 and orjson.loads(resp.body) == {"error": "unknown model 'm'"}
    resp = await _through(Overloaded("full", retry_after_s=0.2))
    assert resp.status == 503 and resp.headers["Retry-After"] == "1"
    resp = await _through(web.HTTPNotFound())
    assert resp.status == 404 and "no such endpoint" in orjson.loads(resp.body)["error"]
    with caplog.at_level(logging.ERROR, logger="gateway.frontends.http_api"):
        resp = await _through(KeyError("secret-key-name"))
    message = orjson.loads(resp.body)["error"]
    # The cause is named (type and message) so a user can report it; the traceback stays in the log.
    assert resp.status == 500 and message.startswith("internal error serving /v2/models/m/infer: KeyError:")
    assert "'secret-key-name'" in message and "gateway log" in message
    assert any(r.exc_info and "secret-key-name" in str(r.exc_info[1]) for r in caplog.records)


# --- fuzz -------------------------------------------------------------------


def _client_error_only(body: bytes, header_length: int | None) -> None:
    try:
        decode_infer_request(body, header_length, model="m", now=0.0)
    except (InvalidArgument, Unsupported):
        pass  # 400, or 501 for an extension this server does not offer


@settings(max_examples=300, deadline=None)
@given(body=st.binary(max_size=200), header_length=st.one_of(st.none(), st.integers(0, 220)))
def test_fuzz_decode_raw_bytes(body: bytes, header_length: int | None) -> None:
    _client_error_only(body, header_length)


_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**65), 2**65), st.floats(), st.text(max_size=5))
_value = st.recursive(_leaf, lambda inner: st.one_of(st.lists(inner, max_size=5),
                                                      st.dictionaries(st.text(max_size=5), inner, max_size=4)),
                      max_leaves=20)
_tensor = st.fixed_dictionaries({}, optional={
    "name": st.one_of(st.sampled_from(["X", "Y"]), _value),
    "datatype": st.one_of(st.sampled_from(["FP32", "INT8", "UINT64", "BOOL", "BYTES", "FP16", "BF16"]), _value),
    "shape": st.one_of(st.lists(st.integers(-1, 3), max_size=33), _value),
    "data": _value,
    "parameters": st.one_of(st.fixed_dictionaries({}, optional={"binary_data_size": _leaf, "other": _leaf}), _value),
})


@settings(max_examples=300, deadline=None)
@given(doc=st.fixed_dictionaries({}, optional={
    "id": _value, "inputs": st.one_of(st.lists(_tensor, max_size=3), _value),
    "outputs": _value, "parameters": _value}), blob=st.binary(max_size=16), use_header=st.booleans())
def test_fuzz_decode_json_structures(doc: dict[str, Any], blob: bytes, use_header: bool) -> None:
    header = json.dumps(doc).encode()
    _client_error_only(header + blob, len(header) if use_header else None)
