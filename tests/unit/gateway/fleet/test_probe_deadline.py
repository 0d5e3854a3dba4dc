"""Tests for gateway/fleet/probe_deadline.py: a probe's timeout counts the loop's own time,
not its stalls, and a worker busy with calls of ours gets more time while it holds them. No sockets."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.fleet.probe_deadline import LoopStalls, within

pytestmark = pytest.mark.timeout(10)


def test_stalls_are_late_wake_ups_and_count_where_they_overlap() -> None:
    stalls = LoopStalls(tick_s=0.05)
    stalls.note(10.0, 10.02)  # a little late: not a stall
    stalls.note(20.0, 22.0)  # two seconds the loop could not run
    assert stalls.stalled_s(0.0, 100.0) == pytest.approx(2.0)
    assert stalls.stalled_s(21.0, 100.0) == pytest.approx(1.0)
    assert stalls.stalled_s(0.0, 20.5) == pytest.approx(0.5)
    assert stalls.stalled_s(23.0, 30.0) == 0.0


async def test_a_probe_that_does_not_answer_times_out() -> None:
    never = asyncio.get_running_loop().create_future()
    started = time.monotonic()
    with pytest.raises(asyncio.TimeoutError):
        await within(never, 0.1, LoopStalls())
    assert never.cancelled()
    assert time.monotonic() - started < 5


async def test_the_loops_own_stall_does_not_count_against_the_probe() -> None:
    stalls = LoopStalls(tick_s=0.01)
    stalls.start()
    try:
        async def answer_after_a_stall() -> str:
            await asyncio.sleep(0.02)
            time.sleep(0.3)  # the gateway's loop is held (a large message parsed on it)
            await asyncio.sleep(0.05)
            return "ready"

        assert await within(answer_after_a_stall(), 0.2, stalls) == "ready"
    finally:
        stalls.stop()


async def late(s: float) -> str:
    await asyncio.sleep(s)
    return "ready"


async def test_a_worker_busy_with_our_calls_gets_more_time_while_it_holds_them() -> None:
    assert await within(late(0.15), 0.1, LoopStalls(), busy=lambda: True) == "ready"
    with pytest.raises(asyncio.TimeoutError):
        await within(late(0.15), 0.1, LoopStalls(), busy=lambda: False)
    # Several timeouts late, still holding our calls: still waited for.
    assert await within(late(0.45), 0.1, LoopStalls(), busy=lambda: True, busy_grace_s=1.0) == "ready"
    with pytest.raises(asyncio.TimeoutError):  # not beyond the grace
        await within(late(0.5), 0.1, LoopStalls(), busy=lambda: True, busy_grace_s=0.2)


async def test_once_the_worker_holds_no_call_of_ours_the_next_deadline_fails() -> None:
    loop = asyncio.get_running_loop()
    free_at = loop.time() + 0.15  # our calls end here; the probe would answer only at 0.5 s
    with pytest.raises(asyncio.TimeoutError):
        await within(late(0.5), 0.1, LoopStalls(), busy=lambda: loop.time() < free_at, busy_grace_s=5.0)
