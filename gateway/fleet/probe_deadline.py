"""A probe's deadline, judged by what the probe waited on.

Owns :class:`LoopStalls`, which records when the gateway's own event loop
could not run (a ticker that notes how late each of its wake-ups came), and
:func:`within`, the wait that bounds one probe. A probe that times out says
the worker did not answer in time -- unless the time went elsewhere:

* the gateway's loop was busy (serializing or parsing a message of hundreds
  of MiB holds it for a second or more): the answer may have sat unread, so
  the stalled time does not count against the probe;
* the worker holds calls of ours that are still running (``busy()``): a
  worker receiving or sending a large message of ours parses it on the same
  loop that answers its probes, so it answers them after; while it still
  holds them, the probe's deadline moves one timeout further each time it
  passes, up to ``busy_grace_s`` (:data:`BUSY_GRACE_S`) beyond the plain
  one. Once the worker holds none, the next deadline that passes fails the
  probe. A worker that died meanwhile is found by those calls themselves
  (their connection breaks, and the router marks it DOWN at once); one hung
  while holding them, by probes that each waited out the grace.

Measured on 2 cores through ``infergate up`` with one worker and a single
256 MiB ``bytes_contents`` request (18 s end to end): the gateway's loop
stalled up to 2 s at a time, and the worker answered ServerReady up to 4 s
late; with a 1 s probe timeout the worker was marked DOWN twice during the
call. A grace of two timeouts, once, was not enough either: a clean
checkout's test run saw two probes in a row time out behind the same
256 MiB request.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TypeVar

log = logging.getLogger(__name__)

_T = TypeVar("_T")

# How much longer than its timeout a probe may wait while the worker holds calls of ours.
BUSY_GRACE_S = 15.0


class LoopStalls:
    """When the event loop could not run: a ticker's late wake-ups, kept for ``keep_s``."""

    def __init__(self, tick_s: float = 0.05, *, keep_s: float = 300.0, clock: Callable[[], float] | None = None) -> None:
        self.tick_s = tick_s
        self._keep_s = keep_s
        self._clock = clock
        # (from, to): the loop ran nothing of ours in between; oldest first.
        self._stalls: deque[tuple[float, float]] = deque()
        self._task: asyncio.Task[None] | None = None

    def _now(self) -> float:
        return self._clock() if self._clock is not None else asyncio.get_running_loop().time()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._tick(), name="loop-stalls")
            self._task.add_done_callback(self._done)

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def _done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("the loop stall monitor stopped", exc_info=task.exception())

    async def _tick(self) -> None:
        while True:
            due = self._now() + self.tick_s
            await asyncio.sleep(self.tick_s)
            self.note(due, self._now())

    def note(self, due: float, woke: float) -> None:
        """A wake-up due at ``due`` came at ``woke``: anything late beyond one tick was a stall."""
        if woke - due > self.tick_s:
            self._stalls.append((due, woke))
        while self._stalls and self._stalls[0][1] < woke - self._keep_s:
            self._stalls.popleft()

    def stalled_s(self, since: float, until: float) -> float:
        """How long the loop stalled between ``since`` and ``until``."""
        return sum(max(0.0, min(b, until) - max(a, since)) for a, b in self._stalls)


async def within(
    call: Awaitable[_T], timeout_s: float, stalls: LoopStalls, *, busy: Callable[[], bool] = lambda: False,
    busy_grace_s: float = BUSY_GRACE_S,
) -> _T:
    """``call``'s result, or ``asyncio.TimeoutError`` once it had ``timeout_s`` of the loop's time,
    moved one timeout further each time it passes while ``busy()`` says the worker holds calls of
    ours, up to ``busy_grace_s`` more."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(call)
    started = loop.time()
    grace = 0.0
    try:
        while True:
            now = loop.time()
            deadline = started + timeout_s + grace + stalls.stalled_s(started, now)
            if now >= deadline:
                if grace < busy_grace_s and busy():
                    grace = min(busy_grace_s, grace + timeout_s)
                    continue
                raise asyncio.TimeoutError
            done, _ = await asyncio.wait({task}, timeout=deadline - now)
            if done:
                return task.result()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
