"""The batcher's per-model queue bookkeeping: who waits, until when, and the one answer each gets.

Owns :class:`RequestQueue` and its :class:`Entry` (one queued request with its
future): admission (rows checked against ``max_batch_size``, priority level,
its level's queue policy -- timeout, action, bound --, shedding a lower
priority when the whole queue is full), the queues
per priority level (arrival order, DELAYed entries behind), the heap of
deadline and queue-timeout timers, and each entry's one outcome -- in arrival
order with ``preserve_ordering``. It never decides when a batch goes: that is
:class:`~gateway.batching.batcher.Batcher`'s, which forms batches from
:meth:`RequestQueue.iter_queued` and hands them over with :meth:`RequestQueue.take`.
"""

from __future__ import annotations

import asyncio
import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Any

from gateway.batching.policy import BatchPolicy, QueuePolicy
from gateway.batching.seams import BatcherStats
from gateway.types import InferRequest, InferResponse, request_name
from protos.errors import DeadlineExceeded, InferGateError, InvalidArgument, Overloaded, Unavailable

__all__ = ["Entry", "EntryState", "RequestQueue", "earliest"]


class EntryState(Enum):
    QUEUED = 1
    RUNNING = 2
    DONE = 3


_DEADLINE, _TIMEOUT = 0, 1


@dataclass(slots=True, eq=False)
class Entry:
    req: InferRequest
    future: asyncio.Future[InferResponse]
    seq: int  # arrival order among accepted requests
    rows: int
    key: tuple[Any, ...]  # requests share a batch only when their keys are equal
    slot: int  # priority level - 1
    enqueued_at: float
    timeout_at: float | None
    delayed: bool = False
    state: EntryState = EntryState.QUEUED


def _live(timer: tuple[float, int, int, Entry]) -> bool:
    """Whether a timer can still act: any on a queued entry, a deadline on a running one."""
    state = timer[3].state
    return state is EntryState.QUEUED or (state is EntryState.RUNNING and timer[2] == _DEADLINE)


def earliest(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    return a if b is None else min(a, b)


class RequestQueue:
    """One model's queued and running entries. ``finish`` gives each its outcome exactly once.

    ``key_of`` tells which requests may share a batch; ``on_done`` is called
    whenever an entry gets its outcome (the batcher checks whether it is idle).
    """

    def __init__(
        self,
        name: str,
        policy: BatchPolicy,
        stats: BatcherStats,
        *,
        key_of: Callable[[InferRequest], tuple[Any, ...]],
        on_done: Callable[[], None],
    ) -> None:
        self.name = name
        self.policy = policy
        self.stats = stats
        self._key_of = key_of
        self._on_done = on_done
        # Per priority level: entries not yet timed out, then DELAYed ones; both in arrival order.
        levels = max(1, policy.priority_levels)
        self._queues = [(OrderedDict[int, Entry](), OrderedDict[int, Entry]()) for _ in range(levels)]
        self._level_policies: list[QueuePolicy] = [policy.queue_policy(level + 1) for level in range(levels)]
        self.count = 0
        self.rows = 0  # rows of all queued entries, whatever their key
        self.running = 0  # entries in a running batch and not answered yet
        # Heap of (when, seq, kind, entry): queue timeouts of queued entries, deadlines of
        # queued and running ones (a request is answered by its deadline even while its
        # batch runs on for the others). Items whose entry moved on stay in it and are
        # skipped when popped; it is rebuilt when stale items outnumber the live ones.
        self._timers: list[tuple[float, int, int, Entry]] = []
        self._seq = 0
        self._next_delivery = 0  # preserve_ordering: the seq whose outcome goes out next
        self._held: dict[int, tuple[Entry, InferResponse | BaseException | None]] = {}

    # ---- admission ----

    def admit(self, req: InferRequest, now: float) -> Entry:
        """Queue ``req`` (or raise InvalidArgument / Overloaded) and arm its timers."""
        rows = self._rows_of(req)
        slot = self._slot_of(req.priority)
        level = self._level_policies[slot]
        if level.max_queue_size and sum(map(len, self._queues[slot])) >= level.max_queue_size:
            # A level bounded by its own queue policy: full is full (Triton's words first).
            self.stats.rejected_full += 1
            raise Overloaded(f"Exceeds maximum queue size: model '{self.name}' priority level {slot + 1} holds "
                             f"{level.max_queue_size} requests")
        if self.count >= self.policy.max_queue_size:
            self._shed_for(slot)
        future = asyncio.get_running_loop().create_future()
        entry = Entry(req, future, self._seq, rows, self._key_of(req), slot, now, self._timeout_at(req, now, level))
        self._seq += 1
        self._queues[slot][0][entry.seq] = entry
        self.count += 1
        self.rows += rows
        self.stats.accepted += 1
        for when, kind in ((entry.req.deadline, _DEADLINE), (entry.timeout_at, _TIMEOUT)):
            if when is not None:
                heapq.heappush(self._timers, (when, entry.seq, kind, entry))
        if len(self._timers) > 2 * (self.count + self.running) + 64:
            self._timers = [t for t in self._timers if _live(t)]
            heapq.heapify(self._timers)
        return entry

    def _rows_of(self, req: InferRequest) -> int:
        if self.policy.max_batch_size == 0 or not req.inputs or not req.inputs[0].shape:
            return 1
        rows = req.inputs[0].shape[0]
        if not 0 <= rows <= self.policy.max_batch_size:
            of_request = f" of request '{req.id}'" if req.id else ""  # the model is named below
            raise InvalidArgument(
                f"batch size {rows}{of_request} is outside 0..{self.policy.max_batch_size} for model '{self.name}'"
            )
        return rows

    def _slot_of(self, priority: int) -> int:
        levels = self.policy.priority_levels
        if levels == 0:
            return 0
        return (priority if 1 <= priority <= levels else self.policy.default_priority_level) - 1

    @staticmethod
    def _timeout_at(req: InferRequest, now: float, level: QueuePolicy) -> float | None:
        # Triton: a request may shorten its level's queue timeout, never lengthen it.
        timeout_us = level.default_timeout_us
        shorter = req.timeout_us > 0 and (timeout_us == 0 or req.timeout_us < timeout_us)
        if shorter and level.allow_timeout_override:
            timeout_us = req.timeout_us
        return now + timeout_us / 1e6 if timeout_us > 0 else None

    def _shed_for(self, slot: int) -> None:
        """Queue full: displace the request that would be served last, if it is of a lower priority."""
        for lower in range(len(self._queues) - 1, slot, -1):
            normal, delayed = self._queues[lower]
            last = delayed or normal
            if last:
                victim = next(reversed(last.values()))
                self._unqueue(victim)
                self.finish(victim, Overloaded(f"model '{self.name}' queue is full; displaced by a higher priority"))
                self.stats.displaced += 1
                return
        self.stats.rejected_full += 1
        raise Overloaded(f"model '{self.name}' queue is full ({self.policy.max_queue_size} requests)")

    # ---- queued entries ----

    def iter_queued(self) -> Iterator[Entry]:
        """Queued entries in the order they are served."""
        for normal, delayed in self._queues:
            yield from normal.values()
            yield from delayed.values()

    def next_timer(self) -> float | None:
        """When the earliest timer (queue timeout or deadline) is due, if any."""
        return self._timers[0][0] if self._timers else None

    def _unqueue(self, entry: Entry) -> None:
        normal, delayed = self._queues[entry.slot]
        if (delayed if entry.delayed else normal).pop(entry.seq, None) is not None:
            self.count -= 1
            self.rows -= entry.rows

    def take(self, batch: list[Entry]) -> None:
        """The entries of ``batch`` leave the queue to run."""
        for entry in batch:
            self._unqueue(entry)
            entry.state = EntryState.RUNNING
        self.running += len(batch)

    def requeue(self, batch: list[Entry]) -> None:
        """Entries taken for a batch that was never sent go back to their places, timers and all."""
        touched: set[tuple[int, bool]] = set()
        for entry in batch:
            if entry.state is not EntryState.RUNNING:
                continue  # answered meanwhile (its deadline passed)
            entry.state = EntryState.QUEUED
            self.running -= 1
            self._queues[entry.slot][entry.delayed][entry.seq] = entry
            touched.add((entry.slot, entry.delayed))
            self.count += 1
            self.rows += entry.rows
            for when, kind in ((entry.req.deadline, _DEADLINE), (entry.timeout_at, _TIMEOUT)):
                if when is not None:  # a duplicate of a timer still in the heap acts once
                    heapq.heappush(self._timers, (when, entry.seq, kind, entry))
        for slot, delayed in touched:  # back in arrival order
            queue = self._queues[slot][delayed]
            ordered = sorted(queue.items())
            queue.clear()
            queue.update(ordered)

    def cancel(self, entry: Entry) -> None:
        """A queued entry whose caller went away leaves without an outcome."""
        self._unqueue(entry)
        self.finish(entry, None)
        self.stats.cancelled += 1

    def fail_queued(self, error: InferGateError) -> None:
        for entry in list(self.iter_queued()):
            self._unqueue(entry)
            self.finish(entry, error)
        self._timers.clear()

    def expire(self, now: float) -> None:
        """Act on every timer due by ``now``: deadlines, and queue timeouts by the policy's action."""
        timers = self._timers
        while timers and timers[0][0] <= now:
            _, _, kind, entry = heapq.heappop(timers)
            if entry.state is EntryState.RUNNING and kind == _DEADLINE:
                # Answered now, out of turn even with preserve_ordering (a deadline is a
                # promise to the caller); the batch's later answer for it is dropped.
                if not entry.future.done():
                    entry.future.set_exception(DeadlineExceeded(f"{request_name(entry.req)} deadline exceeded"))
                self.finish(entry, None)
                self.stats.expired_running += 1
                continue
            if entry.state is not EntryState.QUEUED:
                continue
            if kind == _DEADLINE:
                self._unqueue(entry)
                self.finish(entry, DeadlineExceeded(f"{request_name(entry.req)} deadline passed while queued"))
                self.stats.expired += 1
            elif self._level_policies[entry.slot].timeout_action == "DELAY":
                normal, delayed = self._queues[entry.slot]
                if normal.pop(entry.seq, None) is not None:
                    entry.delayed = True
                    delayed[entry.seq] = entry
                    self.stats.delayed += 1
            else:
                self._unqueue(entry)
                # Triton's words and code for its queue policy's REJECT, which clients match on.
                self.finish(entry, Unavailable("Request timeout expired"))
                self.stats.timed_out += 1
        while timers and not _live(timers[0]):
            heapq.heappop(timers)

    # ---- outcomes ----

    def finish(self, entry: Entry, outcome: InferResponse | BaseException | None) -> None:
        """Give an entry its one outcome (None: its caller is gone). Later calls are no-ops."""
        if entry.state is EntryState.DONE:
            return
        if entry.state is EntryState.RUNNING:
            self.running -= 1
        entry.state = EntryState.DONE
        self._on_done()
        if not self.policy.preserve_ordering:
            self._resolve(entry, outcome)
            return
        # Outcomes go out in arrival order: hold each until every earlier entry has one.
        self._held[entry.seq] = (entry, outcome)
        while self._next_delivery in self._held:
            held, held_outcome = self._held.pop(self._next_delivery)
            self._next_delivery += 1
            self._resolve(held, held_outcome)

    @staticmethod
    def _resolve(entry: Entry, outcome: InferResponse | BaseException | None) -> None:
        if outcome is None or entry.future.done():
            return
        if isinstance(outcome, BaseException):
            entry.future.set_exception(outcome)
        else:
            entry.future.set_result(outcome)
