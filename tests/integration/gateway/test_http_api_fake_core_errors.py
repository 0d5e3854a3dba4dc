"""The REST frontend's errors around a fake InferenceCore (``fake_core``): core
errors mapped to statuses, unexpected errors hidden and logged, routing
errors, a client hangup cancelling its request, malformed inference bodies
rejected before the core, and fuzzed bodies that must never be a 5xx.

The server runs on its own event loop in a thread (module-scoped), so the
blocking sync client and hypothesis can both reach it.
"""

from __future__ import annotations

import gzip
import http.client
import json
import logging
import socket
import zlib
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.integration.gateway.fake_core import (
    MAX_REQUEST_BYTES,
    SECRET,
    WAIT_S,
    Server,
    assert_error,
    binary_body,
    serve_fake_core,
)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    yield from serve_fake_core()

# --- errors -----------------------------------------------------------------

VALID = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [2], "data": [1.0, 2.0]}]}


def test_core_errors_map_to_status(server: Server) -> None:
    def fail(kind: str) -> tuple[int, dict[str, str], bytes]:
        doc = dict(VALID, parameters={"raise": kind})
        return server.request("POST", "/v2/models/fail/infer", orjson.dumps(doc))

    status, hdrs, body = fail("overloaded")
    assert_error(status, body, 503)
    assert hdrs["retry-after"] == "3"
    status, hdrs, body = fail("quota")
    assert_error(status, body, 429)
    assert hdrs["retry-after"] == "1"
    status, _, body = fail("deadline")
    assert_error(status, body, 504)
    status, _, body = fail("invalid")
    assert assert_error(status, body, 400) == "input 'A' has the wrong shape"
    status, _, body = server.request("POST", "/v2/models/nope/infer", orjson.dumps(VALID))
    assert "unknown model" in assert_error(status, body, 400)


def test_unexpected_error_names_its_cause_and_is_logged(server: Server, caplog: pytest.LogCaptureFixture) -> None:
    doc = dict(VALID, id="r-boom", parameters={"raise": "other"})
    with caplog.at_level(logging.ERROR, logger="gateway.frontends.http_api"):
        status, _, body = server.request("POST", "/v2/models/fail/infer", orjson.dumps(doc))
    message = assert_error(status, body, 500)
    # The client learns the cause and the request id to quote; the traceback stays in the log.
    assert message.startswith("internal error") and f"RuntimeError: {SECRET}" in message
    assert "r-boom" in message and "Traceback" not in message
    logged = [r for r in caplog.records if r.name == "gateway.frontends.http_api" and r.exc_info]
    assert logged and "r-boom" in logged[-1].getMessage()
    assert SECRET in str(logged[-1].exc_info[1])


def test_malformed_model_outputs_are_server_errors(server: Server) -> None:
    status, _, body = server.request("POST", "/v2/models/badout/infer", orjson.dumps(VALID))
    assert "malformed output" in assert_error(status, body, 500)
    # Non-UTF-8 BYTES cannot go into JSON: the client is told to ask for binary.
    doc = dict(VALID, outputs=[{"name": "S", "parameters": {"binary_data": False}}])
    status, _, body = server.request("POST", "/v2/models/latin/infer", orjson.dumps(doc))
    assert "binary" in assert_error(status, body, 400)
    doc = dict(VALID, outputs=[{"name": "S", "parameters": {"binary_data": True}}])
    status, hdrs, body = server.request("POST", "/v2/models/latin/infer", orjson.dumps(doc))
    assert status == 200 and body.endswith(b"\x02\x00\x00\x00\xff\xfe")
    assert hdrs["content-type"] == "application/octet-stream"


def test_client_hangup_cancels_the_request(server: Server) -> None:
    conn = http.client.HTTPConnection(server.url, timeout=WAIT_S)
    conn.request("POST", "/v2/models/hang/infer", orjson.dumps(VALID))
    assert server.core.hang_started.wait(WAIT_S)
    assert not server.core.hang_cancelled.is_set()
    conn.close()
    assert server.core.hang_cancelled.wait(WAIT_S), "the core's infer was not cancelled"


def test_routing_errors_are_json(server: Server) -> None:
    status, _, body = server.request("GET", "/v2/nothing/here")
    assert "no such endpoint" in assert_error(status, body, 404)
    status, hdrs, body = server.request("GET", "/v2/models/echo/infer")
    assert_error(status, body, 405)
    assert "POST" in hdrs["allow"]
    status, _, body = server.request("GET", "/v2/models/echo/versions/abc")
    assert_error(status, body, 404)


def test_chunked_with_content_length_refused_with_one_log_line(server: Server, caplog: pytest.LogCaptureFixture) -> None:
    # Both framings at once is the request-smuggling pattern RFC 9112 section 6.3 lets a server refuse:
    # a 400 naming the conflict, the connection closed, and one warning line instead of a traceback.
    body = b"8\r\n" + bytes(8) + b"\r\n0\r\n\r\n"
    head = (b"POST /v2/models/echo/infer HTTP/1.1\r\nHost: test\r\nInference-Header-Content-Length: 0\r\n"
            b"Transfer-Encoding: chunked\r\nContent-Length: %d\r\n\r\n" % len(body))
    host, port = server.url.split(":")
    with caplog.at_level(logging.DEBUG), socket.create_connection((host, int(port)), timeout=WAIT_S) as conn:
        conn.sendall(head + body)
        answer = b""
        while chunk := conn.recv(65536):  # the server closes the connection after answering
            answer += chunk
    status_line, _, text = answer.partition(b"\r\n")
    assert status_line.split()[1] == b"400", answer
    assert b"Content-Length can't be present with Transfer-Encoding" in text
    refused = [r for r in caplog.records if "malformed HTTP request" in r.getMessage()]
    assert len(refused) == 1 and refused[0].levelno == logging.WARNING and refused[0].exc_info is None
    assert refused[0].getMessage().endswith("(400): Content-Length can't be present with Transfer-Encoding")
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]



BAD_REQUESTS: list[tuple[str, bytes, dict[str, str], int, str]] = [
    ("empty body", b"", {}, 400, "empty"),
    ("not json", b"{inputs: nope", {}, 400, "malformed JSON"),
    ("json array", b"[1, 2]", {}, 400, "JSON object"),
    ("no inputs", b"{}", {}, 400, "inputs"),
    ("inputs not list", b'{"inputs": {}}', {}, 400, "inputs"),
    ("id not string", orjson.dumps(dict(VALID, id=5)), {}, 400, "'id'"),
    ("shape strings", orjson.dumps({"inputs": [{"name": "X", "datatype": "FP32", "shape": ["2"], "data": [1, 2]}]}),
     {}, 400, "shape"),
    ("negative dim", orjson.dumps({"inputs": [{"name": "X", "datatype": "FP32", "shape": [-2], "data": []}]}),
     {}, 400, "shape"),
    ("data count", orjson.dumps({"inputs": [{"name": "X", "datatype": "FP32", "shape": [3], "data": [1, 2]}]}),
     {}, 400, "Shape does not match true shape of 'data' field"),
    ("bad dtype", orjson.dumps({"inputs": [{"name": "X", "datatype": "FP33", "shape": [1], "data": [1]}]}),
     {}, 400, "datatype"),
    ("string in ints", orjson.dumps({"inputs": [{"name": "X", "datatype": "INT32", "shape": [1], "data": ["1"]}]}),
     {}, 400, "INT32"),
    ("data and binary", orjson.dumps({"inputs": [{"name": "X", "datatype": "INT8", "shape": [1], "data": [1],
                                                  "parameters": {"binary_data_size": 1}}]}), {}, 400, "exactly one"),
    ("duplicate input", orjson.dumps({"inputs": [VALID["inputs"][0], VALID["inputs"][0]]}), {}, 400, "input 'X' already exists in request"),
    ("header length not int", orjson.dumps(VALID), {"Inference-Header-Content-Length": "abc"}, 400,
     "Inference-Header-Content-Length"),
    ("header length lies", orjson.dumps(VALID), {"Inference-Header-Content-Length": "100000"}, 400,
     "Inference-Header-Content-Length"),
    ("triton_ parameter", orjson.dumps(dict(VALID, parameters={"triton_x": 1})), {}, 400, "triton_"),
    ("priority negative", orjson.dumps(dict(VALID, parameters={"priority": -1})), {}, 400, "priority"),
    ("timeout string", orjson.dumps(dict(VALID, parameters={"timeout": "1s"})), {}, 400, "timeout"),
    ("nested parameter", orjson.dumps(dict(VALID, parameters={"x": {"y": 1}})), {}, 400, "parameter 'x'"),
    ("classification", orjson.dumps(dict(VALID, outputs=[{"name": "X_out", "parameters": {"classification": "2"}}])),
     {}, 400, "Unable to set 'classification'"),
    ("shared memory", orjson.dumps({"inputs": [{"name": "X", "datatype": "FP32", "shape": [1],
                                                "parameters": {"shared_memory_region": "r"}}]}), {}, 400,
     "'shared_memory_byte_size' must be specified along with 'shared_memory_region' parameter for tensor 'X'"),
    ("unknown shared memory region", orjson.dumps({"inputs": [{"name": "X", "datatype": "FP32", "shape": [1],
     "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 4}}]}), {}, 404,
     "Unable to find shared memory region: 'r'"),
    ("binary_data not bool", orjson.dumps(dict(VALID, outputs=[{"name": "X_out", "parameters": {"binary_data": 1}}])),
     {}, 400, "binary_data"),
    ("unsupported encoding", orjson.dumps(VALID), {"Content-Encoding": "compress"}, 400, "Content-Encoding"),
    ("corrupt gzip", b"\x1f\x8b\x08\x00garbage-garbage-garbage", {"Content-Encoding": "gzip"}, 400, "request body"),
    ("truncated gzip", gzip.compress(orjson.dumps(VALID))[:-12], {"Content-Encoding": "gzip"}, 400, ""),
    ("too large", b" " * (MAX_REQUEST_BYTES + 1), {}, 413, "limit"),
    ("gzip bomb", gzip.compress(b" " * (MAX_REQUEST_BYTES * 8)), {"Content-Encoding": "gzip"}, 413, "limit"),
    ("deflate bomb", zlib.compress(b" " * (MAX_REQUEST_BYTES * 8)), {"Content-Encoding": "deflate"}, 413, "limit"),
]
_FP32_DOC = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [2], "parameters": {"binary_data_size": 8}}]}
BAD_REQUESTS += [
    ("binary truncated", *binary_body(_FP32_DOC, b"\0" * 5), 400, "binary_data_size is 8"),
    ("binary trailing", *binary_body(_FP32_DOC, b"\0" * 12), 400, "no input claims"),
    ("binary size vs shape", *binary_body(
        {"inputs": [{"name": "X", "datatype": "FP32", "shape": [3], "parameters": {"binary_data_size": 8}}]},
        b"\0" * 8), 400, "input byte size mismatch for input 'X' for model 'echo'. Expected 12, got 8"),
    ("binary without header", orjson.dumps(_FP32_DOC), {}, 400, "binary_data_size is 8"),
    ("bytes prefix lies", *binary_body(
        {"inputs": [{"name": "S", "datatype": "BYTES", "shape": [1], "parameters": {"binary_data_size": 6}}]},
        b"\x09\x00\x00\x00ab"), 400, "BYTES"),
]


@pytest.mark.parametrize("body,headers,status,fragment", [r[1:] for r in BAD_REQUESTS],
                         ids=[r[0] for r in BAD_REQUESTS])
def test_malformed_infer_requests(server: Server, body: bytes, headers: dict[str, str], status: int,
                                  fragment: str) -> None:
    before = len(server.core.requests)
    got, _, reply = server.request("POST", "/v2/models/echo/infer", body, headers)
    assert fragment in assert_error(got, reply, status)
    assert len(server.core.requests) == before  # rejected before reaching the core


# --- fuzz -------------------------------------------------------------------

_json_scalar = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
                         st.text(max_size=8))
_json_value = st.recursive(_json_scalar, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)), max_leaves=12)
_datatype = st.sampled_from(["FP32", "INT8", "UINT64", "BOOL", "BYTES", "FP16", "X", ""])
_input = st.fixed_dictionaries(
    {"name": st.one_of(st.text(max_size=4), _json_value), "datatype": st.one_of(_datatype, _json_value)},
    optional={
        "shape": st.one_of(st.lists(st.integers(-2, 4), max_size=3), _json_value),
        "data": st.one_of(st.lists(st.one_of(st.integers(-300, 300), st.floats(allow_nan=False), st.text(max_size=3),
                                             st.booleans(), st.lists(st.integers(-3, 3), max_size=3)), max_size=6),
                          _json_value),
        "parameters": st.one_of(st.fixed_dictionaries({"binary_data_size": st.integers(-2, 10)}), _json_value),
    },
)
_doc = st.fixed_dictionaries(
    {},
    optional={
        "id": _json_value,
        "inputs": st.one_of(st.lists(_input, max_size=3), _json_value),
        "outputs": st.one_of(st.lists(st.fixed_dictionaries({"name": st.text(max_size=4)}, optional={
            "parameters": st.dictionaries(st.sampled_from(["binary_data", "classification", "x"]), _json_scalar)}),
            max_size=2), _json_value),
        "parameters": st.one_of(st.dictionaries(st.sampled_from(["priority", "timeout", "binary_data_output",
                                                                 "triton_x", "p"]), _json_scalar), _json_value),
    },
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(doc=_doc, blob=st.binary(max_size=24), header_extra=st.one_of(st.none(), st.integers(-5, 40)))
def test_fuzz_infer_bodies_never_5xx(server: Server, doc: dict[str, Any], blob: bytes,
                                     header_extra: int | None) -> None:
    header = json.dumps(doc).encode()  # stdlib: it writes integers beyond 64 bits too
    headers = {}
    if header_extra is not None:
        headers["Inference-Header-Content-Length"] = str(len(header) + header_extra)
    status, _, body = server.request("POST", "/v2/models/echo/infer", header + blob, headers)
    _assert_client_side(status, body)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=64), encoding=st.sampled_from([None, "gzip", "deflate", "identity"]))
def test_fuzz_raw_bytes_never_5xx(server: Server, raw: bytes, encoding: str | None) -> None:
    headers = {"Content-Encoding": encoding} if encoding else {}
    status, _, body = server.request("POST", "/v2/models/echo/infer", raw, headers)
    _assert_client_side(status, body)


def _assert_client_side(status: int, body: bytes) -> None:
    """A 2xx, a 4xx, or 501 for an extension the server does not offer; never a server failure."""
    if status == 200:
        return
    message = assert_error(status, body, status)
    assert status < 500 or (status == 501 and "not supported" in message), (status, message)
