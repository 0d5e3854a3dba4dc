"""The fake InferenceCore behind the REST frontend tests, and the server that
serves it: aiohttp on 127.0.0.1 (port 0), in process, on its own event loop in
a thread, so the blocking sync client, the asyncio client and hypothesis can
all reach it.

Used by ``test_http_api_fake_core.py`` (endpoints and inference) and
``test_http_api_fake_core_errors.py`` (errors, malformed requests, fuzz); each
has its own module-scoped ``server`` fixture around :func:`serve_fake_core`.
"""

from __future__ import annotations

import asyncio
import gc
import http.client
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
from aiohttp import web
from tritonclient.grpc import model_config_pb2, service_pb2

from gateway.frontends.http_api import create_http_app
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


def serve_fake_core() -> Iterator[Server]:
    """Serve a fresh FakeCore until resumed: the body of each test module's
    module-scoped ``server`` fixture (``yield from serve_fake_core()``)."""
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


def infer_json(server: Server, model: str, doc: dict[str, Any], **headers: str) -> tuple[int, dict[str, str], Any]:
    status, hdrs, body = server.request("POST", f"/v2/models/{model}/infer", orjson.dumps(doc), headers)
    return status, hdrs, orjson.loads(body)


def assert_error(status: int, body: bytes, expected: int) -> str:
    assert status == expected, body
    doc = orjson.loads(body)
    assert set(doc) == {"error"} and isinstance(doc["error"], str) and doc["error"]
    return doc["error"]


def binary_body(doc: dict[str, Any], blob: bytes) -> tuple[bytes, dict[str, str]]:
    header = orjson.dumps(doc)
    return header + blob, {"Inference-Header-Content-Length": str(len(header))}
