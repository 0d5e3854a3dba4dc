"""Tests for gateway/routing/resume.py through Router.stream: a generation whose replica is lost after
its first response goes on on another replica from the tokens already sent; other streams, other
failures and spent bounds end as before. The cluster is real; its replicas are fakes written here,
each a generation "model" whose next token depends only on the tokens before it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import numpy as np
import pytest
from tritonclient.grpc import model_config_pb2, service_pb2

from gateway.fleet.cluster import Cluster, WorkerStatus
from gateway.replicas.errors import ModelStreamError, WorkerUnreachable
from gateway.replicas.openai_contract import EMBEDDING_REQUEST, TEXT_OUTPUT
from gateway.replicas.replica import StreamItem
from gateway.routing.resume import Generation, Resumes
from gateway.routing.retry_budget import RetryBudget
from gateway.routing.router import Router
from gateway.routing.streams import StreamLost
from gateway.settings import WorkerSpec
from protos.errors import InferGateError, Unavailable
from protos.codec import serialize_bytes_tensor
from protos.generation_tokens import RESUME_TEXT, RESUME_TOKEN_IDS, RESUME_TOKENS, TOKEN_IDS, parse_ids
from protos.triton_words import FINAL_RESPONSE
from tests.unit.gateway.fleet.test_cluster import FakeWorker

PROMPT_TOKENS = 3


def next_token(before: list[int]) -> int:
    return (sum(before) * 31 + len(before) * 7) % 251


def response(request_id: str, **parameters: object) -> service_pb2.ModelInferResponse:
    out = service_pb2.ModelInferResponse(model_name="m", id=request_id)
    for key, value in parameters.items():
        if isinstance(value, bool):
            out.parameters[key].bool_param = value
        elif isinstance(value, int):
            out.parameters[key].int64_param = value
        else:
            out.parameters[key].string_param = str(value)
    return out


class FakeGenerator(FakeWorker):
    """A replica serving ``m`` as a generation model (``backend``) whose streams are scripted:
    ``fail_after`` responses of the next stream, then ``failure`` is raised."""

    backend = "generate"

    def __init__(self, spec: WorkerSpec) -> None:
        super().__init__(spec, {"m": ["1"]})
        self.requests: list[service_pb2.ModelInferRequest] = []
        self.fail_after: list[int | None] = []
        self.failure: InferGateError = WorkerUnreachable(f"worker {spec.address} unreachable: socket closed")

    async def model_config(self, name: str, version: str = "", timeout_s: float | None = None
                           ) -> model_config_pb2.ModelConfig:  # fmt: skip
        self._check()
        config = model_config_pb2.ModelConfig(name=name, backend=self.backend)
        config.model_transaction_policy.decoupled = True
        return config

    def stream(self, request: service_pb2.ModelInferRequest, timeout_s: float | None) -> AsyncIterator[StreamItem]:
        self.requests.append(request)
        return self._generate(request, self.fail_after.pop(0) if self.fail_after else None)

    async def _generate(self, request: service_pb2.ModelInferRequest, fail_after: int | None) -> AsyncIterator[StreamItem]:
        max_tokens = request.parameters["max_tokens"].int64_param
        resumed = parse_ids(request.parameters[RESUME_TOKEN_IDS].string_param) \
            if RESUME_TOKEN_IDS in request.parameters else []
        tokens = list(range(PROMPT_TOKENS)) + resumed
        sent = 0
        while len(tokens) - PROMPT_TOKENS < max_tokens:
            if fail_after is not None and sent == fail_after:
                raise self.failure
            await asyncio.sleep(0)
            tokens.append(next_token(tokens))
            sent += 1
            named = f"[{tokens[-1]}]"  # its text, for the client; its ids, when asked
            asked = TOKEN_IDS in request.parameters and request.parameters[TOKEN_IDS].bool_param
            yield response(request.id, text=named, **{FINAL_RESPONSE: False, **({TOKEN_IDS: named} if asked else {})}
                           ), time.monotonic()
        yield response(request.id, finish_reason="length", prompt_tokens=PROMPT_TOKENS,
                       completion_tokens=len(tokens) - PROMPT_TOKENS, **{FINAL_RESPONSE: True}), time.monotonic()


class PythonModel(FakeGenerator):
    backend = "python"  # a decoupled model that is no generation


class Fleet:
    def __init__(self, kind: type[FakeGenerator] = FakeGenerator) -> None:
        self.kind = kind
        self.by_address: dict[str, FakeGenerator] = {}

    def __call__(self, spec: WorkerSpec) -> FakeGenerator:
        fake = self.by_address[spec.address] = self.kind(spec)
        return fake


async def started(*addresses: str, kind: type[FakeGenerator] = FakeGenerator) -> tuple[Cluster, Fleet]:
    fleet = Fleet(kind)
    cluster = Cluster([WorkerSpec(a) for a in addresses], client_factory=fleet,  # type: ignore[arg-type]
                      probe_interval_s=3600.0)
    await cluster.start()
    return cluster, fleet


def generate_request(max_tokens: int = 12, **parameters: str) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="m", id="g")
    request.parameters["max_tokens"].int64_param = max_tokens
    for key, value in parameters.items():
        request.parameters[key].string_param = value
    return request


def uninterrupted(max_tokens: int = 12, resumed: list[int] | None = None) -> list[int]:
    tokens = list(range(PROMPT_TOKENS)) + (resumed or [])
    while len(tokens) - PROMPT_TOKENS < max_tokens:
        tokens.append(next_token(tokens))
    return tokens[PROMPT_TOKENS + len(resumed or []):]


async def generate(router: Router, request: service_pb2.ModelInferRequest) -> tuple[list[int], service_pb2.ModelInferResponse]:
    """The ids of every token response (each names them in ``text``, as the client reads them) and the final."""
    ids: list[int] = []
    final = None
    responses = router.stream("m", "", request, None)
    try:
        async for item, _ in responses:
            if item.parameters[FINAL_RESPONSE].bool_param:
                final = item
            else:
                assert TOKEN_IDS not in item.parameters or request.parameters[TOKEN_IDS].bool_param
                ids += parse_ids(item.parameters["text"].string_param)
    finally:
        await responses.aclose()  # type: ignore[attr-defined]
    assert final is not None
    return ids, final


def holder_first(cluster: Cluster, address: str) -> None:
    """Make ``address`` the least loaded replica, so the stream starts there."""
    for worker in cluster.workers():
        worker.inflight = 0 if worker.address == address else 1


async def test_a_generation_whose_replica_is_lost_goes_on_on_another_with_no_gap_and_no_repeat() -> None:
    cluster, fleet = await started("a:1", "b:1")
    holder_first(cluster, "a:1")
    fleet.by_address["a:1"].fail_after = [5]
    router = Router(cluster, max_inflight_per_replica=4)
    try:
        ids, final = await generate(router, generate_request(12))
        assert ids == uninterrupted(12)
        (first,) = fleet.by_address["a:1"].requests
        assert first.parameters[TOKEN_IDS].bool_param is True  # asked of the replica
        (continuation,) = fleet.by_address["b:1"].requests
        assert parse_ids(continuation.parameters[RESUME_TOKEN_IDS].string_param) == ids[:5]
        assert continuation.id == "g" and continuation.parameters["max_tokens"].int64_param == 12
        assert final.parameters["prompt_tokens"].int64_param == PROMPT_TOKENS
        assert final.parameters["completion_tokens"].int64_param == 12  # the whole generation
        a, b = cluster.workers()
        assert a.state is WorkerStatus.DOWN and a.failures == 1
        assert a.inflight == 0 and b.inflight == 1  # only the test's own count is left: every slot freed
        assert router.retry_budget.counters().extra_inflight == 0
    finally:
        router.close()
        await cluster.stop()


async def test_a_second_loss_resumes_again_up_to_the_retry_limit() -> None:
    cluster, fleet = await started("a:1", "b:1", "c:1")
    holder_first(cluster, "a:1")
    fleet.by_address["a:1"].fail_after = [3]
    fleet.by_address["b:1"].fail_after = [2]
    cluster.workers()[1].inflight = 0  # b before c
    router = Router(cluster, max_inflight_per_replica=4, retry_limit=2, retry_backoff_s=0.0)
    try:
        ids, final = await generate(router, generate_request(10))
        assert ids == uninterrupted(10) and final.parameters["completion_tokens"].int64_param == 10
        (on_c,) = fleet.by_address["c:1"].requests
        assert len(parse_ids(on_c.parameters[RESUME_TOKEN_IDS].string_param)) == 5
    finally:
        router.close()
        await cluster.stop()
    # Three losses in a row: the third is past retry_limit 2 and ends the stream.
    cluster, fleet = await started("a:1", "b:1", "c:1")
    for fake in fleet.by_address.values():
        fake.fail_after = [2]
    router = Router(cluster, max_inflight_per_replica=4, retry_limit=2, retry_backoff_s=0.0)
    try:
        with pytest.raises(StreamLost, match=r"not resumed: it was resumed 2 time\(s\) already"):
            await generate(router, generate_request(10))
        assert all(len(f.requests) == 1 for f in fleet.by_address.values())
    finally:
        router.close()
        await cluster.stop()


async def test_the_clients_own_resume_ids_come_first_in_a_continuation() -> None:
    cluster, fleet = await started("a:1", "b:1")
    holder_first(cluster, "a:1")
    fleet.by_address["a:1"].fail_after = [2]
    router = Router(cluster, max_inflight_per_replica=4)
    own = uninterrupted(12)[:4]
    try:
        ids, final = await generate(router, generate_request(12, **{RESUME_TOKEN_IDS: str(own)}))
        assert ids == uninterrupted(12, own)
        (continuation,) = fleet.by_address["b:1"].requests
        assert parse_ids(continuation.parameters[RESUME_TOKEN_IDS].string_param) == own + ids[:2]
    finally:
        router.close()
        await cluster.stop()


async def test_a_decoupled_model_that_is_no_generation_still_ends_with_stream_lost() -> None:
    cluster, fleet = await started("a:1", "b:1", kind=PythonModel)
    holder_first(cluster, "a:1")
    fleet.by_address["a:1"].fail_after = [4]
    router = Router(cluster, max_inflight_per_replica=4)
    try:
        with pytest.raises(StreamLost, match=r"worker a:1 was lost .* after 4 response\(s\)"):
            await generate(router, generate_request(12))
        assert fleet.by_address["b:1"].requests == []
    finally:
        router.close()
        await cluster.stop()


async def test_an_in_stream_model_error_is_not_resumed() -> None:
    cluster, fleet = await started("a:1", "b:1")
    holder_first(cluster, "a:1")
    a = fleet.by_address["a:1"]
    a.fail_after, a.failure = [3], ModelStreamError("the model failed a step")  # the request's or the model's
    router = Router(cluster, max_inflight_per_replica=4)
    try:
        with pytest.raises(ModelStreamError):
            await generate(router, generate_request(12))
        assert fleet.by_address["b:1"].requests == []
    finally:
        router.close()
        await cluster.stop()


async def test_a_replica_answering_unavailable_mid_stream_while_up_is_lost_too() -> None:
    cluster, fleet = await started("a:1", "b:1")
    holder_first(cluster, "a:1")
    a = fleet.by_address["a:1"]
    a.fail_after, a.failure = [3], Unavailable("worker a:1: model 'm' is unloading")
    router = Router(cluster, max_inflight_per_replica=4)
    try:
        ids, _ = await generate(router, generate_request(12))
        assert ids == uninterrupted(12) and len(fleet.by_address["b:1"].requests) == 1
        assert cluster.workers()[0].state is WorkerStatus.READY  # answered: still up
    finally:
        router.close()
        await cluster.stop()


async def test_with_no_replica_left_untried_or_no_budget_the_loss_ends_the_stream() -> None:
    cluster, fleet = await started("a:1", "b:1")
    holder_first(cluster, "a:1")
    a = fleet.by_address["a:1"]
    a.fail_after = [3]
    a.failure = Unavailable("worker a:1: model 'm' is unloading")  # still up, still in rotation
    cluster.workers()[1].state = WorkerStatus.DOWN
    router = Router(cluster, max_inflight_per_replica=4, retry_backoff_s=0.0)
    try:
        with pytest.raises(StreamLost, match="resuming it failed: .*not tried"):
            await generate(router, generate_request(12))
        assert len(a.requests) == 1  # never resumed on the replica that lost it

        cluster.workers()[1].state = WorkerStatus.READY
        a.fail_after = [3]
        budget = RetryBudget(budget_percent=0, min_concurrency=0)
        router = Router(cluster, max_inflight_per_replica=4, retry_budget=budget)
        with pytest.raises(StreamLost, match="not resumed: retries are limited"):
            await generate(router, generate_request(12))
        assert fleet.by_address["b:1"].requests == []
    finally:
        router.close()
        await cluster.stop()


def test_a_generation_follows_the_ids_its_responses_named_and_continues_after_them() -> None:
    config = model_config_pb2.ModelConfig(name="m", backend="generate")
    assert Resumes.generation(model_config_pb2.ModelConfig(name="m", backend="python"), generate_request()) is None
    assert Resumes.generation(None, generate_request()) is None
    generation = Resumes.generation(config, generate_request(8))
    assert isinstance(generation, Generation)
    for named in ("[5]", "[6,7]", None, "[8]"):
        out = response("g", **({TOKEN_IDS: named} if named else {}))
        generation.sent(out)
        assert TOKEN_IDS not in out.parameters  # kept from a client that did not ask
    continuation = generation.continuation()
    assert parse_ids(continuation.parameters[RESUME_TOKEN_IDS].string_param) == [5, 6, 7, 8]
    assert continuation.parameters["max_tokens"].int64_param == 8 and generation.responses == 4
    assert RESUME_TOKEN_IDS not in generation.request.parameters  # the original is left as it was
    asked = generate_request(8)
    asked.parameters[TOKEN_IDS].bool_param = True
    generation = Resumes.generation(config, asked)
    assert generation is not None
    out = response("g", **{TOKEN_IDS: "[5]"})
    generation.sent(out)
    assert out.parameters[TOKEN_IDS].string_param == "[5]"  # a client that asked gets them


def _text(piece: bytes, **parameters: str) -> service_pb2.ModelInferResponse:
    out = response("g", **parameters)
    out.outputs.add(name=TEXT_OUTPUT, datatype="BYTES", shape=[1])
    out.raw_output_contents.append(serialize_bytes_tensor(np.array([piece], dtype=np.object_)))
    return out


def test_an_openai_servers_generation_continues_after_the_text_sent() -> None:
    config = model_config_pb2.ModelConfig(name="m", backend="openai")
    embedding = generate_request()
    embedding.parameters[EMBEDDING_REQUEST].string_param = '{"input": "x"}'
    assert Resumes.generation(config, embedding) is None  # one answer, nothing to continue
    generation = Resumes.generation(config, generate_request(8))
    assert isinstance(generation, Generation)
    for piece in (b"Hel", b"lo", "é".encode()):
        generation.sent(_text(piece))  # an OpenAI server names no ids
    generation.sent(response("g"))  # the final one: no text, no token
    continuation = generation.continuation()
    assert continuation.parameters[RESUME_TEXT].string_param == "Helloé"
    assert continuation.parameters[RESUME_TOKENS].int64_param == 3 and generation.responses == 4
    assert RESUME_TOKEN_IDS not in continuation.parameters  # no ids came: the text is the account
    assert RESUME_TEXT not in generation.request.parameters  # the original is left as it was
    # Lost again on an infergate worker that named its ids: the ids alone would miss the first three
    # tokens, so the text (both servers', in order) and every token go on.
    again = Generation(continuation)
    again.sent(_text(b" world", **{TOKEN_IDS: "[9]"}))
    last = again.continuation()
    assert (last.parameters[RESUME_TEXT].string_param, last.parameters[RESUME_TOKENS].int64_param) == \
        ("Helloé world", 4)
    assert RESUME_TOKEN_IDS not in last.parameters


def test_a_generation_that_named_every_id_continues_after_ids_and_text() -> None:
    generation = Resumes.generation(model_config_pb2.ModelConfig(name="m", backend="generate"), generate_request(8))
    assert generation is not None
    generation.sent(_text(b"ab", **{TOKEN_IDS: "[5,6]"}))
    generation.sent(_text(b"c", **{TOKEN_IDS: "[7]"}))
    continuation = generation.continuation()
    assert parse_ids(continuation.parameters[RESUME_TOKEN_IDS].string_param) == [5, 6, 7]
    assert continuation.parameters[RESUME_TEXT].string_param == "abc"  # for an OpenAI server in the pool
    assert continuation.parameters[RESUME_TOKENS].int64_param == 3
