"""gateway/replicas/worker_client.py against a real grpc.aio server on 127.0.0.1:
probes travel on a connection of their own, so they never wait behind a bulk
transfer, and answer while a large request is still in flight."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from gateway.replicas.worker_client import WorkerClient

pytestmark = pytest.mark.timeout(60)


class Servicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    """Records each call's peer (the client's address and port: one per connection)."""

    def __init__(self) -> None:
        self.peers: dict[str, set[str]] = {}
        self.release = asyncio.Event()
        self.received = asyncio.Event()

    def _seen(self, method: str, context: Any) -> None:
        self.peers.setdefault(method, set()).add(context.peer())

    async def ServerReady(self, request: Any, context: Any) -> service_pb2.ServerReadyResponse:
        self._seen("ready", context)
        return service_pb2.ServerReadyResponse(ready=True)

    async def RepositoryIndex(self, request: Any, context: Any) -> service_pb2.RepositoryIndexResponse:
        self._seen("index", context)
        return service_pb2.RepositoryIndexResponse()

    async def ModelInfer(self, request: Any, context: Any) -> service_pb2.ModelInferResponse:
        self._seen("infer", context)
        self.received.set()
        await self.release.wait()
        return service_pb2.ModelInferResponse(model_name=request.model_name)


@pytest.fixture
async def server() -> AsyncIterator[tuple[Servicer, str]]:
    servicer = Servicer()
    srv = grpc.aio.server(options=[("grpc.max_receive_message_length", 2**31 - 1)])
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    await srv.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        servicer.release.set()
        await srv.stop(None)


async def test_probes_use_their_own_connection_and_answer_beside_a_large_request(server: tuple[Servicer, str]) -> None:
    servicer, address = server
    client = WorkerClient(address)
    try:
        request = service_pb2.ModelInferRequest(model_name="big")
        request.raw_input_contents.append(bytes(50 * 2**20))  # 50 MiB
        infer = asyncio.create_task(client.infer(request, timeout_s=30))
        await asyncio.wait_for(servicer.received.wait(), 30)
        # The large request is in flight; the probe's calls answer at once beside it.
        assert await client.server_ready(timeout_s=5)
        await client.repository_index(timeout_s=5)
        assert not infer.done()
        servicer.release.set()
        assert (await infer).model_name == "big"
        assert client.connected("data") and client.connected("control")
    finally:
        await client.close()
    assert servicer.peers["ready"] == servicer.peers["index"]
    assert servicer.peers["ready"].isdisjoint(servicer.peers["infer"]), servicer.peers
