"""Batcher: the burst hold of adaptive mode (``BatchPolicy.burst_hold_us``).

Requests that arrive to find every slot busy mark a burst; until the model is
idle again, a freed slot takes a batch only once it reaches ``max_batch_size``
rows or its oldest request has waited the hold. Low load never waits. Runs on
the fake clock and backend of ``fakes.py``.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.unit.gateway.batching.fakes import settle

pytestmark = pytest.mark.timeout(10)

HOLD_US = 5000


async def test_low_load_never_waits_for_the_hold(rig) -> None:
    r = await rig(max_batch_size=4, burst_hold_us=HOLD_US)
    await r.submit_all("a")
    assert r.batches() == [["a"]]
    r.backend.complete(0)
    await settle()
    await r.submit_all("b")  # the model was idle: no burst
    assert r.batches() == [["a"], ["b"]]
    assert r.clock.t == 0.0


async def test_a_freed_slot_waits_for_a_full_batch_under_a_burst(rig) -> None:
    r = await rig(max_batch_size=4, burst_hold_us=HOLD_US)
    await r.submit_all("a", "b", "c")  # b and c find the only slot busy: a burst
    r.backend.complete(0)
    await settle()
    assert r.batches() == [["a"]]  # b and c wait for more rows
    await r.submit_all("d", "e")
    assert r.batches() == [["a"], ["b", "c", "d", "e"]]  # full: goes at once
    assert r.clock.t == 0.0


async def test_the_hold_ends_at_its_time_from_the_oldest_request(rig) -> None:
    r = await rig(max_batch_size=8, burst_hold_us=HOLD_US)
    await r.submit_all("a", "b")
    r.backend.complete(0)
    for rid in "cdef":  # rows keep coming, each within a quarter of the hold of the last
        await r.clock.advance(0.001)
        await r.submit_all(rid)
    assert r.batches() == [["a"]]
    await r.clock.advance(0.0011)  # 5 ms since b arrived
    assert r.batches() == [["a"], ["b", "c", "d", "e", "f"]]


async def test_the_hold_ends_when_rows_stop_coming(rig) -> None:
    r = await rig(max_batch_size=8, burst_hold_us=HOLD_US)
    await r.submit_all("a", "b", "c")
    r.backend.complete(0)
    await r.clock.advance(0.001)
    assert r.batches() == [["a"]]
    await r.clock.advance(0.0003)  # 1.25 ms (a quarter of the hold) with no arrival: it stopped growing
    assert r.batches() == [["a"], ["b", "c"]]


async def test_a_slot_that_frees_after_the_hold_takes_the_batch_at_once(rig) -> None:
    r = await rig(max_batch_size=4, burst_hold_us=HOLD_US)
    await r.submit_all("a", "b")
    await r.clock.advance(0.01)  # b waited longer than the hold while the slot was busy
    r.backend.complete(0)
    await settle()
    assert r.batches() == [["a"], ["b"]]


async def test_the_burst_ends_when_the_model_is_idle(rig) -> None:
    r = await rig(max_batch_size=4, burst_hold_us=HOLD_US)
    await r.submit_all("a", "b")
    r.backend.complete(0)
    await r.clock.advance(0.005)
    assert r.batches() == [["a"], ["b"]]
    r.backend.complete(1)
    await settle()
    await r.submit_all("c")  # idle again: low load, no wait
    assert r.batches()[-1] == ["c"]


async def test_no_hold_without_the_setting_or_while_draining(rig) -> None:
    r = await rig(max_batch_size=4)
    await r.submit_all("a", "b")
    r.backend.complete(0)
    await settle()
    assert r.batches() == [["a"], ["b"]]
    held = await rig(max_batch_size=4, burst_hold_us=HOLD_US)
    await held.submit_all("a", "b")
    held.backend.complete(0)
    await settle()
    assert held.batches() == [["a"]]
    closing = asyncio.ensure_future(held.batcher.close(1.0))  # draining: what is queued goes now
    await settle()
    assert held.batches() == [["a"], ["b"]]
    held.backend.complete(1)
    await closing


async def _three_at_once_then_idle(r) -> None:
    """a runs while b and c wait (three requests in the gateway at once), then the model idles."""
    await r.submit_all("a", "b", "c")
    r.backend.complete(0)
    await r.clock.advance(0.00125)  # no earlier window to go by: the hold waits for rows to stop
    assert r.batches() == [["a"], ["b", "c"]]
    r.backend.complete(1)
    await settle()


async def test_closed_loop_clients_all_back_end_the_hold_at_once(rig) -> None:
    r = await rig(max_batch_size=8, burst_hold_us=HOLD_US)
    await _three_at_once_then_idle(r)
    await r.clock.advance(1.0)  # the next window: three at once were the most of the last one
    started = r.clock.t
    await r.submit_all("d", "e", "f")  # d goes at once; e and f find the slot busy
    r.backend.complete(2)
    await settle()
    assert r.batches()[-1] == ["d"]  # two of three here: d's client has not sent again yet
    await r.submit_all("g")  # it has: all three here, and no more can come until they are answered
    assert r.batches()[-1] == ["e", "f", "g"]
    assert r.clock.t == started  # without waiting out any of the hold


async def test_a_burst_larger_than_the_last_window_is_still_held(rig) -> None:
    r = await rig(max_batch_size=8, burst_hold_us=HOLD_US)
    await _three_at_once_then_idle(r)
    await r.clock.advance(1.0)
    await r.submit_all(*"defghijk")  # eight at once, more than twice the last window's most: a burst
    r.backend.complete(2)
    await settle()
    assert r.batches()[-1] == ["d"]  # seven queued are more than three, but a burst keeps its hold
    await r.submit_all("l")
    assert r.batches()[-1] == list("efghijkl")  # full: goes at once


async def test_the_hold_forgets_a_window_long_gone(rig) -> None:
    r = await rig(max_batch_size=8, burst_hold_us=HOLD_US)
    await _three_at_once_then_idle(r)
    await r.clock.advance(2.5)  # a whole window with nothing: the three are no longer known
    await r.submit_all("d", "e", "f")
    r.backend.complete(2)
    await settle()
    await r.submit_all("g")
    assert r.batches()[-1] == ["d"]  # held as in a first burst
    await r.clock.advance(0.00125)
    assert r.batches()[-1] == ["e", "f", "g"]
