"""``worker_calls: stream``: the gateway's inference calls to an infergate
worker as messages of one ``ModelStreamInfer`` per worker, with the unary
call's behaviour kept (gateway.replicas.unary_stream).

Against real workers on 127.0.0.1: many concurrent calls share one stream and
answer what unary calls answer; an in-stream error becomes the worker's own
status (INVALID_ARGUMENT, the unary words); a deadline ends the wait with
DEADLINE_EXCEEDED; a worker killed under a call fails it as unreachable and
the next call opens a fresh stream to a worker that is back; close ends the
stream. Through a gateway configured for streams, answers and errors are the
ones a client gets with unary calls.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc.aio as grpcclient_aio
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

from gateway.replicas.worker_client import WorkerClient
from gateway.replicas.errors import WorkerUnreachable
from protos.errors import DeadlineExceeded, InvalidArgument
from tests.harness import Proc, start, start_worker, worker_url
from tests.integration.gateway.e2e_cluster import grpc_url

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def worker(model_repo: Path) -> Iterator[Proc]:
    proc = start_worker(model_repo, "--intra-op-threads", "1")
    try:
        yield proc
    finally:
        proc.stop()


def mlp_request(seed: int, rid: str = "", name: str = "INPUT") -> service_pb2.ModelInferRequest:
    pb = service_pb2.ModelInferRequest(model_name="mlp", id=rid)
    pb.inputs.add(name=name, datatype="FP32", shape=[1, 64])
    pb.raw_input_contents.append(np.random.default_rng(seed).standard_normal((1, 64)).astype(np.float32).tobytes())
    return pb


async def test_concurrent_calls_share_one_stream_and_answer_as_unary_calls(worker: Proc) -> None:
    streamed = WorkerClient(worker_url(worker), stream_calls=True)
    unary = WorkerClient(worker_url(worker))
    try:
        requests = [mlp_request(seed, rid=f"r{seed}") for seed in range(40)]
        got = await asyncio.gather(*(streamed.infer(pb, 30) for pb in requests))
        lane = streamed._stream._lane  # type: ignore[union-attr]
        assert lane is not None and lane.open  # one stream carried them all, and stays open
        want = [await unary.infer(pb, 30) for pb in requests]
        assert got == want  # outputs, raw contents and each request's own id
        assert [pb.id for pb in requests] == [f"r{seed}" for seed in range(40)]  # the messages are unchanged
        await streamed.infer(mlp_request(99), 30)
        assert streamed._stream._lane is lane  # type: ignore[union-attr]
    finally:
        await streamed.close()
        await unary.close()
    assert lane.reader is not None and lane.reader.done() and not lane.open


async def test_an_in_stream_error_is_the_workers_own_status(worker: Proc) -> None:
    streamed = WorkerClient(worker_url(worker), stream_calls=True)
    unary = WorkerClient(worker_url(worker))
    try:
        bad = mlp_request(1, name="NOPE")
        with pytest.raises(InvalidArgument) as from_stream:
            await streamed.infer(bad, 30)
        with pytest.raises(InvalidArgument) as from_unary:
            await unary.infer(bad, 30)
        assert from_stream.value.message == from_unary.value.message
        assert "NOPE" in from_stream.value.message
    finally:
        await streamed.close()
        await unary.close()


async def test_a_deadline_ends_the_wait_and_a_killed_worker_fails_the_call(model_repo: Path) -> None:
    slow = start_worker(model_repo, "--backend", "sim", "--sim-latency-ms", "3000")
    client = WorkerClient(worker_url(slow), stream_calls=True)
    try:
        with pytest.raises(DeadlineExceeded):
            await client.infer(mlp_request(1), 0.2)
        pending = asyncio.ensure_future(client.infer(mlp_request(2), 60))
        while not client._stream._lane.waiting:  # type: ignore[union-attr]  # the message is out
            await asyncio.sleep(0.01)
        slow.kill()
        with pytest.raises(WorkerUnreachable):
            await asyncio.wait_for(pending, 30)
    finally:
        await client.close()
        slow.kill()


async def test_the_next_call_after_a_lost_stream_opens_a_fresh_one(model_repo: Path) -> None:
    first = start_worker(model_repo, "--intra-op-threads", "1")
    client = WorkerClient(worker_url(first), stream_calls=True)
    try:
        await client.infer(mlp_request(1), 30)
        lane = client._stream._lane  # type: ignore[union-attr]
        first.kill()
        while lane.open:  # the reader saw the stream end
            await asyncio.sleep(0.01)
        with pytest.raises(WorkerUnreachable):
            await client.infer(mlp_request(2), 5)
    finally:
        await client.close()
        first.kill()


@pytest.fixture(scope="module")
def streaming_gateway(model_repo: Path, worker: Proc, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    config = tmp_path_factory.mktemp("stream") / "gateway.yaml"
    config.write_text("worker_calls: stream\n")
    proc = start(["gateway", "--worker", worker_url(worker), "--http-port", "0", "--grpc-port", "0",
                  "--config", str(config), "--model-repository", str(model_repo)])  # fmt: skip
    try:
        yield proc
    finally:
        proc.stop()


async def test_through_a_streaming_gateway_answers_and_errors_are_the_unary_ones(
    streaming_gateway: Proc, worker: Proc
) -> None:
    via = grpcclient_aio.InferenceServerClient(grpc_url(streaming_gateway))
    direct = grpcclient_aio.InferenceServerClient(worker_url(worker))

    def inputs(seed: int) -> list[grpcclient_aio.InferInput]:
        t = grpcclient_aio.InferInput("INPUT", [1, 64], "FP32")
        t.set_data_from_numpy(np.random.default_rng(seed).standard_normal((1, 64)).astype(np.float32))
        return [t]

    try:
        got = await asyncio.gather(*(via.infer("mlp", inputs(s)) for s in range(32)))
        for seed, answer in enumerate(got):
            want = (await direct.infer("mlp", inputs(seed))).as_numpy("OUTPUT")
            np.testing.assert_allclose(answer.as_numpy("OUTPUT"), want, rtol=1e-6)
        # encoder token ids past its vocabulary pass the gateway's checks and fail in the model.
        tokens = grpcclient_aio.InferInput("TOKENS", [1, 8], "INT64")
        tokens.set_data_from_numpy(np.full((1, 8), 5000, dtype=np.int64))
        with pytest.raises(InferenceServerException) as caught:
            await via.infer("encoder", [tokens])
        assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
    finally:
        await via.close()
        await direct.close()
