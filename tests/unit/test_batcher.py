"""Batcher: batch formation per mode, admission, deadlines, cancellation, ordering, close.

Everything runs on one event loop with a fake clock and a fake backend (the
router's Capacity and the executor's dispatch in one): no sockets, no
wall-clock windows. ``settle()`` lets the loop run until the batcher has
reacted; time only moves when a test calls ``clock.advance``.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import random
from dataclasses import dataclass, field
from typing import Any

import pytest

from gateway.batcher import Batcher, BatchPolicy
from gateway.types import InferRequest, InferResponse, RequestedOutput, Tensor
from protos.errors import DeadlineExceeded, Internal, InvalidArgument, Overloaded, Unavailable

pytestmark = pytest.mark.timeout(10)


async def settle() -> None:
    for _ in range(100):
        await asyncio.sleep(0)


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._n = 0

    def now(self) -> float:
        return self.t

    async def sleep(self, s: float) -> None:
        if s <= 0:
            await asyncio.sleep(0)
            return
        fut = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self.t + s, self._n, fut))
        self._n += 1
        await fut

    def pending_sleepers(self) -> int:
        return sum(not f.done() for _, _, f in self._sleepers)

    async def advance(self, s: float) -> None:
        target = self.t + s
        await settle()
        while self._sleepers and self._sleepers[0][0] <= target:
            when, _, fut = heapq.heappop(self._sleepers)
            self.t = max(self.t, when)
            if not fut.done():
                fut.set_result(None)
            await settle()
        self.t = target
        await settle()


@dataclass
class Call:
    requests: list[InferRequest]
    result: asyncio.Future[list[InferResponse]]

    @property
    def ids(self) -> list[str]:
        return [r.id for r in self.requests]


@dataclass
class FakeBackend:
    """Capacity and dispatch together: each running batch holds one of `slots` until completed."""

    slots: int = 1
    busy: int = 0
    calls: list[Call] = field(default_factory=list)
    over_capacity: int = 0  # dispatches made while every slot was taken: must stay 0
    _waiters: list[asyncio.Future[None]] = field(default_factory=list)

    def has_capacity(self) -> bool:
        return self.busy < self.slots

    async def wait(self) -> None:
        if self.has_capacity():
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        finally:
            if fut in self._waiters:
                self._waiters.remove(fut)

    def _can_take(self) -> bool:
        return self.has_capacity()

    async def dispatch(self, requests: list[InferRequest]) -> list[InferResponse]:
        if not self._can_take():
            self.over_capacity += 1
        self.busy += 1  # taken before the first suspension, as the router does
        call = Call(list(requests), asyncio.get_running_loop().create_future())
        self.calls.append(call)
        try:
            return await call.result
        finally:
            self.busy -= 1
            for w in self._waiters:
                if not w.done():
                    w.set_result(None)

    def complete(
        self, i: int, error: BaseException | None = None, responses: list[InferResponse] | None = None
    ) -> None:
        call = self.calls[i]
        if error is not None:
            call.result.set_exception(error)
        else:
            call.result.set_result(responses if responses is not None else [_echo(r) for r in call.requests])

    def batches(self) -> list[list[str]]:
        return [c.ids for c in self.calls]


@dataclass
class ReplicaBackend(FakeBackend):
    """A backend that, like the router, is idle below `slots` batches and has `room` more while busy."""

    room: int = 1

    def has_room(self) -> bool:
        return self.busy < self.slots + self.room

    def _can_take(self) -> bool:
        return self.has_room()


def _echo(req: InferRequest) -> InferResponse:
    return InferResponse(model=req.model, version=req.version, id=req.id, outputs=[])


def make_req(
    rid: str,
    rows: int = 1,
    tail: tuple[int, ...] = (4,),
    dtype: str = "FP32",
    outputs: tuple[str, ...] = (),
    **kw: Any,
) -> InferRequest:
    return InferRequest(
        model="m",
        version="",
        id=rid,
        inputs=[Tensor("x", dtype, (rows, *tail), b"")],
        outputs=[RequestedOutput(o) for o in outputs],
        **kw,
    )


class Rig:
    def __init__(self, slots: int, policy: BatchPolicy, room: int | None = None) -> None:
        self.clock = FakeClock()
        self.backend = FakeBackend(slots) if room is None else ReplicaBackend(slots, room=room)
        self.batcher = Batcher("m", policy, self.backend.dispatch, self.backend, clock=self.clock)
        self.tasks: dict[str, asyncio.Task[InferResponse]] = {}

    def submit(self, rid: str, **kw: Any) -> asyncio.Task[InferResponse]:
        task = asyncio.create_task(self.batcher.submit(make_req(rid, **kw)))
        self.tasks[rid] = task
        return task

    async def submit_all(self, *rids: str, **kw: Any) -> None:
        """Submit one after another, letting the batcher react to each."""
        for rid in rids:
            self.submit(rid, **kw)
            await settle()

    def batches(self) -> list[list[str]]:
        return self.backend.batches()

    def done(self) -> set[str]:
        return {rid for rid, t in self.tasks.items() if t.done()}

    def error_of(self, rid: str) -> BaseException | None:
        task = self.tasks[rid]
        assert task.done() and not task.cancelled()
        return task.exception()


@pytest.fixture
async def rig():
    rigs: list[Rig] = []

    async def make(slots: int = 1, room: int | None = None, **policy: Any) -> Rig:
        policy.setdefault("max_batch_size", 8)
        r = Rig(slots, BatchPolicy(**policy), room)
        await r.batcher.start()
        rigs.append(r)
        return r

    yield make
    for r in rigs:
        await r.batcher.close(0)
        assert all(t.done() for t in r.tasks.values())
        for t in r.tasks.values():
            if not t.cancelled():
                t.exception()  # retrieved: the test looked at the ones it cares about
        assert r.backend.over_capacity == 0


# ---- adaptive ----


async def test_adaptive_sends_at_once_when_a_replica_is_free(rig) -> None:
    r = await rig()
    await r.submit_all("a")
    assert r.batches() == [["a"]]
    assert r.clock.t == 0.0


async def test_adaptive_grows_the_batch_while_busy_and_sends_it_when_capacity_returns(rig) -> None:
    r = await rig()
    await r.submit_all("a")
    await r.submit_all("b", "c", "d", "e")
    assert r.batches() == [["a"]]
    assert r.batcher.queue_depth() == 4
    r.backend.complete(0)
    await settle()
    assert r.batches() == [["a"], ["b", "c", "d", "e"]]
    assert (await r.tasks["a"]).id == "a"
    r.backend.complete(1)
    assert [(await r.tasks[x]).id for x in "bcde"] == list("bcde")


async def test_adaptive_never_exceeds_max_batch_size_rows(rig) -> None:
    r = await rig(max_batch_size=4)
    await r.submit_all("busy")
    for rid, rows in [("a", 3), ("b", 2), ("c", 1), ("d", 1), ("e", 4)]:
        r.submit(rid, rows=rows)
    await settle()
    for i in range(4):
        r.backend.complete(i)
        await settle()
    assert r.batches() == [["busy"], ["a"], ["b", "c", "d"], ["e"]]


async def test_request_with_too_many_rows_is_rejected(rig) -> None:
    r = await rig(max_batch_size=4)
    with pytest.raises(InvalidArgument):
        await r.batcher.submit(make_req("big", rows=5))
    assert r.batches() == []


async def test_adaptive_uses_every_free_replica(rig) -> None:
    r = await rig(slots=3)
    await r.submit_all("a", "b", "c", "d")
    assert r.batches() == [["a"], ["b"], ["c"]]
    r.backend.complete(1)
    await settle()
    assert r.batches()[-1] == ["d"]


async def test_adaptive_keeps_a_busy_replicas_room_for_a_full_batch(rig) -> None:
    # One replica, idle below 1 batch in flight, room for 2 (the router's defaults).
    r = await rig(room=1)
    await r.submit_all("a")
    await r.submit_all("b", "c", "d")
    assert r.batches() == [["a"]]  # busy: the batch grows instead of going out small
    r.backend.complete(0)
    await settle()
    assert r.batches() == [["a"], ["b", "c", "d"]]
    assert r.batcher.stats.pipelined == 0


async def test_adaptive_pipelines_full_batches_into_a_busy_replicas_room(rig) -> None:
    r = await rig(room=1, max_batch_size=4)
    await r.submit_all("a")
    await r.submit_all("b", "c", "d")
    assert r.batches() == [["a"]]
    await r.submit_all("e")  # four rows queued: a full batch goes beside the running one
    assert r.batches() == [["a"], ["b", "c", "d", "e"]]
    await r.submit_all("f", "g", "h", "i")  # full again, but no room is left
    assert len(r.batches()) == 2
    r.backend.complete(0)  # still busy, with room again
    await settle()
    assert r.batches()[-1] == ["f", "g", "h", "i"]
    assert r.batcher.stats.pipelined == 2
    await r.submit_all("j")
    assert len(r.batches()) == 3
    r.backend.complete(1)
    r.backend.complete(2)
    await settle()
    assert r.batches()[-1] == ["j"]  # idle again: a partial batch goes at once


async def test_adaptive_room_holds_mixed_requests_until_one_kind_fills_a_batch(rig) -> None:
    r = await rig(room=1, max_batch_size=2)
    await r.submit_all("a")
    r.submit("x1", tail=(4,))
    r.submit("y1", tail=(5,))
    await settle()
    assert r.batches() == [["a"]]  # two rows queued, but no full batch of one kind
    await r.submit_all("x2", tail=(4,))
    assert r.batches() == [["a"], ["x1", "x2"]]


async def test_requests_of_one_loop_turn_share_a_batch(rig) -> None:
    r = await rig()
    for rid in "abc":
        r.submit(rid)  # no yield in between: all three arrive in the same loop turn
    await settle()
    assert r.batches() == [["a", "b", "c"]]


# ---- fixed (Triton) ----


async def test_fixed_waits_up_to_the_delay(rig) -> None:
    r = await rig(mode="fixed", max_queue_delay_us=1000, preferred_batch_sizes=(4,))
    await r.submit_all("a", "b")
    await r.clock.advance(0.0009)
    assert r.batches() == []
    await r.clock.advance(0.0001)
    assert r.batches() == [["a", "b"]]


async def test_fixed_delay_counts_from_the_oldest_request(rig) -> None:
    r = await rig(mode="fixed", max_queue_delay_us=1000, preferred_batch_sizes=(4,))
    await r.submit_all("a")
    await r.clock.advance(0.0006)
    await r.submit_all("b")
    await r.clock.advance(0.0004)
    assert r.batches() == [["a", "b"]]


async def test_fixed_fires_early_at_a_preferred_size(rig) -> None:
    r = await rig(mode="fixed", max_queue_delay_us=10_000_000, preferred_batch_sizes=(4,))
    await r.submit_all("a", "b", "c")
    assert r.batches() == []
    await r.submit_all("d")
    assert r.batches() == [["a", "b", "c", "d"]]


async def test_fixed_sends_the_largest_preferred_size_it_can_form(rig) -> None:
    r = await rig(mode="fixed", max_queue_delay_us=10_000_000, preferred_batch_sizes=(2, 4))
    await r.submit_all("a", "b")
    assert r.batches() == [["a", "b"]]  # the replica was free and 2 is preferred
    await r.submit_all("c", "d", "e", "f", "g")
    r.backend.complete(0)
    await settle()
    assert r.batches() == [["a", "b"], ["c", "d", "e", "f"]]
    assert r.batcher.queue_depth() == 1


async def test_fixed_without_preferred_sizes_fires_at_max_batch_size(rig) -> None:
    r = await rig(slots=2, mode="fixed", max_batch_size=3, max_queue_delay_us=10_000_000)
    await r.submit_all("a", "b", "c", "d")
    assert r.batches() == [["a", "b", "c"]]
    assert r.batcher.queue_depth() == 1


async def test_fixed_with_zero_delay_sends_what_is_queued(rig) -> None:
    r = await rig(mode="fixed", max_queue_delay_us=0, preferred_batch_sizes=(4,))
    await r.submit_all("a")
    assert r.batches() == [["a"]]


async def test_fixed_waits_for_capacity_after_the_delay(rig) -> None:
    r = await rig(mode="fixed", max_queue_delay_us=1000, preferred_batch_sizes=(2,))
    await r.submit_all("a", "b")
    await r.submit_all("c")
    await r.clock.advance(0.002)
    assert r.batches() == [["a", "b"]]
    r.backend.complete(0)
    await settle()
    assert r.batches() == [["a", "b"], ["c"]]


# ---- off / non-batching ----


async def test_off_mode_sends_one_request_per_batch(rig) -> None:
    r = await rig(slots=2, mode="off")
    await r.submit_all("a", "b", "c")
    assert r.batches() == [["a"], ["b"]]
    r.backend.complete(0)
    await settle()
    assert r.batches() == [["a"], ["b"], ["c"]]


async def test_non_batching_model_sends_one_request_per_batch(rig) -> None:
    r = await rig(max_batch_size=0)
    await r.submit_all("a", "b", "c")
    r.backend.complete(0)
    await settle()
    assert r.batches() == [["a"], ["b"]]


# ---- compatibility ----


async def test_only_compatible_requests_share_a_batch(rig) -> None:
    r = await rig()
    await r.submit_all("busy")
    r.submit("x1", tail=(4,))
    r.submit("y", tail=(5,))
    r.submit("x2", tail=(4,))
    r.submit("i", tail=(4,), dtype="INT32")
    r.submit("o", tail=(4,), outputs=("out",))
    r.submit("x3", tail=(4,))
    await settle()
    for i in range(5):
        r.backend.complete(i)
        await settle()
    assert r.batches() == [["busy"], ["x1", "x2", "x3"], ["y"], ["i"], ["o"]]


# ---- admission ----


async def test_full_queue_rejects_at_once(rig) -> None:
    r = await rig(max_queue_size=2)
    await r.submit_all("busy", "a", "b")
    with pytest.raises(Overloaded):
        await r.batcher.submit(make_req("c"))
    assert r.batcher.queue_depth() == 2
    assert r.batcher.stats.rejected_full == 1
    assert r.done() == set()


async def test_submit_before_start_and_after_close_is_unavailable() -> None:
    backend = FakeBackend()
    batcher = Batcher("m", BatchPolicy(max_batch_size=4), backend.dispatch, backend, clock=FakeClock())
    with pytest.raises(Unavailable):
        await batcher.submit(make_req("a"))
    await batcher.start()
    await batcher.close(0)
    with pytest.raises(Unavailable):
        await batcher.submit(make_req("b"))


# ---- priorities ----


async def test_higher_priority_is_served_first(rig) -> None:
    r = await rig(mode="off", priority_levels=3, default_priority_level=2)
    await r.submit_all("busy")
    await r.submit_all("low", priority=3)
    await r.submit_all("default", priority=0)
    await r.submit_all("out_of_range", priority=9)
    await r.submit_all("high", priority=1)
    for i in range(4):
        r.backend.complete(i)
        await settle()
    assert r.batches() == [["busy"], ["high"], ["default"], ["out_of_range"], ["low"]]


async def test_full_queue_sheds_the_lowest_priority_for_a_higher_one(rig) -> None:
    r = await rig(mode="off", max_queue_size=2, priority_levels=2, default_priority_level=2)
    await r.submit_all("busy")
    await r.submit_all("low1", "low2")
    await r.submit_all("high1", priority=1)
    assert isinstance(r.error_of("low2"), Overloaded)
    assert "low1" not in r.done()
    await r.submit_all("high2", priority=1)
    assert isinstance(r.error_of("low1"), Overloaded)
    with pytest.raises(Overloaded):
        await r.batcher.submit(make_req("high3", priority=1))
    with pytest.raises(Overloaded):
        await r.batcher.submit(make_req("low3", priority=2))
    assert r.batcher.stats.displaced == 2
    r.backend.complete(0)
    await settle()
    r.backend.complete(1)
    await settle()
    assert r.batches() == [["busy"], ["high1"], ["high2"]]


# ---- deadlines and queue timeouts ----


async def test_deadline_passing_in_the_queue_drops_the_request(rig) -> None:
    r = await rig()
    await r.submit_all("busy")
    await r.submit_all("a", deadline=0.5)
    await r.submit_all("b", deadline=2.0)
    await r.clock.advance(0.4)
    assert r.done() == set()
    await r.clock.advance(0.1)
    assert isinstance(r.error_of("a"), DeadlineExceeded)
    assert r.batcher.queue_depth() == 1
    r.backend.complete(0)
    await settle()
    assert r.batches() == [["busy"], ["b"]]


async def test_deadline_passing_while_the_batch_runs_answers_at_the_deadline(rig) -> None:
    r = await rig()
    r.submit("a", deadline=0.5)
    r.submit("b", deadline=5.0)
    await settle()
    assert r.batches() == [["a", "b"]]
    await r.clock.advance(0.5)
    assert isinstance(r.error_of("a"), DeadlineExceeded)  # answered now; the batch runs on
    assert "b" not in r.done()
    r.backend.complete(0)
    assert (await r.tasks["b"]).id == "b"
    assert r.batcher.stats.expired_running == 1


async def test_running_deadline_is_kept_even_with_preserve_ordering(rig) -> None:
    r = await rig(preserve_ordering=True)
    r.submit("first")
    r.submit("late", deadline=0.5)
    await settle()
    await r.clock.advance(0.5)
    assert isinstance(r.error_of("late"), DeadlineExceeded)
    assert "first" not in r.done()
    r.backend.complete(0)
    assert (await r.tasks["first"]).id == "first"


async def test_deadline_already_passed_is_rejected_at_once(rig) -> None:
    r = await rig()
    await r.clock.advance(1.0)
    with pytest.raises(DeadlineExceeded):
        await r.batcher.submit(make_req("late", deadline=1.0))
    assert r.batches() == []


async def test_queue_timeout_reject_with_override_that_only_shortens(rig) -> None:
    r = await rig(default_timeout_us=1000, allow_timeout_override=True)
    await r.submit_all("busy")
    await r.submit_all("default")
    await r.submit_all("shorter", timeout_us=500)
    await r.submit_all("longer", timeout_us=5000)
    await r.clock.advance(0.0005)
    assert r.done() == {"shorter"}
    assert type(r.error_of("shorter")) is Unavailable
    await r.clock.advance(0.0005)
    assert r.done() == {"shorter", "default", "longer"}
    assert r.batcher.stats.timed_out == 3


async def test_queue_timeout_override_can_be_disallowed(rig) -> None:
    r = await rig(default_timeout_us=1000, allow_timeout_override=False)
    await r.submit_all("busy")
    await r.submit_all("a", timeout_us=500)
    await r.clock.advance(0.0005)
    assert r.done() == set()
    await r.clock.advance(0.0005)
    assert r.done() == {"a"}


async def test_request_timeout_applies_without_a_default(rig) -> None:
    r = await rig()
    await r.submit_all("busy")
    await r.submit_all("a", timeout_us=300)
    await r.clock.advance(0.0003)
    assert r.done() == {"a"}


async def test_queue_timeout_delay_moves_the_request_behind_the_others(rig) -> None:
    r = await rig(mode="off", default_timeout_us=1000, timeout_action="DELAY")
    await r.submit_all("busy")
    await r.submit_all("old")
    await r.clock.advance(0.001)
    assert r.done() == set()
    await r.submit_all("new")
    for i in range(2):
        r.backend.complete(i)
        await settle()
    assert r.batches() == [["busy"], ["new"], ["old"]]
    assert r.batcher.stats.delayed == 1


# ---- cancellation ----


async def test_cancelled_request_leaves_the_queue(rig) -> None:
    r = await rig()
    await r.submit_all("busy", "a", "b")
    r.tasks["a"].cancel()
    await settle()
    assert r.batcher.queue_depth() == 1
    r.backend.complete(0)
    await settle()
    assert r.batches() == [["busy"], ["b"]]
    assert r.tasks["a"].cancelled()
    assert r.batcher.stats.cancelled == 1


async def test_cancelled_in_flight_request_does_not_disturb_its_batch(rig) -> None:
    r = await rig()
    await r.submit_all("busy", "a", "b")
    r.backend.complete(0)
    await settle()
    r.tasks["a"].cancel()
    await settle()
    r.backend.complete(1)
    await settle()
    assert r.tasks["a"].cancelled()
    assert (await r.tasks["b"]).id == "b"


# ---- dispatch failures ----


async def test_dispatch_error_fails_exactly_that_batch(rig, caplog: pytest.LogCaptureFixture) -> None:
    r = await rig(slots=3)
    await r.submit_all("a", "b", "c")
    bad = InvalidArgument("bad input")
    r.backend.complete(0, error=bad)
    r.backend.complete(1, error=RuntimeError("boom"))
    r.backend.complete(2)
    await settle()
    assert r.error_of("a") is bad
    assert isinstance(r.error_of("b"), Internal)
    assert "boom" not in str(r.error_of("b"))
    assert (await r.tasks["c"]).id == "c"
    assert any("boom" in str(rec.exc_info) for rec in caplog.records)
    assert r.batcher.stats.failed_batches == 2


async def test_wrong_number_of_responses_is_internal(rig) -> None:
    r = await rig()
    await r.submit_all("busy", "a", "b")
    r.backend.complete(0)
    await settle()
    r.backend.complete(1, responses=[_echo(r.backend.calls[1].requests[0])])
    await settle()
    assert isinstance(r.error_of("a"), Internal)
    assert isinstance(r.error_of("b"), Internal)


# ---- preserve_ordering ----


@pytest.mark.parametrize("preserve", [True, False])
async def test_preserve_ordering_delivers_in_arrival_order(rig, preserve: bool) -> None:
    r = await rig(slots=2, preserve_ordering=preserve)
    await r.submit_all("a", "b")
    assert r.batches() == [["a"], ["b"]]
    r.backend.complete(1)
    await settle()
    assert r.done() == (set() if preserve else {"b"})
    r.backend.complete(0)
    await settle()
    assert r.done() == {"a", "b"}


async def test_preserve_ordering_holds_errors_and_skips_cancelled(rig) -> None:
    r = await rig(slots=2, preserve_ordering=True)
    await r.submit_all("a", "b")
    await r.submit_all("c")
    r.tasks["c"].cancel()
    r.backend.complete(1, error=InvalidArgument("bad"))
    await settle()
    assert r.done() == {"c"}
    r.backend.complete(0)
    await settle()
    assert (await r.tasks["a"]).id == "a"
    assert isinstance(r.error_of("b"), InvalidArgument)


# ---- close ----


async def test_close_dispatches_the_queue_within_grace(rig) -> None:
    r = await rig(mode="fixed", max_queue_delay_us=10_000_000, preferred_batch_sizes=(8,))
    await r.submit_all("a", "b")
    closing = asyncio.create_task(r.batcher.close(5.0))
    await settle()
    assert r.batches() == [["a", "b"]]  # no waiting for the delay while draining
    with pytest.raises(Unavailable):
        await r.batcher.submit(make_req("late"))
    assert not closing.done()
    r.backend.complete(0)
    await settle()
    assert closing.done()
    assert r.done() == {"a", "b"}
    assert r.error_of("a") is None


async def test_close_fails_what_is_left_after_grace(rig) -> None:
    r = await rig()
    await r.submit_all("running", "queued")
    closing = asyncio.create_task(r.batcher.close(1.0))
    await r.clock.advance(0.9)
    assert not closing.done()
    await r.clock.advance(0.1)
    assert closing.done()
    assert type(r.error_of("queued")) is Unavailable
    assert type(r.error_of("running")) is Unavailable
    assert r.batcher.inflight_batches() == 0
    assert r.clock.pending_sleepers() == 0


async def test_close_without_grace_answers_everything(rig) -> None:
    r = await rig(preserve_ordering=True)
    await r.submit_all("running", "queued")
    await r.batcher.close(0)
    await settle()
    assert r.done() == {"running", "queued"}
    await r.batcher.close(0)  # idempotent


# ---- every future resolved exactly once, under random schedules ----


@pytest.mark.parametrize("seed", range(12))
async def test_random_schedules_answer_every_request_once(rig, seed: int, caplog: pytest.LogCaptureFixture) -> None:
    rnd = random.Random(seed)
    mode = ["adaptive", "fixed", "off"][seed % 3]
    r = await rig(
        slots=rnd.randint(1, 3),
        max_batch_size=4,
        mode=mode,
        preferred_batch_sizes=(2, 4) if mode == "fixed" else (),
        max_queue_delay_us=rnd.choice([0, 500, 2000]),
        max_queue_size=rnd.randint(2, 10),
        priority_levels=2,
        default_priority_level=2,
        default_timeout_us=rnd.choice([0, 3000]),
        timeout_action=rnd.choice(["REJECT", "DELAY"]),
        preserve_ordering=bool(seed % 2),
    )
    completed = 0
    for step in range(150):
        op = rnd.random()
        if op < 0.45:
            kw: dict[str, Any] = {"rows": rnd.randint(1, 4), "tail": rnd.choice([(4,), (5,)])}
            kw["priority"] = rnd.randint(0, 2)
            if rnd.random() < 0.3:
                kw["deadline"] = r.clock.t + rnd.uniform(0.0001, 0.005)
            r.submit(f"r{step}", **kw)
        elif op < 0.55 and r.tasks:
            rnd.choice(list(r.tasks.values())).cancel()
        elif op < 0.85 and completed < len(r.backend.calls):
            choice = rnd.random()
            err = InvalidArgument("bad") if choice < 0.15 else None
            r.backend.complete(completed, error=err)
            completed += 1
        else:
            await r.clock.advance(rnd.uniform(0.0001, 0.002))
        await settle()
    closing = asyncio.create_task(r.batcher.close(0.001 if seed % 4 else 0.0))
    await r.clock.advance(0.001)
    assert closing.done()

    assert all(t.done() for t in r.tasks.values())
    dispatched = [rid for call in r.backend.calls for rid in call.ids]
    assert len(dispatched) == len(set(dispatched)), "a request was dispatched twice"
    for call in r.backend.calls:
        assert sum(q.inputs[0].shape[0] for q in call.requests) <= 4
        assert len({q.inputs[0].shape[1:] for q in call.requests}) == 1
        if mode == "off":
            assert len(call.requests) == 1
    for rid, task in r.tasks.items():
        if not task.cancelled() and task.exception() is None:
            assert task.result().id == rid
            assert rid in dispatched
    # A second resolution of a future would raise InvalidStateError inside the batcher and be logged.
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR]


# ---- a failing seam never leaves callers waiting ----


async def test_failing_capacity_fails_queued_requests_and_stops_accepting(caplog: pytest.LogCaptureFixture) -> None:
    class BrokenCapacity(FakeBackend):
        async def wait(self) -> None:
            raise RuntimeError("router bug")

    backend = BrokenCapacity()
    batcher = Batcher("m", BatchPolicy(max_batch_size=4), backend.dispatch, backend, clock=FakeClock())
    await batcher.start()
    first = asyncio.create_task(batcher.submit(make_req("first")))
    await settle()
    queued = asyncio.create_task(batcher.submit(make_req("queued")))  # no capacity: the loop calls wait()
    await settle()
    assert isinstance(queued.exception(), Internal)
    with pytest.raises(Unavailable):
        await batcher.submit(make_req("later"))
    assert any("router bug" in str(rec.exc_info) for rec in caplog.records)
    backend.complete(0)
    assert (await first).id == "first"
    await batcher.close(0)
