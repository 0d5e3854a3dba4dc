"""The relay lane (gateway/core/relay.py) through a real gateway in this process, in front of
servers written here that speak Triton's protocol and record every ModelInfer call's bytes:
a relayed call arrives as the client sent it and its answer comes back as the server wrote it;
a server's error comes back in its words and code; a failure before the answer is retried on
another server; the client's deadline and cancel reach the server; sequences stay on one
server; models the gateway must read (response cache, classification) and ``relay: off`` do
not take the lane.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import grpc
import numpy as np
import pytest
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2

from gateway.app import RunningGateway, start_gateway
from gateway.config import load_config

pytestmark = pytest.mark.timeout(120)

SERVICE = "inference.GRPCInferenceService"
WAIT_S = 30.0  # bound on waiting for a condition; never a timing assert


def _config(name: str, **extra: Any) -> mc.ModelConfig:
    config = mc.ModelConfig(name=name, backend="python", max_batch_size=8)
    config.input.add(name="INPUT", data_type=mc.TYPE_FP32, dims=[4])
    config.output.add(name="OUTPUT", data_type=mc.TYPE_FP32, dims=[4])
    if extra.get("sequence"):
        config.sequence_batching.SetInParent()
    else:
        config.dynamic_batching.SetInParent()
    if extra.get("cache"):
        config.response_cache.enable = True
    if extra.get("labels"):
        config.output[0].label_filename = "labels.txt"
    return config


MODELS = {
    "relayed": _config("relayed"),
    "cached": _config("cached", cache=True),
    "labelled": _config("labelled", labels=True),
    "seq": _config("seq", sequence=True),
}


def _metadata(config: mc.ModelConfig) -> service_pb2.ModelMetadataResponse:
    md = service_pb2.ModelMetadataResponse(name=config.name, versions=["1"], platform="python")
    md.inputs.add(name="INPUT", datatype="FP32", shape=[-1, 4])
    md.outputs.add(name="OUTPUT", datatype="FP32", shape=[-1, 4])
    return md


@dataclass
class FakeTriton:
    """A server of ``MODELS`` in Triton's protocol; ModelInfer echoes INPUT as OUTPUT unless ``behaviour`` says."""

    name: str
    calls: list[bytes] = field(default_factory=list)  # each ModelInfer request's bytes, as received
    answers: list[bytes] = field(default_factory=list)  # each answer's bytes, as sent
    # (server, request bytes) -> None to answer, or awaited for its effect (raise, abort, hang).
    behaviour: Callable[["FakeTriton", bytes, grpc.aio.ServicerContext], Awaitable[None]] | None = None
    received: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    address: str = ""

    async def model_infer(self, data: bytes, context: grpc.aio.ServicerContext) -> bytes:
        self.calls.append(data)
        self.received.set()
        try:
            if self.behaviour is not None:
                await self.behaviour(self, data, context)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        request = service_pb2.ModelInferRequest.FromString(data)
        reply = service_pb2.ModelInferResponse(model_name=request.model_name, model_version="1", id=request.id)
        reply.parameters["served_by"].string_param = self.name
        shape = list(request.inputs[0].shape)
        reply.outputs.add(name="OUTPUT", datatype="FP32", shape=shape)
        reply.raw_output_contents.append(request.raw_input_contents[0])
        answer = reply.SerializeToString()
        self.answers.append(answer)
        return answer

    def handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        def fixed(reply: Callable[[bytes], Any]) -> grpc.RpcMethodHandler:
            async def handler(data: bytes, context: Any) -> bytes:
                return reply(data).SerializeToString()
            return grpc.unary_unary_rpc_method_handler(handler)

        index = service_pb2.RepositoryIndexResponse()
        for name in MODELS:
            index.models.add(name=name, version="1", state="READY")
        return {
            "ServerLive": fixed(lambda _: service_pb2.ServerLiveResponse(live=True)),
            "ServerReady": fixed(lambda _: service_pb2.ServerReadyResponse(ready=True)),
            "ServerMetadata": fixed(lambda _: service_pb2.ServerMetadataResponse(name="triton", version="2.51.0")),
            "ModelReady": fixed(lambda _: service_pb2.ModelReadyResponse(ready=True)),
            "RepositoryIndex": fixed(lambda _: index),
            "ModelStatistics": fixed(lambda _: service_pb2.ModelStatisticsResponse()),
            "ModelConfig": fixed(lambda d: service_pb2.ModelConfigResponse(
                config=MODELS[service_pb2.ModelConfigRequest.FromString(d).name])),
            "ModelMetadata": fixed(lambda d: _metadata(MODELS[service_pb2.ModelMetadataRequest.FromString(d).name])),
            # No serializers: the request's bytes are recorded as they arrived.
            "ModelInfer": grpc.unary_unary_rpc_method_handler(self.model_infer),
        }


@asynccontextmanager
async def fake_tritons(count: int) -> AsyncIterator[list[FakeTriton]]:
    servers, fakes = [], []
    try:
        for i in range(count):
            fake = FakeTriton(f"triton-{i}")
            server = grpc.aio.server()
            server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, fake.handlers()),))
            fake.address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
            await server.start()
            servers.append(server)
            fakes.append(fake)
        yield fakes
    finally:
        for server in servers:
            await server.stop(None)


@asynccontextmanager
async def gateway_before(fakes: list[FakeTriton], path: str | None = None,
                         **settings: Any) -> AsyncIterator[RunningGateway]:
    settings.setdefault("relay", "auto")  # the lane is off unless asked for
    config = load_config(path, host="127.0.0.1", http_port=0, grpc_port=0,
                         workers=[f"triton://{f.address}" for f in fakes], **settings)
    running = await start_gateway(config)
    try:
        # Every server's models are known before the test's first call (a condition, polled).
        loop = asyncio.get_running_loop()
        until = loop.time() + WAIT_S
        while not all(len(running.gateway.cluster.model(m).replicas) == len(fakes) if running.gateway.cluster.model(m)
                      else False for m in MODELS):
            assert loop.time() < until, "the gateway never saw every server's models"
            await asyncio.sleep(0.02)
        yield running
    finally:
        await running.stop(5)


def request_bytes(model: str, rows: int = 1, request_id: str = "r-1", **parameters: Any) -> bytes:
    request = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    for key, value in parameters.items():
        slot = request.parameters[key]
        if isinstance(value, bool):
            slot.bool_param = value
        elif isinstance(value, int):
            slot.int64_param = value
        else:
            slot.string_param = value
    request.inputs.add(name="INPUT", datatype="FP32", shape=[rows, 4])
    request.raw_input_contents.append(np.arange(rows * 4, dtype=np.float32).tobytes())
    return request.SerializeToString()


@asynccontextmanager
async def raw_client(running: RunningGateway) -> AsyncIterator[Callable[..., Any]]:
    """ModelInfer on the gateway with no serializers: bytes in, bytes out."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{running.grpc_port}") as channel:
        yield channel.unary_unary(f"/{SERVICE}/ModelInfer")


async def test_a_relayed_call_arrives_unchanged_and_its_answer_comes_back_unchanged() -> None:
    async with fake_tritons(1) as [fake], gateway_before([fake]) as running, raw_client(running) as infer:
        # A parameter the gateway knows nothing of, and the version left to the server: all as sent.
        sent = request_bytes("relayed", rows=3, note="as sent", priority=1)
        answer = await infer(sent, timeout=WAIT_S)
        assert fake.calls == [sent]
        assert fake.answers == [answer]
        verdict = running.gateway.relay_lanes()["relayed"]
        assert verdict.on, verdict
        # Counted as the full path counts: one request of three rows.
        stats = await running.gateway.model_statistics("relayed")
        assert stats.model_stats[0].inference_count == 3
        assert stats.model_stats[0].inference_stats.success.count == 1


async def test_a_servers_error_comes_back_in_its_words_and_code() -> None:
    async def refuse(fake: FakeTriton, data: bytes, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            "[request id: r-1] unexpected shape for input 'INPUT' for model 'relayed'")

    async with fake_tritons(1) as [fake], gateway_before([fake]) as running, raw_client(running) as infer:
        fake.behaviour = refuse
        sent = request_bytes("relayed")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await infer(sent, timeout=WAIT_S)
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details() == "[request id: r-1] unexpected shape for input 'INPUT' for model 'relayed'"
        assert fake.calls == [sent]  # relayed, and the request's own fault: not retried


async def test_a_failure_before_the_answer_is_retried_on_another_server() -> None:
    failed: list[str] = []

    async def first_call_fails(fake: FakeTriton, data: bytes, context: grpc.aio.ServicerContext) -> None:
        if not failed:
            failed.append(fake.name)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "model is not ready yet, try again")

    async with fake_tritons(2) as fakes, gateway_before(fakes) as running, raw_client(running) as infer:
        for fake in fakes:
            fake.behaviour = first_call_fails
        sent = request_bytes("relayed")
        answer = service_pb2.ModelInferResponse.FromString(await infer(sent, timeout=WAIT_S))
        # The server that failed got the call once, the other served the same bytes.
        assert [len(f.calls) for f in fakes] == [1, 1]
        assert all(f.calls == [sent] for f in fakes)
        assert answer.parameters["served_by"].string_param != failed[0]


async def hang(fake: FakeTriton, data: bytes, context: grpc.aio.ServicerContext) -> None:
    await asyncio.Event().wait()


async def test_the_clients_deadline_ends_the_servers_call() -> None:
    async with fake_tritons(1) as [fake], gateway_before([fake]) as running, raw_client(running) as infer:
        fake.behaviour = hang
        sent = request_bytes("relayed")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await infer(sent, timeout=0.5)
        assert info.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        await asyncio.wait_for(fake.cancelled.wait(), WAIT_S)
        assert fake.calls == [sent]


async def test_a_client_cancel_ends_the_servers_call() -> None:
    async with fake_tritons(1) as [fake], gateway_before([fake]) as running, raw_client(running) as infer:
        fake.behaviour = hang
        sent = request_bytes("relayed")
        call = infer(sent, timeout=WAIT_S)
        task = asyncio.ensure_future(call)
        await asyncio.wait_for(fake.received.wait(), WAIT_S)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(fake.cancelled.wait(), WAIT_S)
        assert fake.calls == [sent]
        # The slot the call held is free again.
        worker = running.gateway.cluster.model("relayed").replicas[0]
        until = asyncio.get_running_loop().time() + WAIT_S
        while worker.inflight:
            assert asyncio.get_running_loop().time() < until
            await asyncio.sleep(0.02)


async def test_a_sequence_stays_on_the_server_that_started_it() -> None:
    async with fake_tritons(2) as fakes, gateway_before(fakes) as running, raw_client(running) as infer:
        assert running.gateway.relay_lanes()["seq"].on
        flags = [{"sequence_start": True}, {}, {}, {"sequence_end": True}]
        for corrid in (11, 12, 13):
            sent = [request_bytes("seq", request_id=f"{corrid}-{i}", sequence_id=corrid, **f)
                    for i, f in enumerate(flags)]
            for data in sent:
                await infer(data, timeout=WAIT_S)
            holders = [f for f in fakes if any(c in f.calls for c in sent)]
            assert len(holders) == 1, f"sequence {corrid} went to {[f.name for f in holders]}"
            assert [c for c in holders[0].calls if c in sent] == sent  # in order, as sent


async def test_a_sequence_call_without_start_is_refused_as_on_the_full_path() -> None:
    async with fake_tritons(1) as [fake], gateway_before([fake]) as running, raw_client(running) as infer:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await infer(request_bytes("seq", sequence_id=99), timeout=WAIT_S)
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "must specify the START flag" in info.value.details()
        assert fake.calls == []


def _read_by_the_gateway(fake: FakeTriton, sent: bytes) -> bool:
    """The call the server got is the gateway's own (the full path writes the version it resolved)."""
    [got] = fake.calls
    return got != sent and service_pb2.ModelInferRequest.FromString(got).model_version == "1"


async def test_a_call_that_finds_every_slot_taken_is_batched_here_and_an_idle_one_relays() -> None:
    # The one server runs one execution at once (one instance): while the first call holds it,
    # the next call is read and batched by the gateway; once it is free, calls relay again.
    gate = asyncio.Event()

    async def hold_the_first(fake: FakeTriton, data: bytes, context: grpc.aio.ServicerContext) -> None:
        if len(fake.calls) == 1:
            await gate.wait()

    async with fake_tritons(1) as [fake], gateway_before([fake]) as running, raw_client(running) as infer:
        assert running.gateway.relay_lanes()["relayed"].while_idle
        fake.behaviour = hold_the_first
        first = request_bytes("relayed", request_id="r-1")
        held = asyncio.ensure_future(infer(first, timeout=WAIT_S))
        await asyncio.wait_for(fake.received.wait(), WAIT_S)
        assert fake.calls == [first]  # a free slot: relayed as sent
        second = request_bytes("relayed", request_id="r-2")
        batched = asyncio.ensure_future(infer(second, timeout=WAIT_S))
        # Polled: the second is queued in the gateway's batcher (the slot is taken), or already sent on.
        loop = asyncio.get_running_loop()
        until = loop.time() + WAIT_S
        while not (len(fake.calls) == 2 or _queued(running, "relayed")):
            assert loop.time() < until, "the second call never reached the batcher or the server"
            await asyncio.sleep(0.01)
        gate.set()
        answers = [service_pb2.ModelInferResponse.FromString(a) for a in await asyncio.gather(held, batched)]
        assert [a.id for a in answers] == ["r-1", "r-2"]
        assert len(fake.calls) == 2
        got = service_pb2.ModelInferRequest.FromString(fake.calls[1])
        assert fake.calls[1] != second and got.model_version == "1"  # written by the gateway: the full path
        third = request_bytes("relayed", request_id="r-3")
        await infer(third, timeout=WAIT_S)
        assert fake.calls[2] == third  # idle again: relayed as sent
        assert running.gateway.relayed_calls() == {"relayed": 2}  # the first and the third
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{running.http_port}/v2/cluster") as response:
                cluster = await response.json()
        [shown] = [m["relay"] for m in cluster["models"] if m["name"] == "relayed"]
        assert shown["on"] and shown["while_idle"] and shown["relayed_calls"] == 2


def _queued(running: RunningGateway, model: str) -> bool:
    batcher = running.gateway.batchers().get((model, "1"))
    return batcher is not None and batcher.queue_depth() > 0


async def test_the_response_cache_and_classification_keep_a_model_off_the_lane() -> None:
    async with fake_tritons(1) as [fake], gateway_before([fake], cache={"size_bytes": 2**20}) as running:
        lanes = running.gateway.relay_lanes()
        assert not lanes["cached"].on and "cache" in lanes["cached"].why
        assert not lanes["labelled"].on and "classification" in lanes["labelled"].why
        assert lanes["relayed"].on
        async with raw_client(running) as infer:
            sent = request_bytes("cached")
            await infer(sent, timeout=WAIT_S)
            assert _read_by_the_gateway(fake, sent)


async def test_a_call_asking_for_classification_takes_the_full_path() -> None:
    async with fake_tritons(1) as [fake], gateway_before([fake]) as running, raw_client(running) as infer:
        request = service_pb2.ModelInferRequest.FromString(request_bytes("relayed"))
        request.outputs.add(name="OUTPUT").parameters["classification"].int64_param = 2
        sent = request.SerializeToString()
        try:
            await infer(sent, timeout=WAIT_S)  # answered or refused, it is the gateway's to read
        except grpc.aio.AioRpcError:
            pass
        assert not fake.calls or _read_by_the_gateway(fake, sent)


async def test_the_lane_is_off_by_default() -> None:
    async with fake_tritons(1) as [fake], gateway_before([fake], relay=None) as running:
        assert running.gateway.relay_lanes()["relayed"].why == "relay is off"


async def test_relay_off_turns_the_lane_off() -> None:
    async with fake_tritons(1) as [fake], gateway_before([fake], relay="off") as running, raw_client(running) as infer:
        verdict = running.gateway.relay_lanes()["relayed"]
        assert not verdict.on and verdict.why == "relay is off"
        sent = request_bytes("relayed")
        await infer(sent, timeout=WAIT_S)
        assert _read_by_the_gateway(fake, sent)


async def test_one_models_relay_off_in_the_config_file(tmp_path: Any) -> None:
    path = tmp_path / "gateway.yaml"
    # YAML reads a bare off as false and on as true: still "off", and "auto".
    path.write_text("relay: on\nmodels:\n  relayed:\n    relay: off\n")
    async with fake_tritons(1) as [fake], gateway_before([fake], path=str(path), relay=None) as running:
        lanes = running.gateway.relay_lanes()
        assert not lanes["relayed"].on and lanes["relayed"].why == "relay is off"
        assert lanes["seq"].on
