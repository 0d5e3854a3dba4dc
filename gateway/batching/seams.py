"""The batcher's seams: what it is given and what it reports.

Owns the interfaces between :class:`~gateway.batching.batcher.Batcher` and the
rest of the gateway: :data:`Dispatch` (the executor's call that runs one
batch), :class:`Capacity` (the router's view of one model's replicas),
:class:`Clock` with :class:`LoopClock`, the event loop's clock that request
deadlines use, and :class:`BatcherStats`, the counters the metrics exporter
reads, and :class:`NotSent`, which a dispatch raises when its batch could not
start at once and was not sent. Tests swap in fakes for the first three.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from gateway.types import InferRequest, InferResponse

__all__ = ["BatcherStats", "Capacity", "Clock", "Dispatch", "LoopClock", "NotSent"]

Dispatch = Callable[[list[InferRequest]], Awaitable[list[InferResponse]]]


class NotSent(Exception):
    """The batch was not sent: no replica could start it at once, and it was asked not to wait.

    Raised before anything leaves the gateway; the batcher puts the requests
    back in the queue, where their queue policy still applies.
    """


class Capacity(Protocol):
    """The router's view of one model's replicas.

    ``has_capacity()``: a batch sent now starts at once (some replica is idle).
    ``has_room()``: some replica can take one more batch now, busy or not
    (below its in-flight bound); a Capacity without it is taken to have room
    exactly when it has capacity. ``wait()`` resolves when either may have
    changed and must return promptly when ``has_capacity()`` is already true;
    the batcher asks first, then waits.
    """

    def has_capacity(self) -> bool: ...

    async def wait(self) -> None: ...


class Clock(Protocol):
    def now(self) -> float: ...  # seconds, monotonic, the clock of InferRequest.deadline

    async def sleep(self, s: float) -> None: ...


class LoopClock:
    """The event loop's clock (``loop.time()``), which request deadlines use."""

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    async def sleep(self, s: float) -> None:
        await asyncio.sleep(s)


@dataclass(slots=True)
class BatcherStats:
    """Counters since the batcher was built, read by the metrics exporter."""

    accepted: int = 0
    rejected_full: int = 0
    displaced: int = 0
    expired: int = 0  # deadline passed while queued
    expired_running: int = 0  # deadline passed while its batch ran: answered then, the batch goes on
    timed_out: int = 0  # queue timeout with REJECT
    delayed: int = 0  # queue timeout with DELAY
    cancelled: int = 0  # the caller went away before its batch ran
    batches: int = 0
    pipelined: int = 0  # full batches sent to a busy replica's spare room
    at_once: int = 0  # adaptive: batches sent as they stood to an idle replica, no burst on (nothing held)
    requeued: int = 0  # batches that found no replica free at once and went back to the queue
    batched_requests: int = 0
    batched_rows: int = 0
    failed_batches: int = 0
