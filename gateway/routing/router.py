"""The router: sends each batch, and each streamed request, to one healthy replica of its model.

One path for both (as Ray Serve's router assigns streaming and unary
requests alike): the same replica choice, the same race of attempts
(``gateway.routing.attempts``), one retry rule (retry only before the first
response: a batch has one, a stream's first opens it), one retry budget and
one outlier detector. A try on the chosen replica, and the judgement of its
failure, is ``gateway.routing.tries``'; a stream is not hedged
(``Router.stream``).

Choice: the candidates are the READY replicas below their in-flight bound
(``gateway.routing.capacity``: the bounds, and the per-model
:class:`~gateway.routing.capacity.ModelCapacity` the batcher holds batches
back on); the router's :class:`~gateway.routing.choice.ReplicaChooser`
picks one (by default the least loaded). When no candidate can take the
batch the call waits, within the deadline, for a slot.

Failures: ``Unavailable`` answers and transport failures are retried -- the
whole batch, on a replica not tried yet when there is one -- after a small
jittered backoff, at most ``retry_limit`` times and never past the deadline.
A worker whose connection failed is marked DOWN at once; the cluster's probe
brings it back. A worker that refuses because its queue is full
(``WorkerBusy``) is retried elsewhere too, but is not charged a failure. ``ModelNotFound`` or ``ModelNotReady`` from a replica the
model map lists means that replica dropped the model (unloaded, or a Triton
server shutting down, which unloads before it exits): it leaves the model's
rotation and the batch goes to another replica, or, with none left, the error
goes back unchanged. INTERNAL is a suspect: the worker's fault or the
batch's, told apart by one confirming attempt on another replica (see
``gateway.routing.attempts``). Any other error is the request's own and
passes through unchanged, charged to no worker. Inference is
idempotent, so a retry never answers a request twice, and the caller answers
each request exactly once.

Fault handling beyond that lives in modules of its own: each call's attempts
(retries, hedges, hang detection) run in ``gateway.routing.attempts.AttemptRace``;
extra attempts are bounded by ``gateway.routing.retry_budget`` and spaced by its
jittered backoff; the outcome of every attempt feeds the per-worker circuits
of ``gateway.routing.outlier``, and replicas whose circuit is open are skipped here --
unless every replica of the model is (panic mode: ejection only ever chooses
among replicas).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import aclosing, contextmanager
from typing import Any, TypeVar

from tritonclient.grpc import service_pb2

from gateway.batching.seams import Clock, LoopClock, NotSent
from gateway.fleet.cluster import Cluster, WorkerState, WorkerStatus
from gateway.replicas.replica import StreamItem
from gateway.routing.attempts import AttemptFailed, AttemptRace
from gateway.routing.capacity import InflightBounds, ModelCapacity, WorkerCounters
from gateway.routing.choice import LeastLoaded, ReplicaChooser
from gateway.routing.hedging import AttemptPolicy, LatencyTracker
from gateway.routing.light import RowCosts
from gateway.routing.outlier import OutlierDetector
from gateway.routing.outlier_trials import ReturnTrials
from gateway.routing.resume import Resumes
from gateway.routing.retry_budget import Backoff, RetryBudget
from gateway.routing.tries import MAX_CALL_TIMEOUT_S, OpenStream, Tries, rows_of
from gateway.settings import HedgeSettings
from protos.errors import DeadlineExceeded, Unavailable

log = logging.getLogger(__name__)

__all__ = ["MAX_CALL_TIMEOUT_S", "Router"]

_R = TypeVar("_R")


class Router:
    """Sends batches to replicas: candidates, the chooser's pick, attempts, and the counters around them.

    ``chooser`` is the replica choice policy (default :class:`LeastLoaded`,
    on ``rng``); the in-flight bounds (``InflightBounds``) come from the
    ``*_inflight_per_replica``, ``per_model`` and ``row_costs`` arguments.
    """

    def __init__(
        self,
        cluster: Cluster,
        *,
        max_inflight_per_replica: int = 0,
        busy_inflight_per_replica: int = 0,
        retry_limit: int = 3,
        retry_backoff_s: float = 0.025,
        retry_backoff_max_s: float = 0.25,
        clock: Clock | None = None,
        rng: random.Random | None = None,
        retry_budget: RetryBudget | None = None,
        outliers: OutlierDetector | None = None,
        hedging: HedgeSettings | None = None,
        per_model: Mapping[str, Mapping[str, Any]] | None = None,
        row_costs: RowCosts | None = None,
        chooser: ReplicaChooser | None = None,
        prefix_affinity: Any = None,
    ) -> None:
        self.cluster = cluster
        # The chooser's prefix routes where it keeps them (gateway.routing.prefix), read by /metrics.
        self.prefix_affinity = prefix_affinity
        self._clock: Clock = clock or LoopClock()
        self._rng = rng or random.Random()
        self.retry_budget = retry_budget or RetryBudget()
        self.outliers = outliers or OutlierDetector(clock=self._clock.now)
        self.latency = LatencyTracker()
        # 0 = derived per replica and model from its execution slots; the light-model rule is off unless given.
        self.bounds = InflightBounds(self.outliers, max_inflight_per_replica=max_inflight_per_replica,
                                     busy_inflight_per_replica=busy_inflight_per_replica,
                                     per_model=per_model, row_costs=row_costs)
        self.chooser: ReplicaChooser = chooser or LeastLoaded(self._rng)
        backoff = Backoff(retry_backoff_s, max(retry_backoff_s, retry_backoff_max_s), self._rng)
        self.attempts = AttemptPolicy(self.outliers, self.retry_budget, backoff, self.latency,
                                      hedging or HedgeSettings(), retry_limit, self._clock)
        self.tries = Tries(cluster, self.bounds, self.outliers, self._clock, self._slot_freed)
        self.resumes = Resumes(self.attempts)
        # model -> version -> capacity; "" is the model's any-version capacity.
        self._capacities: dict[str, dict[str, ModelCapacity]] = {}
        # Replicas going up or down change every model's capacity (and reset a returning worker's circuit).
        self._unsubscribe: Callable[[], None] = cluster.on_change(self._cluster_changed)
        self.outliers.sync((w.address, w.is_up) for w in cluster.workers())
        # An ejected worker is tried again when its ejection runs out, traffic or not.
        self.return_trials = ReturnTrials(self.outliers, self._return_probe)
        self.outliers.on_eject = self.return_trials.ejected

    @property
    def row_costs(self) -> RowCosts:
        return self.bounds.row_costs

    @row_costs.setter
    def row_costs(self, row_costs: RowCosts) -> None:
        self.bounds.row_costs = row_costs

    def limits(self, worker: WorkerState, model: str) -> tuple[int, int]:
        """(busy, max) batches of ``model`` in flight on ``worker``: ``InflightBounds.limits``."""
        return self.bounds.limits(worker, model)

    def close(self) -> None:
        self._unsubscribe()
        self._wake_all()
        self.outliers.on_eject = None
        self.return_trials.cancel()

    async def _return_probe(self, address: str, model: str) -> bool:
        worker = next((w for w in self.cluster.workers() if w.address == address), None)
        if worker is None:
            return False
        return await (worker.client.model_ready(model) if model else worker.client.server_ready())

    def capacity(self, model: str, version: str = "") -> ModelCapacity:
        by_version = self._capacities.setdefault(model, {})
        cap = by_version.get(version)
        if cap is None:
            cap = by_version[version] = ModelCapacity(self.cluster, self.bounds, model, version)
        return cap

    def worker_stats(self) -> list[WorkerCounters]:
        return [
            WorkerCounters(w.address, w.state.name, w.inflight, w.sent, w.failures, w.retries,
                           self.outliers.state(w.address).name)
            for w in self.cluster.workers()
        ]

    async def infer(
        self, model: str, version: str, request: service_pb2.ModelInferRequest, deadline: float | None,
        *, wait_for_slot: bool = True,
    ) -> service_pb2.ModelInferResponse:
        """Send ``request`` to a replica of ``model``; retries, hedges and hangs: ``gateway.routing.attempts``.

        ``deadline`` is absolute, on the event loop's clock; None means none.
        ``wait_for_slot=False``: when no replica can start it at once (a free
        execution slot), raise ``NotSent`` instead of waiting
        for a slot -- the batcher keeps its requests under their queue policy.
        """
        tries = self.tries
        return await self._race(
            model, version, deadline, rows_of(request), wait_for_slot,
            lambda worker, slot_taken: tries.infer(worker, model, version, request, deadline, slot_taken))

    async def relay(self, model: str, version: str, data: bytes, rows: int, deadline: float | None) -> bytes:
        """A call's bytes to a replica of ``model``, its answer's bytes back (the relay lane, ``gateway.core.relay``):
        the same choice and race as a batch's (retries before the answer, hedges, hangs, outlier verdicts)."""
        tries = self.tries
        return await self._race(
            model, version, deadline, rows, True,
            lambda worker, slot_taken: tries.relay(worker, model, version, data, rows, deadline, slot_taken))

    async def _race(
        self, model: str, version: str, deadline: float | None, rows: int, wait_for_slot: bool,
        send: Callable[[WorkerState, Callable[[], None]], Awaitable[_R]],
    ) -> _R:
        """One call's race: the first replica, then ``send(worker, slot_taken)`` per attempt (``AttemptRace``)."""
        first: WorkerState | None = None
        if not wait_for_slot:
            replicas = self.cluster.healthy(model, version)
            if replicas:  # none at all: the race below fails fast with Unavailable
                first = self._pick(replicas, model, set(), busy=True, version=version)
                if first is None:
                    raise NotSent(f"no replica of model '{model}' can start a batch now")
        capacity = self.capacity(model, version)
        capacity.starting += 1
        starting = True

        def slot_taken() -> None:
            nonlocal starting
            if starting:
                starting = False
                capacity.starting -= 1

        race: AttemptRace[WorkerState, _R] = AttemptRace(
            self.attempts, model, deadline,
            acquire=lambda avoid: self._acquire(model, version, deadline, avoid),
            try_pick=lambda avoid: self._try_pick(model, version, avoid),
            send=lambda worker: send(worker, slot_taken),
            rows=rows,
        )
        try:
            # The first replica is chosen here, with no await between a pick above and its send.
            return await race.run(first or await self._acquire(model, version, deadline, set()))
        finally:
            slot_taken()

    async def stream(
        self, model: str, version: str, request: service_pb2.ModelInferRequest, deadline: float | None,
    ) -> AsyncIterator[StreamItem]:
        """Each response of a streamed request with its arrival time, the last one final; close it when done.

        The race runs until a replica sends the first response (retried, budgeted
        and judged as a batch's attempts are, never hedged); the rest comes from
        that replica, which holds a slot until the stream ends. A generation
        whose replica is lost goes on on another (``gateway.routing.resume``).
        """
        info = self.cluster.model(model)
        generation = self.resumes.generation(info.config if info is not None else None, request)
        opened = await self._open_stream(model, version, request, set(), deadline)
        if generation is not None:
            reopen = functools.partial(self._open_stream, model, version, deadline=deadline)
            responses = self.resumes.responses(model, generation, opened, reopen, deadline)
            async with aclosing(responses):
                async for item in responses:
                    yield item
            return
        try:
            yield opened.first
            async for item in opened.rest():
                yield item
        finally:
            await opened.close()

    async def _open_stream(self, model: str, version: str, request: service_pb2.ModelInferRequest,
                           avoid: set[WorkerState], deadline: float | None) -> OpenStream:  # fmt: skip
        """A stream's race, up to its first response, on a replica outside ``avoid`` (those a resumed
        generation lost: never tried again by it)."""
        tries = self.tries

        async def send(worker: WorkerState) -> OpenStream:
            if worker in avoid:
                raise Unavailable(f"no replica of model '{model}' is left that this stream has not tried")
            return await tries.open_stream(worker, model, version, request, deadline)

        race: AttemptRace[WorkerState, OpenStream] = AttemptRace(
            self.attempts, model, deadline,
            acquire=lambda tried: self._acquire(model, version, deadline, tried | avoid),
            try_pick=lambda tried: None,
            send=send,
            speculative=False,
            discard=OpenStream.close,
        )
        return await race.run(await self._acquire(model, version, deadline, set(avoid)))

    async def acquire(self, model: str, version: str, deadline: float | None,
                      avoid: set[WorkerState] | None = None) -> WorkerState:
        """A replica for a new stateful sequence: the chooser's pick among those with a free slot
        (waits within the deadline); one outside ``avoid`` while any is healthy."""
        return await self._acquire(model, version, deadline, set(avoid) if avoid else set())

    async def send_to(
        self, worker: WorkerState, model: str, version: str, request: service_pb2.ModelInferRequest,
        deadline: float | None,
    ) -> service_pb2.ModelInferResponse:
        """``request`` on ``worker`` and nowhere else (a sequence's state lives there): no retry, no hedge."""
        try:
            return await self.tries.infer(worker, model, version, request, deadline)
        except AttemptFailed as e:
            raise e.error from None

    async def relay_to(self, worker: WorkerState, model: str, version: str, data: bytes, rows: int,
                       deadline: float | None) -> bytes:
        """A relayed call on ``worker`` and nowhere else (a sequence's): no retry, no hedge (as ``send_to``)."""
        try:
            return await self.tries.relay(worker, model, version, data, rows, deadline)
        except AttemptFailed as e:
            raise e.error from None

    def _remaining(self, deadline: float | None) -> float | None:
        return None if deadline is None else deadline - self._clock.now()

    def remaining(self, deadline: float | None) -> float | None:
        """Seconds left until ``deadline`` on the router's clock (None: no deadline)."""
        return self._remaining(deadline)

    async def _acquire(
        self, model: str, version: str, deadline: float | None, tried: set[WorkerState]
    ) -> WorkerState:
        """A replica with a free slot, waiting (within the deadline) while all are full.

        Waiting calls are served in arrival order: a call that finds others
        waiting joins the back of the line instead of taking a slot freed
        for the one in front of it, and only the head of the line takes one.
        A retry (``tried`` not empty) waits beside the line, not in it: it
        may wait for a replica not tried yet while another has a free slot,
        and must not hold back the calls behind it meanwhile.
        """
        capacity = self.capacity(model, version)
        if not capacity.line or tried:
            worker = self._pick_healthy(model, version, tried)
            if worker is not None:
                return worker
        turn = capacity.join_line() if not tried else None
        try:
            if turn is None:
                return await self._wait_beside(capacity, model, version, deadline, tried)
            while True:
                remaining = self._remaining(deadline)
                if remaining is not None and remaining <= 0:
                    raise DeadlineExceeded(f"deadline exceeded waiting for a free replica of model '{model}'")
                if not turn.done():  # others are ahead: wait to be the head
                    waiter = turn
                else:
                    worker = self._pick_healthy(model, version, tried)
                    if worker is not None:
                        return worker
                    waiter = capacity.register()
                try:
                    await asyncio.wait_for(asyncio.shield(waiter), remaining)
                except asyncio.TimeoutError:
                    raise DeadlineExceeded(
                        f"deadline exceeded waiting for a free replica of model '{model}'") from None
                finally:
                    if waiter is not turn:
                        capacity.forget(waiter)
        finally:
            if turn is not None:
                capacity.leave_line(turn)

    async def _wait_beside(self, capacity: ModelCapacity, model: str, version: str, deadline: float | None,
                           tried: set[WorkerState]) -> WorkerState:
        """A retry's wait for a slot: woken with every freed slot, whatever the line."""
        while True:
            remaining = self._remaining(deadline)
            if remaining is not None and remaining <= 0:
                raise DeadlineExceeded(f"deadline exceeded waiting for a free replica of model '{model}'")
            waiter = capacity.register()
            try:
                await asyncio.wait_for(waiter, remaining)
            except asyncio.TimeoutError:
                raise DeadlineExceeded(f"deadline exceeded waiting for a free replica of model '{model}'") from None
            finally:
                capacity.forget(waiter)
            worker = self._pick_healthy(model, version, tried)
            if worker is not None:
                return worker

    def _pick_healthy(self, model: str, version: str, tried: set[WorkerState]) -> WorkerState | None:
        replicas = self.cluster.healthy(model, version)
        if not replicas:
            which = f"model '{model}' version {version}" if version else f"model '{model}'"
            raise Unavailable(f"no healthy replica of {which}")
        return self._pick(replicas, model, tried, version=version)

    # ---- candidates: the chooser picks among them --------------------------

    def _try_pick(self, model: str, version: str, avoid: set[WorkerState]) -> WorkerState | None:
        """A replica outside ``avoid`` with a free slot and a closed circuit, now or None (second attempts)."""
        pool = [w for w in self.cluster.healthy(model, version) if w not in avoid]
        candidates = self.bounds.below(self.bounds.usable(pool), model)
        return self.chooser.choose(model, version, candidates, avoid, self.bounds) if candidates else None

    def _pick(
        self, replicas: Sequence[WorkerState], model: str, tried: set[WorkerState], *, busy: bool = False,
        version: str = "",
    ) -> WorkerState | None:
        # A retry goes to a replica not tried yet while one is healthy, even if
        # it has to wait for its slot; tried ones are reused only when none is left.
        # Ejected replicas are skipped while any other can serve; with every
        # replica ejected, all of them serve again (panic mode).
        untried = [w for w in replicas if w not in tried] if tried else replicas
        usable = (
            self.bounds.usable(untried)
            or (self.bounds.usable(replicas) if tried else [])
            or [w for w in replicas if w.state is WorkerStatus.READY]
        )
        # busy: only a replica with a free execution slot (the batch starts at once).
        candidates = self.bounds.below(usable, model, busy=busy)
        if not candidates:
            return None
        return self.chooser.choose(model, version, candidates, tried, self.bounds)

    # ---- wake-ups ----------------------------------------------------------

    def _slot_freed(self, worker: WorkerState) -> None:
        for name in worker.models:
            for cap in self._capacities.get(name, {}).values():
                if cap.waiting:
                    cap.wake()

    def _cluster_changed(self) -> None:
        self.outliers.sync((w.address, w.is_up) for w in self.cluster.workers())
        self._wake_all()

    def _wake_all(self) -> None:
        for by_version in self._capacities.values():
            for cap in by_version.values():
                cap.wake()
