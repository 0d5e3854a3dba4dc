"""The fake InferenceCore behind the gRPC frontend tests, and the in-process
grpc.aio server (127.0.0.1, port 0) that serves it on the test's event loop.

Used by ``test_grpc_api_fake_core.py`` (inference, deadlines, streams) and
``test_grpc_api_fake_core_services.py`` (metadata, repository, health); each
has its own ``served`` fixture around :func:`serve_grpc_fake_core`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc
from tritonclient.grpc import model_config_pb2, service_pb2

from gateway.frontends.grpc_api import GrpcFrontend, add_grpc_services
from gateway.types import InferRequest, InferResponse, RelayCall, Tensor
from protos import codec
from protos.errors import InvalidArgument, ModelNotFound, Overloaded


class FakeCore:
    """Models: ``echo`` (each input back as ``<name>_out``), ``sum`` (A+B, FP32),
    ``gate`` (waits for ``gate_open``), ``slow`` (never answers), ``fail``
    (raises what the ``raise`` parameter names)."""

    def __init__(self) -> None:
        self.requests: list[InferRequest] = []
        self.seen_at: dict[str, float] = {}  # request id -> loop.time() when the core got it
        self.started = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.gate_open = asyncio.Event()
        self.loads: list[tuple[str, dict[str, service_pb2.ModelRepositoryParameter]]] = []
        self.unloads: list[tuple[str, bool]] = []

    def relays(self, model: str, version: str = "") -> bool:
        return False  # every call is read (the relay lane is the real core's: tests/integration/gateway/test_relay.py)

    async def relay(self, call: RelayCall) -> bytes:
        raise AssertionError("not relayed")

    async def infer(self, request: InferRequest) -> InferResponse:
        self.requests.append(request)
        self.seen_at[request.id] = asyncio.get_running_loop().time()
        if request.model == "echo":
            wanted = {o.name for o in request.outputs}
            outs = [Tensor(f"{t.name}_out", t.datatype, t.shape, t.data) for t in request.inputs]
            outs = [t for t in outs if not wanted or t.name in wanted]
        elif request.model == "sum":
            a, b = (codec.decode(t.datatype, t.shape, t.data) for t in request.inputs)
            dt, shape, raw = codec.encode(a + b)
            outs = [Tensor("SUM", dt, tuple(shape), raw)]
        elif request.model in ("gate", "slow"):
            self.started.set()
            try:
                await (self.gate_open.wait() if request.model == "gate" else asyncio.Event().wait())
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
            outs = []
        elif request.model == "dropped":  # the core's own wait was cancelled (e.g. a batcher closing)
            raise asyncio.CancelledError
        elif request.model == "fail":
            kind = request.parameters.get("raise")
            if kind == "overloaded":
                raise Overloaded("queue full", retry_after_s=2.5)
            if kind == "invalid":
                raise InvalidArgument("input 'A' has the wrong shape")
            raise RuntimeError("secret internal detail")
        else:
            raise ModelNotFound(f"unknown model '{request.model}'")
        return InferResponse(request.model, "1", request.id, outs, {"_internal": 1})

    async def stream(self, request: InferRequest) -> AsyncIterator[InferResponse]:
        yield await self.infer(request)  # ordinary models only: one response

    def stream_written(self, response: InferResponse) -> None:
        pass

    def server_live(self) -> bool:
        return True

    def server_ready(self) -> bool:
        return True

    def server_metadata(self) -> service_pb2.ServerMetadataResponse:
        return service_pb2.ServerMetadataResponse(name="fake", version="9", extensions=["model_repository"])

    def model_ready(self, name: str, version: str = "") -> bool:
        return name == "echo"

    def _known(self, name: str) -> None:
        if name != "echo":
            raise ModelNotFound(f"unknown model '{name}'")

    def model_metadata(self, name: str, version: str = "") -> service_pb2.ModelMetadataResponse:
        self._known(name)
        md = service_pb2.ModelMetadataResponse(name=name, versions=["1"], platform="onnxruntime_onnx")
        md.inputs.add(name="A", datatype="FP32", shape=[-1, 3])
        return md

    def model_config(self, name: str, version: str = "") -> model_config_pb2.ModelConfig:
        self._known(name)
        return model_config_pb2.ModelConfig(name=name, max_batch_size=8)

    async def model_statistics(self, name: str = "", version: str = "") -> service_pb2.ModelStatisticsResponse:
        stats = service_pb2.ModelStatisticsResponse()
        stats.model_stats.add(name=name or "echo", version="1", inference_count=5)
        return stats

    async def repository_index(self, ready_only: bool = False) -> service_pb2.RepositoryIndexResponse:
        index = service_pb2.RepositoryIndexResponse()
        index.models.add(name="echo", version="1", state="READY")
        if not ready_only:
            index.models.add(name="cold", state="UNAVAILABLE")
        return index

    async def load_model(self, name: str, parameters: dict[str, service_pb2.ModelRepositoryParameter]) -> None:
        self.loads.append((name, parameters))

    async def unload_model(self, name: str, unload_dependents: bool = False) -> None:
        self.unloads.append((name, unload_dependents))


@dataclass
class Served:
    core: FakeCore
    frontend: GrpcFrontend
    url: str


@asynccontextmanager
async def serve_grpc_fake_core() -> AsyncIterator[Served]:
    """The gRPC frontend on a grpc.aio server on 127.0.0.1 (port 0) around a fresh :class:`FakeCore`."""
    core = FakeCore()
    server = grpc.aio.server()
    frontend = add_grpc_services(server, core)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    frontend.set_serving(True)
    try:
        yield Served(core, frontend, f"127.0.0.1:{port}")
    finally:
        await server.stop(grace=None)
