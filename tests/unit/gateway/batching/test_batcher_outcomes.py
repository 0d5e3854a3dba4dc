"""Batcher: what each caller gets back -- cancellation, dispatch failures, preserve_ordering,
close, a failing seam, and every request answered exactly once under random schedules.

Runs on the fakes of ``fakes.py`` (fake clock, fake backend) through the
``rig`` fixture of ``conftest.py``.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any

import pytest

from gateway.batching.batcher import Batcher, BatchPolicy
from protos.errors import Internal, InvalidArgument, Unavailable
from tests.unit.gateway.batching.fakes import FakeBackend, FakeClock, echo, make_req, settle

pytestmark = pytest.mark.timeout(10)


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
    assert "RuntimeError: boom" in str(r.error_of("b"))  # the cause is named, not a bare "internal error"
    assert (await r.tasks["c"]).id == "c"
    assert any("boom" in str(rec.exc_info) for rec in caplog.records)
    assert r.batcher.stats.failed_batches == 2


async def test_wrong_number_of_responses_is_internal(rig) -> None:
    r = await rig()
    await r.submit_all("busy", "a", "b")
    r.backend.complete(0)
    await settle()
    r.backend.complete(1, responses=[echo(r.backend.calls[1].requests[0])])
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
