"""Batcher: admission, priority levels, deadlines and queue timeouts (REJECT and DELAY).

Runs on the fakes of ``fakes.py`` (fake clock, fake backend) through the
``rig`` fixture of ``conftest.py``.
"""

from __future__ import annotations

import pytest

from gateway.batching.batcher import Batcher, BatchPolicy
from protos.errors import DeadlineExceeded, InvalidArgument, Overloaded, Unavailable
from tests.unit.gateway.batching.fakes import FakeBackend, FakeClock, make_req, settle

pytestmark = pytest.mark.timeout(10)


# ---- admission ----


async def test_request_with_too_many_rows_is_rejected(rig) -> None:
    r = await rig(max_batch_size=4)
    with pytest.raises(InvalidArgument):
        await r.batcher.submit(make_req("big", rows=5))
    assert r.batches() == []


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


async def test_a_request_without_an_id_is_named_by_its_model(rig) -> None:
    r = await rig()
    await r.submit_all("busy")
    await r.submit_all("", deadline=0.5)
    await r.submit_all("a", deadline=0.5)
    await r.clock.advance(0.5)
    assert str(r.error_of("")) == "a request of model 'm' deadline passed while queued"
    assert str(r.error_of("a")) == "request 'a' deadline passed while queued"
    with pytest.raises(DeadlineExceeded, match="^a request of model 'm' deadline passed before it was queued$"):
        await r.batcher.submit(make_req("", deadline=0.5))
    with pytest.raises(InvalidArgument, match="^batch size 9 is outside 0..8 for model 'm'$"):
        await r.batcher.submit(make_req("", rows=9))
    r.backend.complete(0)


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
