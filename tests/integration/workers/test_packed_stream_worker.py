"""A gateway's packed ``ModelStreamInfer`` call on a real worker (``protos.stream_pack``):
many streamed requests on one call, their responses packed several to a message,
any one of them cancelled by a message.

Checked with raw gRPC, as the gateway sends: concurrent greedy generations on
one packed call, under one client id and each with its key, answer under
their keys token for token what each answers on a call of its own, and a
decode step's tokens came packed in one message; a cancel message naming a
key stops its request on the worker (its instance freed, the request
counted failed) while another request on the same call ends normally; a
call without the packing metadata gets one response a message.
"""

from __future__ import annotations

import asyncio
import shutil
import struct
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from protos.stream_pack import PACK_METADATA, cancel_request, unpack, with_key
from tests.harness import Proc, start_worker, worker_url
from tests.integration.gateway.stream_clients import metric, poll, repeat_request
from tests.integration.workers.gen_client import generation_request as generation

pytestmark = pytest.mark.timeout(120)

FINAL = "triton_final_response"
PROMPTS = ["Hello", "The quick brown fox", "a", "1234", "What is the answer?", "x" * 30]
PACKED = ((PACK_METADATA, "1"),)


@pytest.fixture(scope="module")
def worker(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    repo = tmp_path_factory.mktemp("packed-models")
    for name in ("tiny_lm", "repeat_int32"):
        shutil.copytree(model_repo / name, repo / name)
    proc = start_worker(repo, "--metrics-port", "0")
    try:
        yield proc
    finally:
        proc.stop()


def is_final(message: service_pb2.ModelStreamInferResponse) -> bool:
    return message.infer_response.parameters[FINAL].bool_param


async def run_call(url: str, requests: list[service_pb2.ModelInferRequest], metadata: tuple[tuple[str, str], ...] = ()
                   ) -> tuple[dict[str, list[service_pb2.ModelStreamInferResponse]], list[int]]:
    """Every response by request id, and how many responses each message carried."""
    by_id: dict[str, list[service_pb2.ModelStreamInferResponse]] = defaultdict(list)
    per_message: list[int] = []
    async with grpc.aio.insecure_channel(url) as channel:
        call = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(metadata=metadata, timeout=60)
        for request in requests:
            await call.write(request)
        await call.done_writing()
        async for message in call:
            responses = unpack(message)
            per_message.append(len(responses))
            for response in responses:
                assert not response.error_message, response.error_message
                by_id[response.infer_response.id].append(response)
        assert await call.code() == grpc.StatusCode.OK
    return by_id, per_message


def tokens(responses: list[service_pb2.ModelStreamInferResponse]) -> list[bytes]:
    assert sum(map(is_final, responses)) == 1 and is_final(responses[-1])
    return [r.infer_response.raw_output_contents[0] for r in responses if r.infer_response.raw_output_contents]


async def test_generations_on_one_packed_call_equal_each_alone_and_a_step_comes_packed(worker: Proc) -> None:
    url = worker_url(worker)
    lengths = [64 + 5 * i for i in range(len(PROMPTS))]  # long enough to overlap on a loaded machine
    alone = []
    for i, (prompt, n) in enumerate(zip(PROMPTS, lengths)):
        by_id, per_message = await run_call(url, [generation(f"alone-{i}", prompt, n)])
        assert set(per_message) == {1}  # a call without the packing metadata: one response a message
        alone.append(tokens(by_id[f"alone-{i}"]))
    # Under one client id, each with its key on the call: the responses come back under the keys.
    requests = [with_key(generation("same", prompt, n), f"k{i}") for i, (prompt, n) in enumerate(zip(PROMPTS, lengths))]
    by_id, per_message = await run_call(url, requests, PACKED)
    for i, n in enumerate(lengths):
        got = tokens(by_id[f"k{i}"])
        assert len(got) == n
        assert got == alone[i], f"prompt {i} differs on the packed call"
    # The sequences decode together: a step's tokens leave in one message.
    assert max(per_message) >= 2, per_message
    assert set(by_id) == {f"k{i}" for i in range(len(PROMPTS))}
    assert sum(per_message) == sum(len(v) for v in by_id.values())


async def test_a_cancel_message_stops_its_request_and_not_the_other(worker: Proc) -> None:
    url, metrics = worker_url(worker), f"127.0.0.1:{worker.ready['metrics_port']}"
    label = 'model="repeat_int32"'
    failed_before = metric(metrics, "nv_inference_request_failure", label)
    by_id: dict[str, list[service_pb2.ModelStreamInferResponse]] = defaultdict(list)
    async with grpc.aio.insecure_channel(url) as channel:
        call = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(metadata=PACKED, timeout=60)
        # 200 responses 50 ms apart: ten seconds unless the cancel stops it.
        await call.write(with_key(repeat_request("r", list(range(200)), 50, empty_final=True), "long"))

        async def read_until(condition: Callable[[], bool]) -> None:
            while not condition():
                message = await call.read()
                assert message is not grpc.aio.EOF
                for response in unpack(message):
                    by_id[response.infer_response.id].append(response)

        await asyncio.wait_for(read_until(lambda: len(by_id["long"]) >= 2), 30)
        await call.write(with_key(repeat_request("r", [7, 8, 9], 0, empty_final=True), "short"))
        await asyncio.wait_for(read_until(lambda: any(map(is_final, by_id["short"]))), 30)
        await call.write(cancel_request("long"))
        await call.done_writing()
        # The worker ends the call once its requests have ended: the cancelled one at once.
        rest = []
        while (message := await asyncio.wait_for(call.read(), 5)) is not grpc.aio.EOF:
            rest.append(message)
        assert await asyncio.wait_for(call.code(), 5) == grpc.StatusCode.OK
    for message in rest:
        for response in unpack(message):
            by_id[response.infer_response.id].append(response)
    assert not any(map(is_final, by_id["long"])) and len(by_id["long"]) < 200
    short = [struct.unpack("<i", r.infer_response.raw_output_contents[0])[0]
             for r in by_id["short"] if r.infer_response.raw_output_contents]
    assert short == [7, 8, 9]
    poll(lambda: metric(metrics, "nv_inference_pending_request_count", label) == 0, "the cancelled request let go")
    assert metric(metrics, "nv_inference_request_failure", label) == failed_before + 1
