"""The attempts of one routed call: retries, second attempts beside hung or slow
ones, and exactly one answer.

:class:`AttemptRace` runs one call of the router. Its first attempt goes to
the replica the router picks. Then, while the call lives:

* an attempt that fails in a retryable way (:class:`AttemptFailed`: the worker
  answered UNAVAILABLE, its connection broke, it dropped the model) is retried
  on another replica after a jittered backoff, within ``retry_limit``, the
  retry budget and the deadline (``gateway.routing.retry_budget``); a busy
  refusal (a full queue) is retried only on a replica not tried yet, else its
  words (and retry hint) go back;
* an attempt the worker failed with INTERNAL is a *suspect*, charged to no
  one until one confirming attempt on another replica tells whether the
  failure is the worker's or the batch's (``gateway.routing.faults``).
  Request faults (any other final error) never count;
* an attempt silent past the model's hang threshold is reported to the
  outlier detector as a failure and a second attempt starts beside it on
  another replica; with hedging on, one also starts after the hedge delay
  (both thresholds: ``gateway.routing.hedging``).

The first answer wins and the attempts still running are cancelled (an
answer that lost the race is handed to ``discard``). Extra attempts each hold
a retry-budget token while they run. Inference is idempotent, so a batch run
twice is harmless; the call returns one response.

A stream's race is the same race with ``speculative=False``: its attempt
ends at the stream's first response, so retries, the budget and the outlier
verdicts apply alike, but nothing is hedged and no hang threshold runs (a
stream's first response may take any time a model needs, and a stream must
not run twice); its time to first response is no latency sample.

The first attempt runs inline in the caller's task, with a timer for its
thresholds: a call that needs no second attempt -- nearly all of them --
costs no task and no extra turn of the event loop. A second attempt runs as
a task; if it answers first, it cancels the caller's wait on the first
attempt (as ``asyncio.timeout`` does) and ``Task.uncancel`` tells that
cancellation from one coming from outside. Anything beyond that (a failed
first attempt) goes on in :meth:`AttemptRace._rest`, which waits on tasks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from gateway.routing.faults import SuspectFailures, Worker
from gateway.routing.hedging import AttemptPolicy
from protos.errors import DeadlineExceeded, InferGateError, Unavailable

log = logging.getLogger(__name__)

_W = TypeVar("_W", bound=Worker)  # the router's WorkerState
_R = TypeVar("_R")  # a response

# A hung attempt that found no free replica to go beside it looks again this often.
_RECHECK_S = 0.05


class AttemptFailed(Exception):
    """An attempt failed in a way another replica may not: the call may retry elsewhere.

    ``worker_fault`` is False when the failure says nothing about the worker's
    health (it dropped one model): the call retries, the worker's circuit is untouched.
    ``suspect`` marks a failure that is the worker's or the batch's (INTERNAL):
    one confirming attempt on another replica tells which. ``failover``: the
    replica left the model's rotation (it unloads the model, or its server is
    stopping), so the retry moves the batch off a replica that is going and is
    granted whatever the retry budget (each such failure takes its replica out).
    ``busy``: the replica refused for load (its queue is full).
    """

    def __init__(self, error: InferGateError, *, worker_fault: bool = True, suspect: bool = False,
                 failover: bool = False, busy: bool = False) -> None:
        super().__init__(str(error))
        self.error = error
        self.worker_fault = worker_fault and not suspect and not failover and not busy
        self.suspect = suspect
        self.failover = failover
        self.busy = busy  # a refusal for load: retried only on a replica not tried yet


@dataclass(slots=True, eq=False)
class _Attempt(Generic[_W]):
    worker: _W
    started: float
    extra: bool  # holds a budget token
    trial: bool  # a half-open trial of its worker's circuit (until its verdict is given)
    hedge_at: float | None
    hang_at: float | None
    hung: bool = False
    settled: bool = False
    load: float = 0.0  # the executions it waits out on its worker before its own (outlier judging)
    beside: int = 0  # the other attempts running in the gateway when it started (outlier judging)


class AttemptRace(Generic[_W, _R]):
    """One routed call. Build one per call and ``await run()``.

    ``acquire(avoid)`` waits (within the deadline) for a replica with a free
    slot, preferring ones not in ``avoid``; ``try_pick(avoid)`` returns one
    outside ``avoid`` at once, or None; ``send(worker)`` makes one attempt,
    raising ``AttemptFailed`` for retryable failures and any other
    ``InferGateError`` for final ones. ``speculative=False`` (a stream): no
    hedges, no hang threshold, no latency samples; ``discard(response)``
    releases an answer that lost the race.
    """

    def __init__(
        self,
        policy: AttemptPolicy,
        model: str,
        deadline: float | None,
        *,
        acquire: Callable[[set[_W]], Awaitable[_W]],
        try_pick: Callable[[set[_W]], _W | None],
        send: Callable[[_W], Awaitable[_R]],
        rows: int = 1,
        speculative: bool = True,
        discard: Callable[[_R], Awaitable[None]] | None = None,
    ) -> None:
        self._policy = policy
        self._rows = rows  # the batch's rows: latencies are judged at the same batch size
        self._model = model
        self._deadline = deadline
        self._acquire = acquire
        self._try_pick = try_pick
        self._send = send
        self._speculative = speculative
        self._discard = discard
        self._pending: dict[asyncio.Task[_R], _Attempt[_W]] = {}
        self._tried: set[_W] = set()
        self._failures = 0
        self._last_failed: _W | None = None
        self._last_error: InferGateError | None = None
        self._last_failover = False
        self._last_busy = False
        # Suspect failures (INTERNAL) awaiting their confirming attempt.
        self._suspects: SuspectFailures[_W] = SuspectFailures(model, policy.outliers)
        # While the first attempt runs inline: it, the caller's task, its timer, and a winner.
        self._inline: _Attempt[_W] | None = None
        self._caller: asyncio.Task[object] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._winner: _R | None = None
        self._won = False
        self._give_up_inline = False

    async def run(self, first: _W | None = None) -> _R:
        """The call's one answer; ``first``: the replica of the first attempt, when the router picked it already."""
        budget = self._policy.budget
        budget.call_started()
        try:
            worker = first if first is not None else await self._acquire(self._tried)
            answered, response = await self._first(worker)
            if answered:
                return response  # type: ignore[return-value]
            return await self._rest()
        finally:
            if self._pending:
                await self._cancel_pending()
            budget.call_finished()

    # ---- the first attempt, inline ------------------------------------------------

    async def _first(self, worker: _W) -> tuple[bool, _R | None]:
        attempt = self._attempt(worker, extra=False)
        self._caller = asyncio.current_task()
        self._inline = attempt
        self._arm()
        try:
            response = await self._send(worker)
        except asyncio.CancelledError:
            # Ours when a second attempt answered first, or failed beside a hung
            # first one; uncancel() says whether a cancellation from outside
            # came too (then it goes on up).
            ours = self._won or self._give_up_inline
            self._give_verdict(attempt, None, cancelled=True)
            if ours and self._caller is not None and self._caller.uncancel() == 0:
                return (True, self._winner) if self._won else (False, None)
            raise
        except AttemptFailed as error:
            self._give_verdict(attempt, error)
            return False, None
        except InferGateError as error:
            self._give_verdict(attempt, error)
            raise
        finally:
            self._inline = None
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
        self._give_verdict(attempt, None)
        return True, response

    def _arm(self) -> None:
        inline = self._inline
        times = [t for a in self._pending.values() for t in (a.hedge_at, a.hang_at) if t is not None]
        if inline is not None:
            times += [t for t in (inline.hedge_at, inline.hang_at) if t is not None]
        if times:
            delay = max(0.0, min(times) - self._policy.clock.now())
            self._timer = asyncio.get_running_loop().call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        if self._inline is None:
            return
        self._speculate([a for a in (self._inline, *self._pending.values()) if a is not None])
        self._arm()

    def _on_extra_done(self, task: asyncio.Task[_R]) -> None:
        """A second attempt ended while the first still runs inline.

        If it answered, it wins. If it failed and the first one hangs, nothing
        live is left: stop waiting on the hung one and go on to retry.
        Other failures are settled with the pending attempts later.
        """
        inline = self._inline
        if inline is None or self._won or self._give_up_inline or task.cancelled() or self._caller is None:
            return
        if task.exception() is None:
            attempt = self._pending.pop(task)
            self._winner = task.result()
            self._won = True
            self._give_verdict(attempt, None)
            self._caller.cancel()
        elif inline.hung and all(a.hung or t.done() for t, a in self._pending.items()):
            self._give_up_inline = True
            self._caller.cancel()

    # ---- after a failed first attempt ----------------------------------------------

    async def _rest(self) -> _R:
        if not self._pending:
            await self._retry()
        while True:
            wake_at = self._next_wake()
            timeout = None if wake_at is None else max(0.0, wake_at - self._policy.clock.now())
            done, _ = await asyncio.wait(self._pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                self._speculate(list(self._pending.values()))
                continue
            for task in done:
                attempt = self._pending.pop(task)
                error = AttemptFailed(Unavailable("the attempt was cancelled")) if task.cancelled() else task.exception()
                self._give_verdict(attempt, error)
                if error is None:
                    return task.result()
                if isinstance(error, DeadlineExceeded):
                    raise DeadlineExceeded(f"deadline exceeded for model '{self._model}' after "
                                           f"{self._failures} failed attempts") from None
                if not isinstance(error, AttemptFailed):
                    raise error
                if error.suspect and self._suspects.confirmed:
                    raise self._suspects.verdict()
            # Attempts that hung are not waited on: with no other left, retry beside them.
            if all(a.hung for a in self._pending.values()):
                await self._retry()

    async def _retry(self) -> None:
        """Every live attempt failed: start another after a backoff, or give up."""
        policy, model, failures = self._policy, self._model, self._failures
        worker, error = self._last_failed, self._last_error
        where = getattr(worker, "address", "?")
        if self._suspects and failures > policy.retry_limit:
            raise self._suspects.cause
        if failures > policy.retry_limit:
            log.warning("model %s: giving up after %d attempts, last on %s: %s", model, failures, where, error)
            raise Unavailable(f"no replica of model '{model}' could serve the request ({failures} attempts); "
                              f"the last answered: {error}")
        if not policy.budget.try_acquire(failover=self._last_failover):
            if self._suspects:  # no confirming attempt: the cause goes back, no one is charged
                raise self._suspects.cause
            if self._last_busy and error is not None:  # a refusal for load: its words and retry hint go back
                raise error
            log.warning("model %s: retry budget spent (%d extra attempts in flight); not retrying after: %s",
                        model, policy.budget.counters().extra_inflight, error)
            raise Unavailable(f"no replica of model '{model}' could serve the request; retries are "
                              "limited while many requests fail")
        try:
            delay_s = policy.backoff.delay_s(failures)
            if self._deadline is not None and self._deadline - policy.clock.now() <= delay_s:
                log.info("model %s: deadline leaves no time to retry after: %s", model, error)
                raise DeadlineExceeded(f"deadline exceeded for model '{model}' after {failures} failed attempts")
            if worker is not None:
                worker.retries += 1  # type: ignore[attr-defined]
            log.info("model %s: retrying batch after failure on %s: %s", model, where, error)
            await policy.clock.sleep(delay_s)
            replica = await self._acquire(self._tried | {a.worker for a in self._pending.values()})
            if self._suspects and replica in self._tried:
                # No other replica to confirm on: answer the failure with its cause, charge no one.
                raise self._suspects.cause
            if self._last_busy and replica in self._tried and error is not None:
                # Every replica refused for load: its words and retry hint go back, not a retry into the queue.
                raise error
            if self._deadline is not None and policy.clock.now() >= self._deadline:
                raise DeadlineExceeded(f"deadline exceeded for model '{model}' after {failures} failed attempts")
        except BaseException:
            policy.budget.release()
            raise
        self._launch(replica)

    # ---- bookkeeping -----------------------------------------------------------------

    def _attempt(self, worker: _W, *, extra: bool) -> _Attempt[_W]:
        policy, now = self._policy, self._policy.clock.now()
        trial = policy.outliers.attempt_started(worker.address)
        hang, hedge = policy.thresholds(self._model) if self._speculative else (None, None)
        if hedge is not None and len(self._pending) + (self._inline is not None) >= policy.hedge.max_extra_attempts:
            hedge = None  # no hedge of a hedge
        beside = policy.attempts_running
        policy.attempts_running += 1
        return _Attempt(worker, now, extra, trial, None if hedge is None else now + hedge,
                        None if hang is None else now + hang, load=self._load_on(worker), beside=beside)

    def _load_on(self, worker: _W) -> float:
        """The executions an attempt starting now waits out on ``worker`` before its own starts: the
        batches there (every model's; this one's send has not taken its slot yet) beyond the model's
        execution slots, per slot. A waiting batch behind one slot waits a whole execution, behind
        four a quarter of one on average."""
        served = getattr(worker, "models", {}).get(self._model)
        slots = max(1, getattr(served, "slots", 1))
        return max(0, getattr(worker, "inflight", 0) + 1 - slots) / slots

    def _launch(self, worker: _W) -> None:
        """Start an extra attempt as a task (its budget token is already taken)."""
        attempt = self._attempt(worker, extra=True)
        task = asyncio.ensure_future(self._send(worker))
        self._pending[task] = attempt
        task.add_done_callback(self._on_extra_done)

    def _give_verdict(self, attempt: _Attempt[_W], error: BaseException | None, *, cancelled: bool = False) -> None:
        """Tell the outlier detector (and the budget) how an attempt ended; once per attempt."""
        if attempt.settled:
            return
        attempt.settled = True
        policy = self._policy
        policy.attempts_running -= 1
        if attempt.extra:
            policy.budget.release()
        address = attempt.worker.address
        elapsed = policy.clock.now() - attempt.started
        if cancelled or (attempt.hung and error is None):
            # No verdict: lost the race, or its caller left; its time is still a lower bound.
            policy.outliers.abandoned(address, self._model, elapsed, attempt.trial, queued=attempt.load, rows=self._rows,
                                      beside=attempt.beside)
        elif error is None:
            latency_s = elapsed if self._speculative else None  # a stream's first response: no sample
            policy.outliers.succeeded(address, self._model, latency_s, attempt.trial, queued=attempt.load,
                                      rows=self._rows, beside=attempt.beside)
            if latency_s is not None:
                policy.latency.observe(self._model, latency_s)
            self._suspects.served_by(attempt.worker)
        elif isinstance(error, AttemptFailed):
            if error.worker_fault:
                policy.outliers.failed(address, str(error.error), attempt.trial)
            else:
                policy.outliers.abandoned(address, self._model, elapsed, attempt.trial)
            self._failures += 1
            self._tried.add(attempt.worker)
            self._last_failed, self._last_error, self._last_failover = attempt.worker, error.error, error.failover
            self._last_busy = error.busy
            if error.suspect:
                self._suspects.add(attempt.worker, error.error)
        else:  # the request's own fault or its deadline: says nothing about the worker
            policy.outliers.abandoned(address, self._model, elapsed, attempt.trial)

    def _next_wake(self) -> float | None:
        times = [t for a in self._pending.values() for t in (a.hedge_at, a.hang_at) if t is not None]
        return min(times) if times else None

    def _speculate(self, attempts: list[_Attempt[_W]]) -> None:
        """Timers ran out: report hung attempts, and start one beside them when allowed."""
        policy = self._policy
        now = policy.clock.now()
        due: list[_Attempt[_W]] = []
        for attempt in attempts:
            fired = False
            if attempt.hang_at is not None and now >= attempt.hang_at:
                attempt.hang_at = None
                attempt.hung = True
                self._tried.add(attempt.worker)  # a retry of this call goes elsewhere
                policy.outliers.failed(attempt.worker.address, f"no answer after {now - attempt.started:.2f}s",
                                       attempt.trial)
                attempt.trial = False
                fired = True
            if attempt.hedge_at is not None and now >= attempt.hedge_at:
                attempt.hedge_at = None
                fired = True
            if fired:
                due.append(attempt)
        if not due or len(attempts) > policy.hedge.max_extra_attempts:
            return
        busy = {a.worker for a in attempts} | self._tried
        worker = self._try_pick(busy)
        if worker is not None and policy.budget.try_acquire():
            oldest = min(a.started for a in attempts)
            log.info("model %s: second attempt on %s beside one running for %.3fs",
                     self._model, worker.address, now - oldest)
            self._launch(worker)
            return
        # No replica free, or no budget: a hung attempt looks again shortly; a plain hedge gives up.
        for attempt in due:
            if attempt.hung:
                attempt.hedge_at = now + _RECHECK_S

    async def _cancel_pending(self) -> None:
        pending, self._pending = self._pending, {}
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for task, attempt in pending.items():
            if task.cancelled():
                self._give_verdict(attempt, None, cancelled=True)
            else:
                error = task.exception()
                self._give_verdict(attempt, error, cancelled=error is None)
                if error is None and self._discard is not None:
                    await self._discard(task.result())
