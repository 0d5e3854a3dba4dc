"""The slots streams wait for: calls waiting for a replica are served in arrival order
(gateway/routing/router.py ``_acquire``, the line of gateway/routing/capacity.py), and a
model that batches its own sequences on the worker (``max_sequences`` in its config) takes
that many streams per replica, counted apart from other models' batches. No real time:
slots are freed by hand, deadlines are on a fake clock."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from gateway.fleet.cluster import Cluster, WorkerState
from gateway.routing.capacity import max_sequences
from gateway.routing.router import Router
from protos.errors import DeadlineExceeded
from tests.unit.gateway.routing.test_router import started


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def now(self) -> float:
        return self.t

    def call_later(self, delay: float, callback):  # type: ignore[no-untyped-def]
        return asyncio.get_running_loop().call_later(delay, callback)


def generating(worker: WorkerState, model: str = "m", sequences: int = 4) -> None:
    """Make ``model`` on ``worker`` one that runs ``sequences`` sequences at once."""
    served = worker.models[model]
    config = type(served.config)()
    config.CopyFrom(served.config)
    config.parameters["max_sequences"].string_value = str(sequences)
    worker.models[model] = dataclasses.replace(served, config=config)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def stream(router: Router, done: asyncio.Event, model: str = "m") -> WorkerState:
    """A stream as gateway/routing/streams.py runs one: acquire, hold until ``done``."""
    worker = await router.acquire(model, "", None)
    with router.tries.holding(worker, model):  # taken at once, as the stream path does
        await done.wait()
    return worker


async def test_waiting_calls_take_freed_slots_in_arrival_order() -> None:
    cluster, _fleet = await started("a:1")
    router = Router(cluster, max_inflight_per_replica=1)
    (worker,) = cluster.workers()
    served: list[int] = []
    ends = [asyncio.Event() for _ in range(4)]
    try:
        with router.tries.holding(worker):
            tasks = []
            for i in range(4):
                tasks.append(asyncio.create_task(stream(router, ends[i])))
                await settle()
            assert worker.inflight == 1
        for i in range(4):
            await settle()
            assert worker.inflight == 1  # the head of the line holds the slot, no one else
            assert all(not t.done() for t in tasks[i:])
            ends[i].set()
            await tasks[i]
            served.append(i)
        assert served == [0, 1, 2, 3]
    finally:
        router.close()
        await cluster.stop()


async def test_a_new_call_does_not_take_a_slot_freed_for_the_line() -> None:
    cluster, _fleet = await started("a:1")
    router = Router(cluster, max_inflight_per_replica=1)
    (worker,) = cluster.workers()
    first_done, late_done = asyncio.Event(), asyncio.Event()
    try:
        with router.tries.holding(worker):
            first = asyncio.create_task(stream(router, first_done))
            await settle()
        # The slot is free now, but the first in line has not run yet: a newcomer queues behind it.
        late = asyncio.create_task(stream(router, late_done))
        await settle()
        assert worker.inflight == 1 and not first.done() and not late.done()
        first_done.set()
        await first
        await settle()
        assert worker.inflight == 1  # the newcomer's turn now
        late_done.set()
        assert await late is worker
    finally:
        router.close()
        await cluster.stop()


async def test_the_head_leaving_at_its_deadline_passes_the_turn_on() -> None:
    clock = FakeClock()
    cluster, _fleet = await started("a:1")
    router = Router(cluster, max_inflight_per_replica=1, clock=clock)
    (worker,) = cluster.workers()
    try:
        with router.tries.holding(worker):
            head = asyncio.create_task(router.acquire("m", "", clock.t + 0.001))
            await settle()
            second = asyncio.create_task(router.acquire("m", "", None))
            await settle()
            clock.t += 1.0  # the head's deadline passes (its wait_for fires on the loop)
            with pytest.raises(DeadlineExceeded):
                await head
            assert not second.done()
        await settle()
        assert second.done() and second.result() is worker
        assert not router.capacity("m").line or router.capacity("m").line[0].done()
    finally:
        router.close()
        await cluster.stop()


async def test_a_cancelled_waiter_leaves_the_line() -> None:
    cluster, _fleet = await started("a:1")
    router = Router(cluster, max_inflight_per_replica=1)
    (worker,) = cluster.workers()
    try:
        with router.tries.holding(worker):
            tasks = []
            for _ in range(3):
                tasks.append(asyncio.create_task(router.acquire("m", "", None)))
                await settle()
            tasks[0].cancel()
            tasks[1].cancel()
            await settle()
        await settle()
        assert tasks[2].done() and tasks[2].result() is worker
        assert len(router.capacity("m").line) == 0
    finally:
        router.close()
        await cluster.stop()


async def test_a_generating_model_takes_max_sequences_streams_per_replica() -> None:
    cluster, _fleet = await started("a:1")
    router = Router(cluster)  # bounds derived: one execution slot would allow two
    (worker,) = cluster.workers()
    generating(worker, sequences=4)
    try:
        assert router.limits(worker, "m") == (4, 4)
        held = []
        for _ in range(4):
            w = await router.acquire("m", "", None)
            ctx = router.tries.holding(w, "m")
            ctx.__enter__()
            held.append(ctx)
        fifth = asyncio.create_task(router.acquire("m", "", None))
        await settle()
        assert not fifth.done()  # the worker would refuse a fifth ("is at capacity")
        held.pop().__exit__(None, None, None)
        await settle()
        assert fifth.done()
        for ctx in held:
            ctx.__exit__(None, None, None)
        assert worker.inflight == 0 and router.bounds.held(worker, "m") == 0
    finally:
        router.close()
        await cluster.stop()


async def test_streams_of_a_generating_model_leave_other_models_room() -> None:
    cluster: Cluster
    cluster, _fleet = await started("a:1")
    router = Router(cluster, max_inflight_per_replica=1)
    (worker,) = cluster.workers()
    other = dataclasses.replace(worker.models["m"], name="other")
    worker.models["other"] = other
    generating(worker, "m", sequences=8)
    try:
        with router.tries.holding(worker, "m"), router.tries.holding(worker, "m"):
            assert worker.inflight == 2  # drain and shutdown still see them
            assert router.bounds.held(worker, "other") == 0
            assert router.bounds.below([worker], "other") == [worker]
            with router.tries.holding(worker, "other"):
                assert router.bounds.held(worker, "other") == 1
                assert router.bounds.below([worker], "other") == []
                assert router.bounds.held(worker, "m") == 2
    finally:
        router.close()
        await cluster.stop()


def test_max_sequences_reads_the_config_parameter() -> None:
    from tritonclient.grpc import model_config_pb2

    config = model_config_pb2.ModelConfig()
    assert max_sequences(config) == 0
    config.parameters["max_sequences"].string_value = "32"
    assert max_sequences(config) == 32
    config.parameters["max_sequences"].string_value = "many"
    assert max_sequences(config) == 0


async def test_a_retry_waiting_for_an_untried_replica_does_not_hold_back_the_line() -> None:
    cluster, _fleet = await started("a:1", "b:1")
    router = Router(cluster, max_inflight_per_replica=1)
    a, b = cluster.workers()
    try:
        with router.tries.holding(b):
            with router.tries.holding(a):
                retry = asyncio.create_task(router.acquire("m", "", None, {a}))  # a failed it: it waits for b
                await settle()
                fresh = asyncio.create_task(router.acquire("m", "", None))
                await settle()
            await settle()
            assert fresh.done() and fresh.result() is a and not retry.done()
            with router.tries.holding(a):
                pass
        await settle()
        assert retry.done() and retry.result() is b
    finally:
        router.close()
        await cluster.stop()
