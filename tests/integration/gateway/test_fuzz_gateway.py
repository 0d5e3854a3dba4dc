"""Generated malformed requests against a real gateway process (hypothesis):
the HTTP JSON body, the binary tensor extension and its header, compressed
bodies (bombs included), and gRPC requests -- well-formed protobufs with bad
contents, and bytes that are no protobuf at all.

Asserted for every request: a 4xx (or 200) / a gRPC status other than
INTERNAL and UNKNOWN, never a 5xx, and the gateway process still alive; after
each family, a good request is answered correctly. Examples are derandomized,
so a run is repeatable. Shared-memory and classification parameters are left
out: they ask for features this server does not offer (501), they are not
malformed.
"""

from __future__ import annotations

import gzip
import http.client
import json
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2, service_pb2_grpc

from tests.harness import Proc, start, start_worker, worker_url

pytestmark = pytest.mark.timeout(240)

MAX_REQUEST_BYTES = 1 << 20  # small, so size limits and bombs are cheap to reach
FUZZ = settings(
    deadline=None, derandomize=True, database=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
DATATYPES = ["FP32", "FP16", "BF16", "FP64", "INT8", "INT16", "INT32", "INT64", "UINT8", "UINT64", "BOOL", "BYTES"]
OK_GRPC = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
           grpc.StatusCode.RESOURCE_EXHAUSTED}


@dataclass
class Tally:
    """What the fuzzer sent and what came back, for the report."""

    sent: int = 0
    statuses: dict[str, int] = field(default_factory=dict)

    def add(self, status: str) -> None:
        self.sent += 1
        self.statuses[status] = self.statuses.get(status, 0) + 1


TALLY = Tally()


@pytest.fixture(scope="module")
def gateway(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    config = tmp_path_factory.mktemp("fuzz") / "gateway.yaml"
    config.write_text(f"max_request_bytes: {MAX_REQUEST_BYTES}\ndefault_timeout_s: 20\n")
    worker = start_worker(model_repo, "--backend", "sim", "--sim-latency-ms", "1")
    proc = None
    try:
        proc = start(["gateway", "--worker", worker_url(worker), "--http-port", "0", "--grpc-port", "0",
                      "--config", str(config), "--log-level", "WARNING"])
        yield proc
        print(f"fuzz: {TALLY.sent} malformed requests, answers {dict(sorted(TALLY.statuses.items()))}")
        assert "Traceback" not in proc.log(), proc.log()[-4000:]
    finally:
        if proc is not None:
            proc.stop()
        worker.stop()


class Http:
    """One keep-alive connection, reopened when the server closes it (as after a 413)."""

    def __init__(self, port: int) -> None:
        self._port = port
        self._conn: http.client.HTTPConnection | None = None

    def post(self, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        for attempt in range(2):
            if self._conn is None:
                self._conn = http.client.HTTPConnection("127.0.0.1", self._port, timeout=30)
            try:
                self._conn.request("POST", path, body=body, headers=headers)
                response = self._conn.getresponse()
                return response.status, response.read()
            except (ConnectionError, http.client.HTTPException):
                self._conn.close()
                self._conn = None
                if attempt:
                    raise
        raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def client(gateway: Proc) -> Iterator[Http]:
    yield Http(gateway.ready["http_port"])


def check_http(gateway: Proc, status: int, body: bytes, *, may_expire: bool = False) -> None:
    """``may_expire``: the request set its own timeout, so 504 is a right answer (its deadline passed)."""
    TALLY.add(f"HTTP {status}")
    assert gateway.popen.poll() is None, "the gateway died"
    assert status < 500 or (may_expire and status == 504), (status, body[:300])
    if status != 200:
        error = json.loads(body)["error"]
        assert isinstance(error, str) and error and "Traceback" not in error


def good_request_works(client: Http) -> None:
    body = {"id": "good", "inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [2, 64], "data": [0.5] * 128}]}
    status, raw = client.post("/v2/models/mlp/infer", json.dumps(body).encode(), {"Content-Type": "application/json"})
    assert status == 200, raw[:300]
    out = json.loads(raw)
    assert out["id"] == "good" and out["outputs"][0]["shape"] == [2, 10]


# ---- strategies -----------------------------------------------------------------

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.text(max_size=6), inner, max_size=4), max_leaves=8)
dims = st.one_of(st.integers(min_value=0, max_value=80), st.integers(min_value=-5, max_value=2**63 + 5), scalars)
shapes = st.one_of(st.lists(dims, max_size=4), st.just([1, 64]), st.just([2, 64]), json_values)
param_keys = st.one_of(st.sampled_from(["priority", "timeout", "binary_data_size", "binary_data_output",
                                         "binary_data", "triton_enable_empty_final_response", "triton_x",
                                         "sequence_id", "custom"]), st.text(max_size=10))
parameters = st.one_of(st.dictionaries(param_keys, json_values, max_size=3), json_values)


@st.composite
def tensors(draw: st.DrawFn) -> Any:
    tensor: dict[str, Any] = {}
    if draw(st.booleans()):
        tensor["name"] = draw(st.one_of(st.just("INPUT"), st.text(max_size=8), json_values))
    if draw(st.booleans()):
        tensor["datatype"] = draw(st.one_of(st.sampled_from(DATATYPES), st.text(max_size=6), json_values))
    if draw(st.integers(0, 3)):
        tensor["shape"] = draw(shapes)
    choice = draw(st.integers(0, 3))
    if choice == 1:
        tensor["data"] = draw(json_values)
    elif choice == 2:
        n = draw(st.integers(0, 140))
        tensor["data"] = draw(st.lists(st.one_of(st.floats(width=32), st.integers(-10, 10), st.text(max_size=3)),
                                       min_size=n, max_size=n))
    elif choice == 3:
        tensor["data"] = [[draw(st.floats(width=32, allow_nan=False))] * 64] * draw(st.integers(0, 3))
    if draw(st.booleans()):
        tensor["parameters"] = draw(parameters)
    return tensor if draw(st.integers(0, 9)) else draw(json_values)


@st.composite
def infer_documents(draw: st.DrawFn) -> Any:
    doc: dict[str, Any] = {}
    if draw(st.booleans()):
        doc["id"] = draw(st.one_of(st.text(max_size=10), json_values))
    if draw(st.integers(0, 4)):
        doc["inputs"] = draw(st.one_of(st.lists(tensors(), max_size=3), json_values))
    if draw(st.booleans()):
        doc["outputs"] = draw(st.one_of(st.lists(st.one_of(
            st.fixed_dictionaries({"name": st.one_of(st.just("OUTPUT"), st.text(max_size=6), json_values)},
                                  optional={"parameters": parameters}), json_values), max_size=3), json_values))
    if draw(st.booleans()):
        doc["parameters"] = draw(parameters)
    return doc if draw(st.integers(0, 9)) else draw(json_values)


# What an HTTP client can put in a header value: printable ASCII.
header_text = st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=8)
model_paths = st.one_of(st.just("mlp"), st.just("mlp"), st.just("simple"), st.text(max_size=8))


# ---- HTTP ----------------------------------------------------------------------------


@settings(FUZZ, max_examples=300)
@given(doc=infer_documents(), model=model_paths)
def test_http_json_bodies(gateway: Proc, client: Http, doc: Any, model: str) -> None:
    body = json.dumps(doc, allow_nan=True).encode()
    status, raw = client.post(f"/v2/models/{quote(model, safe='')}/infer", body, {"Content-Type": "application/json"})
    check_http(gateway, status, raw, may_expire=b'"timeout"' in body)


@settings(FUZZ, max_examples=100)
@given(params=st.dictionaries(st.sampled_from(["priority", "timeout", "custom", "triton_x", "binary_data_output"]),
                              st.one_of(st.integers(-(2**64), 2**64), st.floats(), st.text(max_size=4),
                                        st.booleans()), max_size=3),
       timeout_header=st.one_of(st.none(), header_text, st.integers(-5, 10**12).map(str)))
def test_http_good_tensors_with_bad_parameters(gateway: Proc, client: Http, params: dict[str, Any],
                                               timeout_header: str | None) -> None:
    doc = {"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [1, 64], "data": [0.25] * 64}],
           "parameters": params}
    headers = {"Content-Type": "application/json"}
    if timeout_header is not None:
        headers["X-Request-Timeout-Ms"] = timeout_header
    status, raw = client.post("/v2/models/mlp/infer", json.dumps(doc).encode(), headers)
    check_http(gateway, status, raw, may_expire="timeout" in params or timeout_header is not None)


@settings(FUZZ, max_examples=60)
@given(raw=st.one_of(st.binary(max_size=200), st.text(max_size=200).map(str.encode),
                     st.integers(1, 3000).map(lambda n: b"[" * n + b"]" * n),
                     st.integers(1, 3000).map(lambda n: b'{"inputs":' + b"[" * n + b"1" + b"]" * n + b"}")))
def test_http_garbage_and_deep_json(gateway: Proc, client: Http, raw: bytes) -> None:
    status, body = client.post("/v2/models/mlp/infer", raw, {"Content-Type": "application/json"})
    check_http(gateway, status, body)


@st.composite
def binary_requests(draw: st.DrawFn) -> tuple[bytes, dict[str, str]]:
    rows = draw(st.integers(0, 3))
    size = draw(st.one_of(st.just(rows * 64 * 4), st.integers(-3, 2000), json_values))
    header: dict[str, Any] = {"inputs": [{"name": "INPUT", "datatype": draw(st.sampled_from(["FP32", "BYTES", "INT8"])),
                                          "shape": draw(st.one_of(st.just([rows, 64]), shapes)),
                                          "parameters": {"binary_data_size": size}}]}
    if draw(st.booleans()):
        header["outputs"] = [{"name": "OUTPUT", "parameters": {"binary_data": draw(json_values)}}]
    head = json.dumps(header).encode()
    tail = draw(st.one_of(st.just(np.zeros((rows, 64), np.float32).tobytes()), st.binary(max_size=1100)))
    length = draw(st.one_of(st.just(str(len(head))), st.integers(-5, len(head) + len(tail) + 5).map(str),
                            header_text, st.just(" 12"), st.just("1e3"), st.just(str(2**70))))
    return head + tail, {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": length}


@settings(FUZZ, max_examples=200)
@given(request=binary_requests())
def test_http_binary_extension(gateway: Proc, client: Http, request: tuple[bytes, dict[str, str]]) -> None:
    body, headers = request
    status, raw = client.post("/v2/models/mlp/infer", body, headers)
    check_http(gateway, status, raw)


def _bomb(encoding: str, size: int) -> bytes:
    zeros = b"\0" * size
    return gzip.compress(zeros, 9) if encoding == "gzip" else zlib.compress(zeros, 9)


BOMBS = {(e, n): _bomb(e, n) for e in ("gzip", "deflate") for n in (MAX_REQUEST_BYTES + 1, 64 * MAX_REQUEST_BYTES)}


@settings(FUZZ, max_examples=60)
@given(
    encoding=st.sampled_from(["gzip", "deflate", "x-gzip", "br", "GZIP", "identity, gzip"]),
    payload=st.one_of(
        st.sampled_from(sorted(BOMBS)).map(BOMBS.__getitem__),
        st.binary(max_size=300),
        st.binary(min_size=1, max_size=300).map(lambda b: gzip.compress(b)[: max(1, len(b) // 2)]),  # truncated
        st.binary(max_size=100).map(lambda b: gzip.compress(b) + b"trailing junk"),
    ),
    timeout_header=st.one_of(st.none(), header_text, st.integers(-5, 10**12).map(str)),
)
def test_http_compressed_bodies_and_headers(gateway: Proc, client: Http, encoding: str, payload: bytes,
                                            timeout_header: str | None) -> None:
    headers = {"Content-Type": "application/json", "Content-Encoding": encoding}
    if timeout_header is not None:
        headers["X-Request-Timeout-Ms"] = timeout_header
    status, raw = client.post("/v2/models/mlp/infer", payload, headers)
    check_http(gateway, status, raw, may_expire=timeout_header is not None)
    bomb = next((kind for (kind, _), data in BOMBS.items() if data == payload), None)
    if bomb is not None and encoding == bomb:
        assert status == 413  # inflated in bounded steps, refused once past the limit


def test_http_oversize_body_is_413(gateway: Proc, client: Http) -> None:
    status, raw = client.post("/v2/models/mlp/infer", b" " * (MAX_REQUEST_BYTES + 10), {})
    check_http(gateway, status, raw)
    assert status == 413
    good_request_works(client)


# ---- gRPC ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def channel(gateway: Proc) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(f"127.0.0.1:{gateway.ready['grpc_port']}") as ch:
        yield ch


@st.composite
def infer_messages(draw: st.DrawFn) -> service_pb2.ModelInferRequest:
    pb = service_pb2.ModelInferRequest(
        model_name=draw(st.one_of(st.just("mlp"), st.just("simple"), st.text(max_size=6))),
        model_version=draw(st.one_of(st.just(""), st.text(max_size=3))),
        id=draw(st.text(max_size=8)),
    )
    raw = draw(st.booleans())
    for _ in range(draw(st.integers(0, 3))):
        tensor = pb.inputs.add(
            name=draw(st.one_of(st.just("INPUT"), st.text(max_size=5))),
            datatype=draw(st.one_of(st.sampled_from(DATATYPES), st.text(max_size=5))),
            shape=draw(st.one_of(st.just([1, 64]), st.lists(st.one_of(st.integers(-3, 70),
                                                                         st.integers(-(2**63), 2**63 - 1)), max_size=4))),
        )
        if raw:
            pb.raw_input_contents.append(draw(st.one_of(st.binary(max_size=600),
                                                        st.just(np.zeros((1, 64), np.float32).tobytes()))))
        else:
            contents = draw(st.sampled_from(["fp32_contents", "int_contents", "int64_contents", "bytes_contents",
                                             "bool_contents", "uint_contents"]))
            field_values = {
                "fp32_contents": st.floats(width=32), "int_contents": st.integers(-(2**31), 2**31 - 1),
                "int64_contents": st.integers(-(2**63), 2**63 - 1), "bytes_contents": st.binary(max_size=5),
                "bool_contents": st.booleans(), "uint_contents": st.integers(0, 2**32 - 1),
            }[contents]
            getattr(tensor.contents, contents).extend(draw(st.lists(field_values, max_size=130)))
        for key in draw(st.lists(param_keys, max_size=2)):
            tensor.parameters[key].int64_param = draw(st.integers(-(2**63), 2**63 - 1))
    if raw and draw(st.integers(0, 4)) == 0:
        pb.raw_input_contents.append(b"extra")  # more raw contents than inputs
    for key in draw(st.lists(param_keys, max_size=3)):
        which = draw(st.sampled_from(["int64_param", "string_param", "bool_param", "double_param", "uint64_param"]))
        value = {"int64_param": st.integers(-(2**63), 2**63 - 1), "string_param": st.text(max_size=5),
                 "bool_param": st.booleans(), "double_param": st.floats(),
                 "uint64_param": st.integers(0, 2**64 - 1)}[which]
        setattr(pb.parameters[key], which, draw(value))
    for name in draw(st.lists(st.one_of(st.just("OUTPUT"), st.text(max_size=4)), max_size=2)):
        pb.outputs.add(name=name)
    return pb


def check_grpc(gateway: Proc, code: grpc.StatusCode, details: str, *, may_expire: bool = False) -> None:
    TALLY.add(f"gRPC {code.name}")
    assert gateway.popen.poll() is None, "the gateway died"
    assert code in OK_GRPC or (may_expire and code is grpc.StatusCode.DEADLINE_EXCEEDED), (code, details)


def good_grpc_request_works(channel: grpc.Channel) -> None:
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    pb = service_pb2.ModelInferRequest(model_name="mlp", id="good")
    pb.inputs.add(name="INPUT", datatype="FP32", shape=[1, 64])
    pb.raw_input_contents.append(np.ones((1, 64), np.float32).tobytes())
    response = stub.ModelInfer(pb, timeout=30)
    assert response.id == "good" and list(response.outputs[0].shape) == [1, 10]


@settings(FUZZ, max_examples=350)
@given(pb=infer_messages())
def test_grpc_requests_with_bad_contents(gateway: Proc, channel: grpc.Channel, pb: service_pb2.ModelInferRequest) -> None:
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    try:
        stub.ModelInfer(pb, timeout=30)
        code, details = grpc.StatusCode.OK, ""
    except grpc.RpcError as e:
        code, details = e.code(), e.details()
    check_grpc(gateway, code, details, may_expire="timeout" in pb.parameters)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


wire_garbage = st.one_of(
    st.binary(max_size=120),
    # A field header claiming far more bytes than follow.
    st.integers(1, 2**40).map(lambda n: b"\x0a" + _varint(n) + b"mlp"),
    # A string field (model_name) that is not UTF-8.
    st.binary(min_size=1, max_size=8).map(lambda b: b"\x0a" + _varint(len(b) + 1) + b"\xff" + b),
    # A packed repeated int64 (the shape) cut inside a varint.
    st.just(b"\x2a\x08\x0a\x05INPUT\x1a\x04" + struct.pack("<I", 0xFFFFFFFF)),
)


@settings(FUZZ, max_examples=120)
@given(data=wire_garbage, method=st.sampled_from(["ModelInfer", "ModelMetadata", "ModelConfig", "ServerReady",
                                                   "RepositoryModelLoad", "ModelStatistics"]))
def test_grpc_bytes_that_are_no_protobuf(gateway: Proc, channel: grpc.Channel, data: bytes, method: str) -> None:
    call = channel.unary_unary(f"/inference.GRPCInferenceService/{method}")
    try:
        call(data, timeout=30)
        code, details = grpc.StatusCode.OK, ""
    except grpc.RpcError as e:
        code, details = e.code(), e.details()
    check_grpc(gateway, code, details)


def test_grpc_oversize_message_and_stream_garbage(gateway: Proc, channel: grpc.Channel) -> None:
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    pb = service_pb2.ModelInferRequest(model_name="mlp")
    pb.inputs.add(name="INPUT", datatype="FP32", shape=[1, 64])
    pb.raw_input_contents.append(b"\0" * (MAX_REQUEST_BYTES + 10))
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(pb, timeout=30)
    check_grpc(gateway, info.value.code(), info.value.details())
    assert info.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    # A stream whose second message is no protobuf ends with INVALID_ARGUMENT, after answering the first.
    stream = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")
    good = service_pb2.ModelInferRequest(model_name="mlp", id="s1")
    good.inputs.add(name="INPUT", datatype="FP32", shape=[1, 64])
    good.raw_input_contents.append(np.zeros((1, 64), np.float32).tobytes())
    responses = stream(iter([good.SerializeToString(), b"\xff\xff\xff"]), timeout=30)
    with pytest.raises(grpc.RpcError) as info:
        for _ in responses:
            pass
    check_grpc(gateway, info.value.code(), info.value.details())
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    good_grpc_request_works(channel)


def test_the_gateway_still_serves(gateway: Proc, client: Http, channel: grpc.Channel) -> None:
    good_request_works(client)
    good_grpc_request_works(channel)
    assert TALLY.sent >= 1000
