"""Batcher: batch formation per mode (adaptive, fixed, off) and which requests may share a batch.

Runs on the fakes of ``fakes.py`` (fake clock, fake backend) through the
``rig`` fixture of ``conftest.py``.
"""

from __future__ import annotations

import pytest

from tests.unit.gateway.batching.fakes import settle

pytestmark = pytest.mark.timeout(10)


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


async def test_arrivals_of_one_turn_beyond_one_batch_go_in_the_next_one(rig) -> None:
    # The first batch is sent before the scheduler looks again: the second must see its slot taken.
    r = await rig(max_batch_size=4)
    r.submit("a", rows=3)
    r.submit("b", rows=2)  # same loop turn: no room left in a's batch
    await settle()
    assert r.batches() == [["a"]]  # one slot, taken by a's batch (the fixture checks no dispatch went past it)
    r.backend.complete(0)
    await settle()
    assert r.batches() == [["a"], ["b"]]


async def test_arrivals_of_one_turn_fill_every_free_replica(rig) -> None:
    r = await rig(slots=2, max_batch_size=4)
    for rid, rows in (("a", 3), ("b", 2), ("c", 2)):
        r.submit(rid, rows=rows)
    await settle()
    assert r.batches() == [["a"], ["b", "c"]]


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
