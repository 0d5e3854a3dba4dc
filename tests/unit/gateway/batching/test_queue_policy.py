"""Queue policies as Triton defines them, and the batcher keeping requests under them
until they are sent: which ``max_queue_size`` wins, ``priority_queue_policy`` per
level, no pipelining behind a busy replica under a queue timeout, and a batch
that found no free replica (``NotSent``) going back to the queue."""

from __future__ import annotations

import asyncio

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from gateway.batching.batcher import Batcher, BatchPolicy
from gateway.batching.policy import QueuePolicy
from gateway.batching.seams import NotSent
from gateway.types import InferRequest, InferResponse
from protos.errors import Overloaded, Unavailable
from tests.unit.gateway.batching.fakes import FakeClock, ReplicaBackend, echo, make_req, settle

pytestmark = pytest.mark.timeout(10)


def _config(text: str) -> model_config_pb2.ModelConfig:
    return text_format.Parse('name: "m" max_batch_size: 8 ' + text, model_config_pb2.ModelConfig())


def test_the_models_max_queue_size_wins_over_the_gateway_default() -> None:
    cfg = _config("dynamic_batching { default_queue_policy { max_queue_size: 3 } }")
    assert BatchPolicy.from_model_config(cfg, {}, default_max_queue_size=1024).max_queue_size == 3
    # The gateway config's entry for the model still wins over the model's own.
    assert BatchPolicy.from_model_config(cfg, {"max_queue_size": 7}, default_max_queue_size=1024).max_queue_size == 7
    # Triton's 0 (unlimited) and models without a queue policy take the gateway's default.
    assert BatchPolicy.from_model_config(_config("dynamic_batching {}"), {}, default_max_queue_size=99).max_queue_size == 99
    assert BatchPolicy.from_model_config(_config(""), {}, default_max_queue_size=99).max_queue_size == 99


def test_priority_queue_policy_is_read_per_level() -> None:
    cfg = _config("""dynamic_batching {
        priority_levels: 2 default_priority_level: 2
        default_queue_policy { default_timeout_microseconds: 5000 timeout_action: DELAY }
        priority_queue_policy { key: 1 value { max_queue_size: 4 default_timeout_microseconds: 100 } } }""")
    policy = BatchPolicy.from_model_config(cfg)
    assert policy.queue_policy(1) == QueuePolicy(100, "REJECT", False, 4)
    assert policy.queue_policy(2) == QueuePolicy(5000, "DELAY", False, 0)
    assert policy.has_queue_timeouts
    assert not BatchPolicy(max_batch_size=8).has_queue_timeouts
    with pytest.raises(ValueError, match="level 3"):
        BatchPolicy(max_batch_size=8, priority_levels=2, default_priority_level=1,
                    priority_queue_policies=((3, QueuePolicy()),))


async def test_a_level_with_its_own_bound_refuses_when_full_and_times_out_by_its_own_policy(rig) -> None:
    r = await rig(mode="off", priority_levels=2, default_priority_level=2,
                  priority_queue_policies=((1, QueuePolicy(max_queue_size=1, default_timeout_us=100_000)),))
    await r.submit_all("busy")
    await r.submit_all("high1", priority=1)
    with pytest.raises(Overloaded, match="Exceeds maximum queue size"):
        await r.batcher.submit(make_req("high2", priority=1))
    await r.submit_all("low", priority=2)  # the other level has room
    await r.clock.advance(0.1)
    assert isinstance(r.error_of("high1"), Unavailable) and str(r.error_of("high1")) == "Request timeout expired"
    assert "low" not in r.done()
    r.backend.complete(0)
    await settle()
    r.backend.complete(1)
    assert r.batches() == [["busy"], ["low"]]


@pytest.mark.parametrize("timeout_us, pipelined", [(0, True), (100_000, False)])
async def test_under_a_queue_timeout_nothing_waits_behind_a_busy_replica(rig, timeout_us: int, pipelined: bool) -> None:
    """One replica, busy with one batch and room for one more: a model with a queue timeout keeps the
    next request queued (where the timeout answers it) instead of sending it to wait on the worker."""
    r = await rig(slots=1, room=1, mode="off", default_timeout_us=timeout_us)
    await r.submit_all("running", "next")
    assert r.batches() == ([["running"], ["next"]] if pipelined else [["running"]])
    await r.clock.advance(0.1)
    if not pipelined:
        assert str(r.error_of("next")) == "Request timeout expired"
    r.backend.complete(0)
    if pipelined:
        r.backend.complete(1)
    await settle()


async def test_delay_applies_until_the_batch_is_sent(rig) -> None:
    r = await rig(slots=1, room=1, mode="off", default_timeout_us=100_000, timeout_action="DELAY")
    await r.submit_all("running", "a")
    await r.clock.advance(0.1)  # "a" times out while queued: moved behind "b"
    await r.submit_all("b")
    r.backend.complete(0)
    await settle()
    r.backend.complete(1)
    await settle()
    r.backend.complete(2)
    await settle()
    assert r.batches() == [["running"], ["b"], ["a"]]
    assert r.batcher.stats.delayed == 1


async def test_a_batch_not_sent_goes_back_to_the_queue_under_its_policy() -> None:
    """The dispatch found no free replica (another model took it): the requests are queued
    again, in order; the queue timeout still answers them; the rest go once a replica is free."""
    backend = ReplicaBackend(slots=1, room=0)
    refusals = 1
    sent: list[list[str]] = []

    async def dispatch(requests: list[InferRequest]) -> list[InferResponse]:
        nonlocal refusals
        if refusals:
            refusals -= 1
            backend.busy += 1  # another model's batch took the slot
            raise NotSent("taken")
        sent.append([r.id for r in requests])
        return [echo(r) for r in requests]

    clock = FakeClock()
    batcher = Batcher("m", BatchPolicy(max_batch_size=8, default_timeout_us=100_000), dispatch, backend, clock=clock)
    await batcher.start()
    try:
        first = [asyncio_task(batcher, "a", timeout_us=50_000), asyncio_task(batcher, "b")]
        await settle()
        assert batcher.stats.requeued == 1 and batcher.queue_depth() == 2 and sent == []
        await clock.advance(0.05)
        assert str(first[0].exception()) == "Request timeout expired"  # its own, shorter timeout
        backend.busy -= 1
        for w in backend._waiters:
            w.set_result(None)
        await settle()
        assert sent == [["b"]] and (await first[1]).id == "b"
    finally:
        await batcher.close(0)


def asyncio_task(batcher: Batcher, rid: str, **kw: object) -> asyncio.Task[InferResponse]:
    return asyncio.create_task(batcher.submit(make_req(rid, **kw)))
