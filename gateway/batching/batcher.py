"""Dynamic batching: the per-model queue that turns single requests into batches.

Owns :class:`Batcher`: its scheduling loop, the batches it forms and the tasks
that run them. What it is told to do is a
:class:`~gateway.batching.policy.BatchPolicy`, re-exported here; its seams
(``Dispatch``, ``Capacity``, ``Clock``, ``BatcherStats``) live in
:mod:`gateway.batching.seams`; the bookkeeping of queued entries, their timers
and outcomes in :mod:`gateway.batching.request_queue`.

The path through here: ``submit(req)`` queues one entry holding one future ->
the scheduling loop forms a batch of compatible entries once the mode says so
and the router reports a free replica -> the batch runs as a task owned by the
batcher and calls ``dispatch`` -> a ``finally`` resolves every entry of it.

Modes:

* ``adaptive`` (default), work-conserving: while a replica is idle
  (``Capacity.has_capacity``), what is queued goes at once (up to
  ``max_batch_size`` rows); while every replica is busy the queue grows, and
  the largest batch goes the moment one turns idle. A busy replica that still
  has room below its in-flight bound (``Capacity.has_room``) only gets full
  batches, so a worker under load always has its next batch waiting and the
  gateway never pays a worker call for a handful of rows. Low load pays no
  batching delay; high load gets large batches. Under a burst (requests that
  arrive to find every slot busy) a freed slot does not take the first few
  rows at once: the batch waits up to ``burst_hold_us`` from its oldest request
  for ``max_batch_size`` rows, while rows keep coming (it goes once none came
  for a quarter of the hold: a few closed-loop clients, all queued, wait that
  long at most). A burst arrives faster than the gateway can
  take it in, but not faster than a light model runs, so without the hold the
  slots free one by one and each takes the handful that came meanwhile (200
  single-row calls ran as 50-150 executions); with it the burst runs in
  batches of ``max_batch_size``, and a request waits the hold at most once.
  A hold also ends once as many requests of the model are queued or running
  as the most the previous second saw at once: closed-loop clients all in,
  who send no more until answered (not while this second has seen more than
  twice that many: a burst keeps its hold).
* ``fixed``, Triton's dynamic batcher: wait up to ``max_queue_delay_us`` from
  the oldest queued request for a preferred size (or ``max_batch_size`` when
  none is preferred), fire early when a preferred size can be formed. Like
  Triton, a batch may pass the largest preferred size by its last request,
  never ``max_batch_size``.
* ``off``: one request per dispatch. Models with ``max_batch_size == 0``
  always run this way.

Queue policies: a request is the batcher's until its batch is sent, so a
queue timeout (REJECT or DELAY) acts on it up to that moment. For a model
with queue timeouts (``BatchPolicy.has_queue_timeouts``) a batch is therefore
handed only to a replica that starts it at once -- an idle one
(``Capacity.has_capacity``), never a busy one's spare room, where it would
wait out of the policy's reach -- and its dispatch is told not to wait for a
slot either: if another model took the slot meanwhile, the dispatch raises
:class:`~gateway.batching.seams.NotSent` and the requests go back to their
places in the queue. Models without queue timeouts keep pipelining.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from typing import Any

from gateway.batching.held import HeldPeak
from gateway.batching.policy import DEFAULT_MAX_QUEUE_SIZE, BatchingMode, BatchPolicy, TimeoutAction
from gateway.batching.request_queue import Entry, EntryState, RequestQueue, earliest
from gateway.batching.seams import BatcherStats, Capacity, Clock, Dispatch, LoopClock, NotSent
from gateway.types import InferRequest, InferResponse, request_name
from protos.errors import DeadlineExceeded, InferGateError, Internal, Unavailable

__all__ = [  # BatchPolicy and its types are re-exported: callers import batching from here
    "DEFAULT_MAX_QUEUE_SIZE", "BatchPolicy", "Batcher", "BatchingMode", "TimeoutAction",
]

logger = logging.getLogger(__name__)


class Batcher:
    """One model's queue. ``submit`` resolves exactly once for every request."""

    def __init__(
        self, name: str, policy: BatchPolicy, dispatch: Dispatch, capacity: Capacity, *, clock: Clock | None = None
    ) -> None:
        self.name = name
        self.policy = policy
        self.stats = BatcherStats()
        self._dispatch = dispatch
        self._capacity = capacity
        room = getattr(capacity, "has_room", None)
        if policy.has_queue_timeouts:
            room = None  # only an idle replica: a busy one would hold the batch beyond the policy's reach
        self._has_room: Callable[[], bool] = room if callable(room) else capacity.has_capacity
        self._clock: Clock = clock or LoopClock()
        self._single = policy.max_batch_size == 0 or policy.mode == "off"
        self._adaptive = policy.mode == "adaptive" and not self._single
        self._preferred = frozenset(policy.preferred_batch_sizes)
        fixed_pref = policy.mode == "fixed" and policy.preferred_batch_sizes
        self._target_rows = policy.preferred_batch_sizes[-1] if fixed_pref else policy.max_batch_size
        # Queued and running entries, their timers and outcomes.
        self._queue = RequestQueue(name, policy, self.stats, key_of=self._key_of, on_done=self._check_idle)
        # Each running batch task and its entries: the task's `finally` answers them, and its
        # done-callback answers any left over (a task cancelled before it ever ran).
        self._inflight: dict[asyncio.Task[None], list[Entry]] = {}
        self._loop_task: asyncio.Task[None] | None = None
        self._accepting = False
        self._draining = False
        self._closed = False
        self._idle = asyncio.Event()
        # The scheduler's wait: one future, set by whatever may change its next move
        # (an arrival, a finished batch, capacity, a timer, close). Its state is looked
        # at afresh after every wait, so a wake-up while it is not waiting is not needed.
        self._waiter: asyncio.Future[None] | None = None
        # While it waits, an arrival wakes it only once the queue holds this many rows
        # (0: any arrival; inf: none -- only capacity can change its next move) or when it
        # brings a timer earlier than _blocked_until.
        self._wake_rows: float = 0
        self._blocked_until: float | None = None
        # Kept across waits while still useful: most waits end by an arrival or a batch's
        # end, and a task per wait for each would cost more than the batching saves.
        self._timer: asyncio.Future[None] | None = None
        self._timer_at = 0.0
        self._capacity_watch: asyncio.Future[None] | None = None
        self._seam_error: BaseException | None = None  # a failed Clock.sleep or Capacity.wait
        # Under a burst: a request arrived to find every slot busy, and the model has not
        # been idle (nothing queued, no batch running) since. The burst hold applies only then; low load never waits.
        self._hold_s = policy.burst_hold_us / 1e6 if self._adaptive else 0.0
        self._burst = False
        self._last_arrival = 0.0
        # The most requests held at once, a window back: a hold that has them all again ends.
        self._peak = HeldPeak()

    # ---- public API ----

    async def start(self) -> None:
        if self._closed:
            raise Unavailable(f"model '{self.name}' batcher is closed")
        if self._loop_task is None:
            self._accepting = True
            self._loop_task = asyncio.create_task(self._run(), name=f"batcher:{self.name}")
            self._loop_task.add_done_callback(self._loop_done)

    def queue_depth(self) -> int:
        return self._queue.count

    def inflight_batches(self) -> int:
        return len(self._inflight)

    async def submit(self, req: InferRequest) -> InferResponse:
        """Queue ``req`` and wait for its answer, which comes by ``req.deadline`` at the latest."""
        if not self._accepting:
            raise Unavailable(f"model '{self.name}' is not accepting requests")
        now = self._clock.now()
        if req.deadline is not None and req.deadline <= now:
            raise DeadlineExceeded(f"{request_name(req)} deadline passed before it was queued")
        entry = self._queue.admit(req, now)
        self._last_arrival = now
        self._peak.note(now, self._held())
        if self._hold_s and not self._burst and not self._capacity.has_capacity():
            self._burst = True
        self._wake_for(entry)
        try:
            return await entry.future
        except asyncio.CancelledError:
            # The caller went away. Still queued: leave now. Already in a batch: that batch
            # runs for the others and its result for this one is dropped.
            if entry.state is EntryState.QUEUED:
                self._queue.cancel(entry)
            raise

    async def close(self, grace_s: float = 0.0) -> None:
        """Stop accepting; dispatch what is queued within ``grace_s``; fail the rest with Unavailable."""
        if self._closed:
            return
        self._accepting = False
        self._draining = True
        self._poke()
        self._check_idle()
        if grace_s > 0 and not self._idle.is_set():
            waiters = [asyncio.ensure_future(self._idle.wait()), asyncio.ensure_future(self._clock.sleep(grace_s))]
            try:
                await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waiters:
                    w.cancel()
        self._closed = True
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        self._queue.fail_queued(Unavailable(f"model '{self.name}' is shutting down"))
        tasks = list(self._inflight)
        for t in tasks:
            t.cancel()  # their `finally` answers every request with Unavailable
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---- arrivals and idleness ----

    def _key_of(self, req: InferRequest) -> tuple[Any, ...]:
        if self._single:
            return ()
        inputs = tuple(sorted((t.name, t.datatype, tuple(t.shape[1:])) for t in req.inputs))
        return req.version, inputs, tuple(sorted(o.name for o in req.outputs))

    def _wake_for(self, entry: Entry) -> None:
        """Wake the waiting scheduler if this arrival may change its next move."""
        due = earliest(entry.req.deadline, entry.timeout_at)
        if self._waiter is not None and (
            self._queue.rows >= self._wake_rows
            or (due is not None and (self._blocked_until is None or due < self._blocked_until))
        ):
            self._poke()

    def _check_idle(self) -> None:
        if self._draining and self._queue.count == 0 and not self._inflight:
            self._idle.set()

    # ---- scheduling ----

    async def _run(self) -> None:
        try:
            while True:
                if self._seam_error is not None:
                    raise self._seam_error
                now = self._clock.now()
                self._queue.expire(now)
                if self._queue.count == 0:
                    self._burst = self._burst and bool(self._inflight)
                    next_timer = self._queue.next_timer()  # running entries' deadlines
                    await self._wait(next_timer, wake_rows=0, want_capacity=False)
                    continue
                batch, ready_at, wake_rows = self._next_batch(now)
                if batch:
                    self._launch(batch)
                    # Let the batch task run to its first suspension, where the router
                    # takes a replica slot, before capacity is asked again.
                    await asyncio.sleep(0)
                else:
                    next_timer = self._queue.next_timer()
                    await self._wait(earliest(ready_at, next_timer), wake_rows=wake_rows,
                                     want_capacity=ready_at is None)
        finally:
            for waiting in (self._timer, self._capacity_watch):
                if waiting is not None:
                    waiting.cancel()

    def _next_batch(self, now: float) -> tuple[list[Entry] | None, float | None, float]:
        """The batch to send now, or (None, when to look again, the queued rows that are worth a look)."""
        if self._adaptive and not self._draining:
            if self._capacity.has_capacity():  # a replica is idle: send what is queued
                hold_until = self._burst_hold(now)
                if hold_until is not None:
                    return None, hold_until, self._hold_wake_rows()
                batch = self._form(now)[0]
                if batch and not self._burst:
                    self.stats.at_once += 1
                return batch, None, 0
            # Every replica is busy. One with room still takes a full batch, so that
            # its next batch is already there when it finishes the current one.
            if self._queue.rows >= self._target_rows and self._has_room():
                batch = self._form(now, full_only=True)[0]
                if batch:
                    self.stats.pipelined += 1
                    return batch, None, 0
                return None, None, self._queue.rows + 1  # mixed keys: look again as rows arrive
            return None, None, self._target_rows
        if not self._has_room():
            return None, None, math.inf
        batch, ready_at = self._form(now)
        return batch, ready_at, 0

    def _held(self) -> int:
        """Requests of this model in the gateway now: queued, or in a batch not answered yet."""
        return self._queue.count + self._queue.running

    def _hold_wake_rows(self) -> float:
        """Queued rows at which an arrival may end a hold: the target, or fewer if they make every request here."""
        missing = self._peak.missing(self._held())
        return self._target_rows if missing is None else min(self._target_rows, self._queue.rows + max(1, missing))

    def _burst_hold(self, now: float) -> float | None:
        """Under a burst, until when a batch short of its target rows still waits for more (None: it goes)."""
        if not self._burst or self._queue.rows >= self._target_rows:
            return None
        held = self._held()
        self._peak.note(now, held)
        if self._peak.all_in(held):
            return None  # closed-loop clients all in: no more are coming (gateway.batching.held)
        first = next(self._queue.iter_queued(), None)  # the first served: the oldest of its level
        # Until the hold ends, or rows stop coming for a quarter of it (the batch stopped growing).
        until = min((first.enqueued_at if first is not None else now) + self._hold_s,
                    self._last_arrival + self._hold_s / 4)
        return until if now < until else None

    def _loop_done(self, task: asyncio.Task[None]) -> None:
        if self._closed:
            return
        # The scheduler ended on its own (a failing Capacity or Clock, a bug). Never leave
        # callers waiting on a dead loop: fail what is queued and stop accepting.
        error = None if task.cancelled() else task.exception()
        logger.error("model %s: batch scheduler stopped", self.name, exc_info=error)
        self._accepting = False
        self._queue.fail_queued(Internal.caused_by(f"in model '{self.name}''s batch scheduler", error))

    def _poke(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _seam_done(self, task: asyncio.Future[None]) -> None:
        if task.cancelled():
            return
        error = task.exception()
        if error is not None and self._seam_error is None:
            self._seam_error = error  # the scheduler raises it: a broken seam fails loudly
        self._poke()

    async def _wait(self, wake_at: float | None, *, wake_rows: float, want_capacity: bool) -> None:
        if wake_at is not None and (self._timer is None or self._timer.done() or wake_at < self._timer_at):
            # A timer already due earlier stays: waking early only means looking again.
            if self._timer is not None:
                self._timer.cancel()
            self._timer_at = wake_at
            self._timer = asyncio.ensure_future(self._clock.sleep(max(0.0, wake_at - self._clock.now())))
            self._timer.add_done_callback(self._seam_done)
        if want_capacity and (self._capacity_watch is None or self._capacity_watch.done()):
            self._capacity_watch = asyncio.ensure_future(self._capacity.wait())
            self._capacity_watch.add_done_callback(self._seam_done)
        self._wake_rows, self._blocked_until = wake_rows, wake_at
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _form(self, now: float, *, full_only: bool = False) -> tuple[list[Entry] | None, float | None]:
        """The next batch to send now, or (None, when to look again).

        ``full_only``: a batch only if it reaches the target rows (or cannot grow).
        """
        batch: list[Entry] = []
        gone: list[Entry] = []
        rows = best = 0
        full = False
        for entry in self._queue.iter_queued():
            if entry.future.done():  # cancelled, its submit() has not run its handler yet
                gone.append(entry)
                continue
            if batch:
                if entry.key != batch[0].key:
                    continue  # incompatible: stays queued for a later batch
                if rows + entry.rows > self.policy.max_batch_size:
                    full = True
                    break
            batch.append(entry)
            rows += entry.rows
            if self._single:
                break
            if rows in self._preferred:
                best = len(batch)
            if rows >= self._target_rows:
                full = True
                break
        for entry in gone:
            self._queue.cancel(entry)
        if not batch or (full_only and not full):
            return None, None
        if self.policy.mode == "fixed" and not self._single:
            if best:
                del batch[best:]
            elif not full and not self._draining:
                ready_at = batch[0].enqueued_at + self.policy.max_queue_delay_us / 1e6
                if now < ready_at:
                    return None, ready_at
        self._queue.take(batch)
        return batch, None

    def _launch(self, batch: list[Entry]) -> None:
        task = asyncio.create_task(self._run_batch(batch), name=f"batch:{self.name}")
        self._inflight[task] = batch
        task.add_done_callback(self._batch_done)

    def _batch_done(self, task: asyncio.Task[None]) -> None:
        batch = self._inflight.pop(task, [])
        if not task.cancelled() and task.exception() is not None:
            logger.error("model %s: batch task failed", self.name, exc_info=task.exception())
        if task.cancelled():
            leftover: InferGateError = Unavailable(f"model '{self.name}' is shutting down")
        else:
            leftover = Internal("internal error: the batch ended without a response")
        for entry in batch:
            self._queue.finish(entry, leftover)  # a no-op for entries already answered
        # A finished batch usually frees a replica slot: look at the queue again.
        self._poke()
        self._check_idle()

    async def _run_batch(self, batch: list[Entry]) -> None:
        now = self._clock.now()
        live: list[Entry] = []
        for entry in batch:  # drop what was cancelled or expired since the batch formed
            if entry.future.done():
                self._queue.finish(entry, None)
                self.stats.cancelled += 1
            elif entry.req.deadline is not None and entry.req.deadline <= now:
                self._queue.finish(entry, DeadlineExceeded(f"{request_name(entry.req)} deadline passed while queued"))
                self.stats.expired += 1
            else:
                live.append(entry)
        if not live:
            return
        self.stats.batches += 1
        self.stats.batched_requests += len(live)
        self.stats.batched_rows += sum(e.rows for e in live)
        error: BaseException | None = None
        try:
            try:
                responses = await self._dispatch([e.req for e in live])
            except NotSent:
                # Nothing left the gateway: back to the queue, under the queue policy again.
                self.stats.batches -= 1
                self.stats.batched_requests -= len(live)
                self.stats.batched_rows -= sum(e.rows for e in live)
                self.stats.requeued += 1
                self._queue.requeue(live)
                batch.clear()  # this task owns them no more (its done-callback reads this list)
                live = []
                return
            if len(responses) != len(live):
                logger.error("model %s: dispatch returned %d responses for %d requests (ids %s)",
                             self.name, len(responses), len(live), [e.req.id for e in live])
                raise Internal("internal error: the batch returned the wrong number of responses")
            for entry, response in zip(live, responses):
                self._queue.finish(entry, response)
        except asyncio.CancelledError:
            error = Unavailable(f"model '{self.name}' is shutting down")
            raise
        except InferGateError as exc:
            error = exc
        except Exception as exc:
            logger.exception("model %s: batch of %d request(s) failed (ids: %s)", self.name, len(live),
                             ", ".join(e.req.id for e in live if e.req.id) or "none")
            error = Internal.caused_by(f"running a batch of model '{self.name}'", exc)
        finally:
            if error is not None:
                self.stats.failed_batches += 1
            fallback = error or Internal("internal error: the batch ended without a response")
            for entry in live:
                self._queue.finish(entry, fallback)  # a no-op for entries already answered
