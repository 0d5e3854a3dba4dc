"""The REST frontend served by aiohttp on 127.0.0.1 (port 0), in process, around
a fake InferenceCore, driven by the real tritonclient.http (sync and asyncio)
and by raw HTTP requests where the wire itself is checked.

The server runs on its own event loop in a thread (module-scoped), so the
blocking sync client, the asyncio client and hypothesis can all reach it.
"""

from __future__ import annotations

import asyncio
import base64
import gc
import gzip
import http.client
import json
import logging
import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import numpy as np
import orjson
import pytest
import tritonclient.http as httpclient
import tritonclient.http.aio as aiohttpclient
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tritonclient.grpc import model_config_pb2, service_pb2
from tritonclient.utils import InferenceServerException

from gateway.http_api import create_http_app
from gateway.types import InferRequest, InferResponse, Tensor
from protos import codec
from protos.errors import DeadlineExceeded, InvalidArgument, ModelNotFound, Overloaded, QuotaExceeded

MAX_REQUEST_BYTES = 2 * 2**20
WAIT_S = 30.0  # bound on the server thread starting or stopping; never a timing assert
SECRET = "secret internal detail 8d1f"


class FakeCore:
    """Models: ``echo`` (each input back as ``<name>_out``), ``sum`` (A+B and A-B),
    ``zeros`` (FP32 zeros of the length in input N), ``badout`` (an output whose
    bytes do not match its shape), ``latin`` (a BYTES output that is not UTF-8),
    ``fail`` (raises what its ``raise`` parameter names), ``hang`` (never answers),
    ``cold`` (not ready)."""

    def __init__(self) -> None:
        self.requests: list[InferRequest] = []
        self.loads: list[tuple[str, dict[str, service_pb2.ModelRepositoryParameter]]] = []
        self.unloads: list[tuple[str, bool]] = []
        self.index_calls: list[bool] = []
        self.ready = True
        # Set from the server's loop, waited on from the test thread.
        self.hang_started = threading.Event()
        self.hang_cancelled = threading.Event()

    async def infer(self, request: InferRequest) -> InferResponse:
        self.requests.append(request)
        if request.model == "echo":
            outs = [Tensor(f"{t.name}_out", t.datatype, t.shape, bytes(t.data)) for t in request.inputs]
        elif request.model == "sum":
            a, b = (codec.decode(t.datatype, t.shape, t.data) for t in request.inputs)
            outs = [_tensor("SUM", a + b), _tensor("DIFF", a - b)]
        elif request.model == "zeros":
            n = int(codec.decode("INT64", (1,), request.inputs[0].data)[0])
            outs = [_tensor("Z", np.zeros(n, dtype=np.float32))]
        elif request.model == "badout":
            outs = [Tensor("Y", "FP32", (4,), b"\0" * 3)]
        elif request.model == "latin":
            outs = [Tensor("S", "BYTES", (1,), codec.serialize_bytes_tensor(np.array([b"\xff\xfe"], dtype=object)))]
        elif request.model == "hang":
            self.hang_started.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.hang_cancelled.set()
                raise
            outs = []
        elif request.model == "fail":
            kind = request.parameters.get("raise")
            if kind == "overloaded":
                raise Overloaded("queue full", retry_after_s=2.5)
            if kind == "quota":
                raise QuotaExceeded("too many requests", retry_after_s=1)
            if kind == "deadline":
                raise DeadlineExceeded("deadline exceeded while queued")
            if kind == "invalid":
                raise InvalidArgument("input 'A' has the wrong shape")
            raise RuntimeError(SECRET)
        else:
            raise ModelNotFound(f"unknown model '{request.model}'")
        wanted = {o.name for o in request.outputs}
        outs = [t for t in outs if not wanted or t.name in wanted]
        return InferResponse(request.model, request.version or "1", request.id, outs)

    def server_live(self) -> bool:
        return True

    def server_ready(self) -> bool:
        return self.ready

    def server_metadata(self) -> service_pb2.ServerMetadataResponse:
        return service_pb2.ServerMetadataResponse(
            name="infergate", version="0.1.0", extensions=["binary_tensor_data", "model_repository"]
        )

    def model_ready(self, name: str, version: str = "") -> bool:
        self._known(name)
        return name != "cold"

    def _known(self, name: str) -> None:
        if name not in ("echo", "sum", "cold"):
            raise ModelNotFound(f"unknown model '{name}'")

    def model_metadata(self, name: str, version: str = "") -> service_pb2.ModelMetadataResponse:
        self._known(name)
        md = service_pb2.ModelMetadataResponse(name=name, versions=["1", "2"], platform="onnxruntime_onnx")
        md.inputs.add(name="A", datatype="FP32", shape=[-1, 4])
        md.inputs.add(name="B", datatype="FP32", shape=[-1, 4])
        md.outputs.add(name="SUM", datatype="FP32", shape=[-1, 4])
        return md

    def model_config(self, name: str, version: str = "") -> model_config_pb2.ModelConfig:
        self._known(name)
        cfg = model_config_pb2.ModelConfig(name=name, platform="onnxruntime_onnx", max_batch_size=8)
        cfg.input.add(name="A", data_type=model_config_pb2.TYPE_FP32, dims=[4])
        cfg.output.add(name="SUM", data_type=model_config_pb2.TYPE_FP32, dims=[4])
        cfg.dynamic_batching.preferred_batch_size.extend([4, 8])
        cfg.dynamic_batching.max_queue_delay_microseconds = 100
        return cfg

    async def model_statistics(self, name: str = "", version: str = "") -> service_pb2.ModelStatisticsResponse:
        stats = service_pb2.ModelStatisticsResponse()
        for model in [name] if name else ["echo", "sum"]:
            self._known(model)
            entry = stats.model_stats.add(name=model, version=version or "1", inference_count=7,
                                          execution_count=3, last_inference=1_700_000_000_000)
            entry.inference_stats.success.count = 7
            entry.inference_stats.success.ns = 12_345_678_901
            batch = entry.batch_stats.add(batch_size=4)
            batch.compute_infer.count = 2
        return stats

    async def repository_index(self, ready_only: bool = False) -> service_pb2.RepositoryIndexResponse:
        self.index_calls.append(ready_only)
        index = service_pb2.RepositoryIndexResponse()
        index.models.add(name="echo", version="1", state="READY")
        if not ready_only:
            index.models.add(name="cold", version="1", state="UNAVAILABLE", reason="unloaded")
        return index

    async def load_model(self, name: str, parameters: dict[str, service_pb2.ModelRepositoryParameter]) -> None:
        self.loads.append((name, parameters))

    async def unload_model(self, name: str, unload_dependents: bool = False) -> None:
        self.unloads.append((name, unload_dependents))


def _tensor(name: str, arr: np.ndarray) -> Tensor:
    dt, shape, raw = codec.encode(arr)
    return Tensor(name, dt, tuple(shape), raw)


@dataclass
class Server:
    core: FakeCore
    url: str  # host:port, as tritonclient wants it

    @property
    def base(self) -> str:
        return f"http://{self.url}"

    def request(self, method: str, path: str, body: bytes | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPConnection(self.url, timeout=WAIT_S)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            conn.close()


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    core = FakeCore()
    loop = asyncio.new_event_loop()
    started = threading.Event()
    state: dict[str, Any] = {}

    def serve() -> None:
        asyncio.set_event_loop(loop)
        runner = web.AppRunner(create_http_app(core, max_request_bytes=MAX_REQUEST_BYTES))
        try:
            loop.run_until_complete(runner.setup())
            site = web.TCPSite(runner, "127.0.0.1", 0)
            loop.run_until_complete(site.start())
            state["port"] = runner.addresses[0][1]
        except BaseException as exc:  # reported to the fixture, which fails the tests
            state["error"] = exc
            started.set()
            return
        started.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())
        loop.close()

    thread = threading.Thread(target=serve, name="http-api-test-server")
    thread.start()
    assert started.wait(WAIT_S), "server thread did not start"
    assert "error" not in state, state.get("error")
    yield Server(core, f"127.0.0.1:{state['port']}")
    gc.collect()
    loop.call_soon_threadsafe(loop.stop)
    thread.join(WAIT_S)
    assert not thread.is_alive()


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[httpclient.InferenceServerClient]:
    # One client for the module: its __del__ must run on this thread (gevent
    # refuses another), which the server fixture's gc.collect() makes sure of.
    with httpclient.InferenceServerClient(server.url) as c:
        yield c


def _infer_json(server: Server, model: str, doc: dict[str, Any], **headers: str) -> tuple[int, dict[str, str], Any]:
    status, hdrs, body = server.request("POST", f"/v2/models/{model}/infer", orjson.dumps(doc), headers)
    return status, hdrs, orjson.loads(body)


def _assert_error(status: int, body: bytes, expected: int) -> str:
    assert status == expected, body
    doc = orjson.loads(body)
    assert set(doc) == {"error"} and isinstance(doc["error"], str) and doc["error"]
    return doc["error"]


# --- health, metadata, config, statistics, repository ---------------------------


def test_health_and_server_metadata(server: Server, client: httpclient.InferenceServerClient) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert server.request("GET", "/v2/health/live")[2] == b'{"live":true}'
    assert server.request("GET", "/v2/health/ready")[2] == b'{"ready":true}'
    meta = client.get_server_metadata()
    assert meta == {"name": "infergate", "version": "0.1.0", "extensions": ["binary_tensor_data", "model_repository"]}
    server.core.ready = False
    try:
        assert not client.is_server_ready()
        status, _, body = server.request("GET", "/v2/health/ready")
        assert "not ready" in _assert_error(status, body, 503)
    finally:
        server.core.ready = True


def test_model_metadata_has_integer_shapes(server: Server, client: httpclient.InferenceServerClient) -> None:
    meta = client.get_model_metadata("sum")
    assert meta["name"] == "sum" and meta["versions"] == ["1", "2"] and meta["platform"] == "onnxruntime_onnx"
    assert meta["inputs"][0] == {"name": "A", "datatype": "FP32", "shape": [-1, 4]}
    assert meta["outputs"] == [{"name": "SUM", "datatype": "FP32", "shape": [-1, 4]}]
    assert client.get_model_metadata("sum", "2")["name"] == "sum"
    with pytest.raises(InferenceServerException) as err:
        client.get_model_metadata("nope")
    assert err.value.status() == "400" and "unknown model 'nope'" in err.value.message()


def test_model_ready(server: Server, client: httpclient.InferenceServerClient) -> None:
    assert client.is_model_ready("echo")
    assert client.is_model_ready("echo", "1")
    assert not client.is_model_ready("cold")
    status, _, body = server.request("GET", "/v2/models/cold/ready")
    assert "not ready" in _assert_error(status, body, 400)
    status, _, body = server.request("GET", "/v2/models/nope/versions/3/ready")
    _assert_error(status, body, 400)


def test_model_config_is_snake_case_with_integer_dims(client: httpclient.InferenceServerClient) -> None:
    cfg = client.get_model_config("sum")
    assert cfg["name"] == "sum" and cfg["max_batch_size"] == 8
    assert cfg["input"][0]["dims"] == [4] and cfg["input"][0]["data_type"] == "TYPE_FP32"
    assert cfg["dynamic_batching"]["preferred_batch_size"] == [4, 8]
    assert cfg["dynamic_batching"]["max_queue_delay_microseconds"] == 100
    # Unset sub-messages stay absent: their presence would change the meaning.
    assert "sequence_batching" not in cfg and "ensemble_scheduling" not in cfg
    # The JSON goes back into a ModelConfig, as a load with a config override would.
    from google.protobuf import json_format

    parsed = json_format.ParseDict(cfg, model_config_pb2.ModelConfig())
    assert parsed.dynamic_batching.max_queue_delay_microseconds == 100


def test_statistics_shapes(client: httpclient.InferenceServerClient) -> None:
    stats = client.get_inference_statistics("sum")
    (entry,) = stats["model_stats"]
    assert entry["name"] == "sum" and entry["version"] == "1"
    assert entry["inference_count"] == 7 and entry["execution_count"] == 3
    assert entry["last_inference"] == 1_700_000_000_000
    inf = entry["inference_stats"]
    assert inf["success"] == {"count": 7, "ns": 12_345_678_901}
    for key in ("fail", "queue", "compute_input", "compute_infer", "compute_output"):
        assert inf[key] == {"count": 0, "ns": 0}, key
    assert entry["batch_stats"][0]["batch_size"] == 4
    assert entry["batch_stats"][0]["compute_infer"] == {"count": 2, "ns": 0}
    everything = client.get_inference_statistics()
    assert [m["name"] for m in everything["model_stats"]] == ["echo", "sum"]
    assert client.get_inference_statistics("sum", "2")["model_stats"][0]["version"] == "2"


def test_repository_index(server: Server, client: httpclient.InferenceServerClient) -> None:
    index = client.get_model_repository_index()
    assert index == [
        {"name": "echo", "version": "1", "state": "READY"},
        {"name": "cold", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"},
    ]
    status, _, body = server.request("POST", "/v2/repository/index", b'{"ready": true}')
    assert status == 200 and orjson.loads(body) == [{"name": "echo", "version": "1", "state": "READY"}]
    assert server.core.index_calls[-2:] == [False, True]
    status, _, body = server.request("POST", "/v2/repository/index", b'{"ready": "yes"}')
    _assert_error(status, body, 400)


def test_load_with_config_and_files_then_unload(server: Server, client: httpclient.InferenceServerClient) -> None:
    config = orjson.dumps({"name": "newm", "backend": "onnxruntime", "max_batch_size": 4}).decode()
    model_bytes = bytes(range(256)) * 3
    client.load_model("newm", config=config, files={"file:1/model.onnx": model_bytes})
    name, params = server.core.loads[-1]
    assert name == "newm"
    assert params["config"].string_param == config
    assert params["file:1/model.onnx"].bytes_param == model_bytes
    client.load_model("plain")
    assert server.core.loads[-1] == ("plain", {})
    client.unload_model("newm", unload_dependents=True)
    client.unload_model("plain")
    assert server.core.unloads[-2:] == [("newm", True), ("plain", False)]
    status, _, body = server.request("POST", "/v2/repository/models/x/load",
                                     b'{"parameters": {"file:1/model.onnx": "not base64!"}}')
    assert "base64" in _assert_error(status, body, 400)
    status, _, body = server.request("POST", "/v2/repository/models/x/unload",
                                     b'{"parameters": {"unload_dependents": 1}}')
    _assert_error(status, body, 400)


# --- inference with tritonclient --------------------------------------------

DTYPES = ["BOOL", "INT8", "UINT16", "INT32", "INT64", "UINT64", "FP16", "FP32", "FP64", "BYTES"]


def _sample(datatype: str, shape: tuple[int, ...] = (2, 3)) -> np.ndarray:
    rng = np.random.default_rng(abs(hash(datatype)) % 1000)
    if datatype == "BYTES":
        words = np.array(["", "héllo", "a b", "x" * 40, "🙂", "z"], dtype=object)
        return words[: int(np.prod(shape))].reshape(shape)
    if datatype == "BOOL":
        return rng.integers(0, 2, size=shape).astype(bool)
    dtype = codec.numpy_dtype(datatype)
    if dtype.kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(max(info.min, -100), min(info.max, 100), size=shape, dtype=dtype, endpoint=True)


@pytest.mark.parametrize("binary_in", [True, False], ids=["binary-in", "json-in"])
@pytest.mark.parametrize("datatype", DTYPES)
def test_echo_round_trip(client: httpclient.InferenceServerClient, datatype: str, binary_in: bool) -> None:
    arr = _sample(datatype)
    inp = httpclient.InferInput("X", list(arr.shape), datatype)
    inp.set_data_from_numpy(arr, binary_data=binary_in)
    outputs = [httpclient.InferRequestedOutput("X_out", binary_data=not binary_in)]
    result = client.infer("echo", [inp], outputs=outputs)
    got = result.as_numpy("X_out")
    assert got.shape == arr.shape
    if datatype == "BYTES":  # binary outputs come back as bytes, JSON ones as str
        expected = arr if binary_in else np.vectorize(lambda s: s.encode(), otypes=[object])(arr)
        assert got.tolist() == expected.tolist()
    else:
        np.testing.assert_array_equal(got.astype(arr.dtype), arr)
    out = result.get_output("X_out")
    assert ("data" in out) == binary_in  # the output came back the other way round
    assert ("binary_data_size" in out.get("parameters", {})) != binary_in


def test_sum_default_binary_output_and_version(server: Server, client: httpclient.InferenceServerClient) -> None:
    a = np.arange(8, dtype=np.float32).reshape(2, 4)
    b = np.full((2, 4), 0.5, dtype=np.float32)
    inputs = [httpclient.InferInput("A", [2, 4], "FP32"), httpclient.InferInput("B", [2, 4], "FP32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    result = client.infer("sum", inputs, model_version="2", request_id="req-7")
    np.testing.assert_array_equal(result.as_numpy("SUM"), a + b)
    np.testing.assert_array_equal(result.as_numpy("DIFF"), a - b)
    response = result.get_response()
    assert response["id"] == "req-7" and response["model_name"] == "sum" and response["model_version"] == "2"
    assert all("binary_data_size" in o["parameters"] for o in response["outputs"])
    req = server.core.requests[-1]
    assert req.version == "2" and req.id == "req-7" and req.outputs == []
    assert all(isinstance(t.data, memoryview) for t in req.inputs)  # zero-copy slices of the body


def test_per_output_binary_choice(client: httpclient.InferenceServerClient) -> None:
    a = np.ones((1, 4), dtype=np.float32)
    inputs = [httpclient.InferInput("A", [1, 4], "FP32"), httpclient.InferInput("B", [1, 4], "FP32")]
    for i in inputs:
        i.set_data_from_numpy(a, binary_data=False)
    outputs = [httpclient.InferRequestedOutput("SUM", binary_data=True),
               httpclient.InferRequestedOutput("DIFF", binary_data=False)]
    result = client.infer("sum", inputs, outputs=outputs)
    assert result.get_output("SUM")["parameters"] == {"binary_data_size": 16}
    assert result.get_output("DIFF")["data"] == [0.0] * 4
    np.testing.assert_array_equal(result.as_numpy("SUM"), 2 * a)
    only = client.infer("sum", inputs, outputs=[httpclient.InferRequestedOutput("DIFF")])
    assert [o["name"] for o in only.get_response()["outputs"]] == ["DIFF"]


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compressed_request_and_response(client: httpclient.InferenceServerClient, algorithm: str) -> None:
    arr = np.arange(1000, dtype=np.int32).reshape(10, 100)
    inp = httpclient.InferInput("X", [10, 100], "INT32")
    inp.set_data_from_numpy(arr)
    result = client.infer("echo", [inp], request_compression_algorithm=algorithm,
                          response_compression_algorithm=algorithm)
    np.testing.assert_array_equal(result.as_numpy("X_out"), arr)


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_response_really_compressed(server: Server, encoding: str) -> None:
    doc = {"inputs": [{"name": "X", "datatype": "INT32", "shape": [500], "data": [7] * 500}]}
    status, hdrs, body = server.request("POST", "/v2/models/echo/infer", orjson.dumps(doc),
                                        {"Accept-Encoding": f"identity;q=0.5, {encoding}"})
    assert status == 200 and hdrs["content-encoding"] == encoding
    plain = gzip.decompress(body) if encoding == "gzip" else zlib.decompress(body)
    assert orjson.loads(plain)["outputs"][0]["data"] == [7] * 500


def test_parameters_priority_timeout(server: Server, client: httpclient.InferenceServerClient) -> None:
    inp = httpclient.InferInput("X", [1], "INT32")
    inp.set_data_from_numpy(np.array([1], dtype=np.int32))
    client.infer("echo", [inp], priority=2, timeout=1_500_000, parameters={"tenant": "blue", "n": 3})
    req = server.core.requests[-1]
    assert req.priority == 2 and req.timeout_us == 1_500_000 and req.deadline is not None
    assert req.parameters == {"tenant": "blue", "n": 3}
    with pytest.raises(InferenceServerException) as err:
        client.infer("echo", [inp], parameters={"triton_enable_empty_final_response": True})
    assert err.value.status() == "400" and "triton_" in err.value.message()


def test_large_binary_response_is_streamed_intact(server: Server, client: httpclient.InferenceServerClient) -> None:
    n = 600_000  # 2.4 MB of output: over the size where parts are written one by one
    inp = httpclient.InferInput("N", [1], "INT64")
    inp.set_data_from_numpy(np.array([n], dtype=np.int64))
    z = client.infer("zeros", [inp]).as_numpy("Z")
    assert z.shape == (n,) and not z.any()
    doc = {"inputs": [{"name": "N", "datatype": "INT64", "shape": [1], "data": [n]}],
           "parameters": {"binary_data_output": True}}
    status, hdrs, body = server.request("POST", "/v2/models/zeros/infer", orjson.dumps(doc))
    assert status == 200 and "content-encoding" not in hdrs
    header_length = int(hdrs["inference-header-content-length"])
    assert int(hdrs["content-length"]) == len(body) == header_length + 4 * n
    assert orjson.loads(body[:header_length])["outputs"][0]["parameters"] == {"binary_data_size": 4 * n}


async def test_aio_client_round_trips(server: Server) -> None:
    async with aiohttpclient.InferenceServerClient(server.url) as c:
        assert await c.is_server_live() and await c.is_server_ready()
        assert await c.is_model_ready("echo") and not await c.is_model_ready("cold")
        assert (await c.get_model_metadata("sum"))["inputs"][1]["shape"] == [-1, 4]
        assert (await c.get_model_config("sum"))["input"][0]["dims"] == [4]
        assert (await c.get_inference_statistics("echo"))["model_stats"][0]["inference_count"] == 7
        assert len(await c.get_model_repository_index()) == 2
        # (tritonclient 2.41's asyncio load_model cannot send files: it lacks its base64 import.)
        await c.load_model("m2", config='{"name": "m2"}')
        assert server.core.loads[-1][1]["config"].string_param == '{"name": "m2"}'
        await c.unload_model("m2")
        for datatype, binary in [("BYTES", True), ("BOOL", False), ("FP16", True), ("FP16", False), ("UINT8", True)]:
            arr = _sample(datatype, (3, 2))
            inp = aiohttpclient.InferInput("X", [3, 2], datatype)
            inp.set_data_from_numpy(arr, binary_data=binary)
            # (Its request compression lacks the gzip/zlib imports in 2.41; responses work.)
            result = await c.infer("echo", [inp], request_id=f"aio-{datatype}",
                                   response_compression_algorithm="deflate" if binary else "gzip")
            got = result.as_numpy("X_out")
            if datatype == "BYTES":
                assert [s.decode() for s in got.reshape(-1)] == arr.reshape(-1).tolist()
            else:
                np.testing.assert_array_equal(got, arr)
            assert result.get_response()["id"] == f"aio-{datatype}"
        with pytest.raises(InferenceServerException) as err:
            await c.infer("fail", [inp], parameters={"raise": "overloaded"})
        assert err.value.status() == "503"


# --- errors -----------------------------------------------------------------

VALID = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [2], "data": [1.0, 2.0]}]}


def test_core_errors_map_to_status(server: Server) -> None:
    def fail(kind: str) -> tuple[int, dict[str, str], bytes]:
        doc = dict(VALID, parameters={"raise": kind})
        return server.request("POST", "/v2/models/fail/infer", orjson.dumps(doc))

    status, hdrs, body = fail("overloaded")
    _assert_error(status, body, 503)
    assert hdrs["retry-after"] == "3"
    status, hdrs, body = fail("quota")
    _assert_error(status, body, 429)
    assert hdrs["retry-after"] == "1"
    status, _, body = fail("deadline")
    _assert_error(status, body, 504)
    status, _, body = fail("invalid")
    assert _assert_error(status, body, 400) == "input 'A' has the wrong shape"
    status, _, body = server.request("POST", "/v2/models/nope/infer", orjson.dumps(VALID))
    assert "unknown model" in _assert_error(status, body, 400)


def test_unexpected_error_is_generic_500_and_logged(server: Server, caplog: pytest.LogCaptureFixture) -> None:
    doc = dict(VALID, id="r-boom", parameters={"raise": "other"})
    with caplog.at_level(logging.ERROR, logger="gateway.http_api"):
        status, _, body = server.request("POST", "/v2/models/fail/infer", orjson.dumps(doc))
    message = _assert_error(status, body, 500)
    assert SECRET not in message and "Traceback" not in message
    logged = [r for r in caplog.records if r.name == "gateway.http_api" and r.exc_info]
    assert logged and "r-boom" in logged[-1].getMessage()
    assert SECRET in str(logged[-1].exc_info[1])


def test_malformed_model_outputs_are_server_errors(server: Server) -> None:
    status, _, body = server.request("POST", "/v2/models/badout/infer", orjson.dumps(VALID))
    assert "malformed output" in _assert_error(status, body, 500)
    # Non-UTF-8 BYTES cannot go into JSON: the client is told to ask for binary.
    doc = dict(VALID, outputs=[{"name": "S", "parameters": {"binary_data": False}}])
    status, _, body = server.request("POST", "/v2/models/latin/infer", orjson.dumps(doc))
    assert "binary" in _assert_error(status, body, 400)
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
    assert "no such endpoint" in _assert_error(status, body, 404)
    status, hdrs, body = server.request("GET", "/v2/models/echo/infer")
    _assert_error(status, body, 405)
    assert "POST" in hdrs["allow"]
    status, _, body = server.request("GET", "/v2/models/echo/versions/abc")
    _assert_error(status, body, 404)


def _binary_body(doc: dict[str, Any], blob: bytes) -> tuple[bytes, dict[str, str]]:
    header = orjson.dumps(doc)
    return header + blob, {"Inference-Header-Content-Length": str(len(header))}


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
     {}, 400, "expected 3 elements"),
    ("bad dtype", orjson.dumps({"inputs": [{"name": "X", "datatype": "FP33", "shape": [1], "data": [1]}]}),
     {}, 400, "datatype"),
    ("string in ints", orjson.dumps({"inputs": [{"name": "X", "datatype": "INT32", "shape": [1], "data": ["1"]}]}),
     {}, 400, "INT32"),
    ("data and binary", orjson.dumps({"inputs": [{"name": "X", "datatype": "INT8", "shape": [1], "data": [1],
                                                  "parameters": {"binary_data_size": 1}}]}), {}, 400, "exactly one"),
    ("duplicate input", orjson.dumps({"inputs": [VALID["inputs"][0], VALID["inputs"][0]]}), {}, 400, "more than once"),
    ("header length not int", orjson.dumps(VALID), {"Inference-Header-Content-Length": "abc"}, 400,
     "Inference-Header-Content-Length"),
    ("header length lies", orjson.dumps(VALID), {"Inference-Header-Content-Length": "100000"}, 400,
     "Inference-Header-Content-Length"),
    ("triton_ parameter", orjson.dumps(dict(VALID, parameters={"triton_x": 1})), {}, 400, "triton_"),
    ("priority negative", orjson.dumps(dict(VALID, parameters={"priority": -1})), {}, 400, "priority"),
    ("timeout string", orjson.dumps(dict(VALID, parameters={"timeout": "1s"})), {}, 400, "timeout"),
    ("nested parameter", orjson.dumps(dict(VALID, parameters={"x": {"y": 1}})), {}, 400, "parameter 'x'"),
    ("classification", orjson.dumps(dict(VALID, outputs=[{"name": "X_out", "parameters": {"classification": 2}}])),
     {}, 501, "classification"),
    ("shared memory", orjson.dumps({"inputs": [{"name": "X", "datatype": "FP32", "shape": [1],
                                                "parameters": {"shared_memory_region": "r"}}]}), {}, 501,
     "shared memory"),
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
    ("binary truncated", *_binary_body(_FP32_DOC, b"\0" * 5), 400, "binary_data_size is 8"),
    ("binary trailing", *_binary_body(_FP32_DOC, b"\0" * 12), 400, "no input claims"),
    ("binary size vs shape", *_binary_body(
        {"inputs": [{"name": "X", "datatype": "FP32", "shape": [3], "parameters": {"binary_data_size": 8}}]},
        b"\0" * 8), 400, "expected 12 bytes"),
    ("binary without header", orjson.dumps(_FP32_DOC), {}, 400, "binary_data_size is 8"),
    ("bytes prefix lies", *_binary_body(
        {"inputs": [{"name": "S", "datatype": "BYTES", "shape": [1], "parameters": {"binary_data_size": 6}}]},
        b"\x09\x00\x00\x00ab"), 400, "BYTES"),
]


@pytest.mark.parametrize("body,headers,status,fragment", [r[1:] for r in BAD_REQUESTS],
                         ids=[r[0] for r in BAD_REQUESTS])
def test_malformed_infer_requests(server: Server, body: bytes, headers: dict[str, str], status: int,
                                  fragment: str) -> None:
    before = len(server.core.requests)
    got, _, reply = server.request("POST", "/v2/models/echo/infer", body, headers)
    assert fragment in _assert_error(got, reply, status)
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
    message = _assert_error(status, body, status)
    assert status < 500 or (status == 501 and "not supported" in message), (status, message)


async def test_raw_aiohttp_binary_request_with_json_header(server: Server) -> None:
    """The binary extension as a non-tritonclient sends it, with a JSON and a binary output."""
    a = np.arange(4, dtype=np.float32)
    doc = {"id": "raw-1", "inputs": [
        {"name": "A", "datatype": "FP32", "shape": [4], "parameters": {"binary_data_size": 16}},
        {"name": "B", "datatype": "FP32", "shape": [4], "data": [[1, 1], [1, 1]]}],
        "outputs": [{"name": "SUM"}, {"name": "DIFF", "parameters": {"binary_data": True}}]}
    body, headers = _binary_body(doc, a.tobytes())
    async with aiohttp.ClientSession(auto_decompress=False) as session:
        async with session.post(f"{server.base}/v2/models/sum/infer", data=body,
                                headers={**headers, "Accept-Encoding": "identity"}) as resp:
            assert resp.status == 200
            payload = await resp.read()
            header_length = int(resp.headers["Inference-Header-Content-Length"])
    head = orjson.loads(payload[:header_length])
    assert head["id"] == "raw-1"
    assert head["outputs"][0] == {"name": "SUM", "datatype": "FP32", "shape": [4], "data": [1.0, 2.0, 3.0, 4.0]}
    assert head["outputs"][1]["parameters"] == {"binary_data_size": 16}
    np.testing.assert_array_equal(np.frombuffer(payload[header_length:], dtype=np.float32), a - 1)


def test_load_body_base64_matches_tritonclient(server: Server) -> None:
    content = b"\x00onnx\xff"
    doc = {"parameters": {"config": "{}", "file:1/model.onnx": base64.b64encode(content).decode()}}
    status, _, _ = server.request("POST", "/v2/repository/models/raw/load", orjson.dumps(doc))
    assert status == 200 and server.core.loads[-1][1]["file:1/model.onnx"].bytes_param == content
