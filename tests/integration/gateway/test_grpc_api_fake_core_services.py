"""The gRPC frontend's metadata, config, statistics, repository and health
services, served by a real grpc.aio server on 127.0.0.1 (port 0) in process
around the fake InferenceCore of grpc_fake_core.py, driven by the
real tritonclient (sync and asyncio) and the gRPC health stub."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aiogrpcclient
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from gateway.frontends.grpc_api import SERVICE_NAME, add_grpc_services
from tests.integration.gateway.grpc_fake_core import FakeCore, Served, serve_grpc_fake_core

WAIT_S = 10.0  # bound on waiting for an event that must happen; never a timing assert


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    async with serve_grpc_fake_core() as running:
        yield running


async def test_metadata_config_statistics_repository_sync_client(served: Served) -> None:
    def call() -> None:
        with grpcclient.InferenceServerClient(served.url) as client:
            assert client.is_server_live() and client.is_server_ready()
            assert client.get_server_metadata().name == "fake"
            assert client.is_model_ready("echo") and not client.is_model_ready("other")
            assert client.get_model_metadata("echo").inputs[0].shape == [-1, 3]
            assert client.get_model_config("echo").config.max_batch_size == 8
            assert client.get_inference_statistics("echo").model_stats[0].inference_count == 5
            assert [m.name for m in client.get_model_repository_index().models] == ["echo", "cold"]
            client.load_model("echo", config='{"max_batch_size": 4}', files={"file:1/model.onnx": b"\x01\x02"})
            client.unload_model("echo", unload_dependents=True)
            with pytest.raises(InferenceServerException) as info:
                client.get_model_config("other")
            assert info.value.status() == "StatusCode.NOT_FOUND"

    await asyncio.to_thread(call)
    ((name, params),) = served.core.loads
    assert name == "echo"
    assert params["config"].string_param == '{"max_batch_size": 4}'
    assert params["file:1/model.onnx"].bytes_param == b"\x01\x02"
    assert served.core.unloads == [("echo", True)]


async def test_repository_index_ready_only_asyncio_client(served: Served) -> None:
    async with aiogrpcclient.InferenceServerClient(served.url) as client:
        index = await client.get_model_repository_index(as_json=True)
        assert [m["name"] for m in index["models"]] == ["echo", "cold"]
    stub_index = await _call_ready_index(served.url)
    assert [m.name for m in stub_index.models] == ["echo"]


async def _call_ready_index(url: str) -> service_pb2.RepositoryIndexResponse:
    async with grpc.aio.insecure_channel(url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        return await stub.RepositoryIndex(service_pb2.RepositoryIndexRequest(ready=True))


async def test_health_service_and_set_serving(served: Served) -> None:
    async with grpc.aio.insecure_channel(served.url) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        infer = service_pb2_grpc.GRPCInferenceServiceStub(channel)

        async def status(service: str) -> int:
            return (await health.Check(health_pb2.HealthCheckRequest(service=service))).status

        serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
        watch = health.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
        assert (await asyncio.wait_for(watch.read(), WAIT_S)).status == serving
        assert [await status(""), await status(SERVICE_NAME)] == [serving, serving]
        assert (await infer.ServerReady(service_pb2.ServerReadyRequest())).ready
        served.frontend.set_serving(False)
        assert (await asyncio.wait_for(watch.read(), WAIT_S)).status == not_serving
        assert [await status(""), await status(SERVICE_NAME)] == [not_serving, not_serving]
        assert not (await infer.ServerReady(service_pb2.ServerReadyRequest())).ready
        assert (await infer.ServerLive(service_pb2.ServerLiveRequest())).live
        served.frontend.set_serving(True)
        assert (await asyncio.wait_for(watch.read(), WAIT_S)).status == serving
        assert await status(SERVICE_NAME) == serving
        watch.cancel()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await status("no.such.Service")
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_not_serving_until_set() -> None:
    server = grpc.aio.server()
    frontend = add_grpc_services(server, FakeCore())
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            check = health_pb2_grpc.HealthStub(channel).Check
            ready = service_pb2_grpc.GRPCInferenceServiceStub(channel).ServerReady
            assert (await check(health_pb2.HealthCheckRequest())).status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert not (await ready(service_pb2.ServerReadyRequest())).ready
            frontend.set_serving(True)
            assert (await check(health_pb2.HealthCheckRequest())).status == health_pb2.HealthCheckResponse.SERVING
            assert (await ready(service_pb2.ServerReadyRequest())).ready
    finally:
        await server.stop(grace=None)
