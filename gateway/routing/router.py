"""The router: sends each batch to one healthy replica of its model.

Choice: least outstanding batches among the READY replicas below their
in-flight bound (with more than a handful of candidates, the better of two
random ones: power of two choices). When every replica is at its bound the
call waits, within the deadline, for a slot; the per-model
:class:`ModelCapacity` tells the batcher when to hold batches back instead:
a replica is *idle* while it has a free execution slot (adaptive batching
sends at once only then) and has *room* up to one batch more than that (the
waiting batch that hides the round trip; a busy replica still takes a full
one). A replica's slots for a model are what its served config states
(``WorkerModel.slots``: instances, or our worker's stated execution count);
``busy_inflight_per_replica`` and ``max_inflight_per_replica`` fix the two
bounds instead when set (0 = derived from the slots). A light model (little
worker time per row, ``gateway.routing.light``) is busy at one batch: its
requests batch up behind it instead of splitting over the slots; a heavy
one only once its waiting batch is on the worker too.

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
import logging
import random
from typing import Any
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from tritonclient.grpc import service_pb2

from gateway.batching.seams import Clock, LoopClock, NotSent
from gateway.fleet.cluster import Cluster, WorkerState, WorkerStatus
from gateway.fleet.worker_client import ModelNotReady, WorkerBusy, WorkerUnreachable
from gateway.routing.attempts import AttemptFailed, AttemptRace
from gateway.routing.hedging import AttemptPolicy, LatencyTracker
from gateway.routing.light import RowCosts
from gateway.routing.outlier import OutlierDetector
from gateway.routing.retry_budget import Backoff, RetryBudget
from gateway.settings import HedgeSettings
from protos import wire
from protos.errors import DeadlineExceeded, InferGateError, Internal, ModelNotFound, Unavailable

log = logging.getLogger(__name__)

# Above this many candidates, sample two instead of scanning (power of two choices).
P2C_THRESHOLD = 4
# The longest timeout one worker call is given; the request's own deadline still holds.
MAX_CALL_TIMEOUT_S = 86_400.0


@dataclass(frozen=True, slots=True)
class WorkerCounters:
    """A snapshot of one worker's routing counters (for metrics and the dashboard)."""

    address: str
    state: str
    inflight: int
    sent: int
    failures: int
    retries: int
    circuit: str = "CLOSED"  # gateway.routing.outlier: CLOSED, OPEN (ejected) or HALF_OPEN


class ModelCapacity:
    """Whether a batch of one model could be sent now (implements ``gateway.batching.seams.Capacity``).

    With no healthy replica at all it reports capacity, so queued requests
    are dispatched and fail fast with ``Unavailable`` instead of waiting out
    their deadlines for a worker that may never come.
    """

    def __init__(self, router: Router, model: str, version: str) -> None:
        self._router = router
        self.model = model
        self.version = version
        self._waiters: set[asyncio.Future[None]] = set()
        # Calls of this model routed but not holding a replica slot yet (waiting for one,
        # or about to take one): a slot such a call takes next must not look free to the
        # batcher, or it would send another batch after it.
        self.starting = 0

    def has_capacity(self) -> bool:
        """Some replica has a free execution slot: a batch sent now starts at once."""
        replicas = self._router.cluster.healthy(self.model, self.version)
        if not replicas:
            return True
        return self._router._free_slots(replicas, self.model, busy=True) > self.starting

    def has_room(self) -> bool:
        """Some replica can take one more batch now (its slots plus one waiting batch)."""
        replicas = self._router.cluster.healthy(self.model, self.version)
        if not replicas:
            return True
        return self._router._free_slots(replicas, self.model, busy=False) > self.starting

    async def wait(self) -> None:
        """Resolve when capacity may have become available (at once if it is)."""
        if self.has_capacity():
            return
        future = self._register()
        try:
            await future
        finally:
            self._waiters.discard(future)

    def _register(self) -> asyncio.Future[None]:
        # Synchronous, so no wake-up can slip between a caller's check and its wait.
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.add(future)
        return future

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, set()
        for future in waiters:
            if not future.done():
                future.set_result(None)


class Router:
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
    ) -> None:
        if max_inflight_per_replica < 0 or busy_inflight_per_replica < 0:
            raise ValueError("max_inflight_per_replica and busy_inflight_per_replica must be >= 0 (0 = derived)")
        self.cluster = cluster
        # 0 = derived per replica and model from its execution slots (see _limits).
        self.max_inflight_per_replica = max_inflight_per_replica
        self.busy_inflight_per_replica = (
            min(busy_inflight_per_replica, max_inflight_per_replica) if max_inflight_per_replica else busy_inflight_per_replica
        )
        # Per-model bounds (config ``models.<name>.busy_inflight_per_replica`` / ``max_inflight_per_replica``)
        # over the gateway-wide ones: a light model batches better when one batch in flight makes a replica busy.
        self._bounds = {name: (int(s.get("busy_inflight_per_replica", 0)), int(s.get("max_inflight_per_replica", 0)))
                        for name, s in (per_model or {}).items()
                        if s.get("busy_inflight_per_replica") or s.get("max_inflight_per_replica")}
        self._clock: Clock = clock or LoopClock()
        self._rng = rng or random.Random()
        self.retry_budget = retry_budget or RetryBudget()
        self.outliers = outliers or OutlierDetector(clock=self._clock.now)
        self.latency = LatencyTracker()
        self.row_costs = row_costs or RowCosts(0.0)  # the light-model rule, off unless given
        backoff = Backoff(retry_backoff_s, max(retry_backoff_s, retry_backoff_max_s), self._rng)
        self.attempts = AttemptPolicy(self.outliers, self.retry_budget, backoff, self.latency,
                                      hedging or HedgeSettings(), retry_limit, self._clock)
        # model -> version -> capacity; "" is the model's any-version capacity.
        self._capacities: dict[str, dict[str, ModelCapacity]] = {}
        # Replicas going up or down change every model's capacity (and reset a returning worker's circuit).
        self._unsubscribe: Callable[[], None] = cluster.on_change(self._cluster_changed)
        self.outliers.sync((w.address, w.is_up) for w in cluster.workers())

    def close(self) -> None:
        self._unsubscribe()
        self._wake_all()

    def capacity(self, model: str, version: str = "") -> ModelCapacity:
        by_version = self._capacities.setdefault(model, {})
        cap = by_version.get(version)
        if cap is None:
            cap = by_version[version] = ModelCapacity(self, model, version)
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
        first: WorkerState | None = None
        if not wait_for_slot:
            replicas = self.cluster.healthy(model, version)
            if replicas:  # none at all: the race below fails fast with Unavailable
                first = self._pick(replicas, model, set(), busy=True)
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

        async def acquire(avoid: set[WorkerState]) -> WorkerState:
            nonlocal first
            if first is not None:  # picked above, with no await since: its slot is still free
                worker, first = first, None
                return worker
            return await self._acquire(model, version, deadline, avoid)

        race: AttemptRace[WorkerState, service_pb2.ModelInferResponse] = AttemptRace(
            self.attempts, model, deadline,
            acquire=acquire,
            try_pick=lambda avoid: self._try_pick(model, version, avoid),
            send=lambda worker: self._attempt(worker, model, version, request, deadline, slot_taken),
        )
        try:
            return await race.run()
        finally:
            slot_taken()

    async def acquire(self, model: str, version: str, deadline: float | None) -> WorkerState:
        """A replica for a new stateful sequence: the least loaded one with a free slot (waits within the deadline)."""
        return await self._acquire(model, version, deadline, set())

    async def send_to(
        self, worker: WorkerState, model: str, version: str, request: service_pb2.ModelInferRequest,
        deadline: float | None,
    ) -> service_pb2.ModelInferResponse:
        """``request`` on ``worker`` and nowhere else (a sequence's state lives there): no retry, no hedge."""
        try:
            return await self._attempt(worker, model, version, request, deadline)
        except AttemptFailed as e:
            raise e.error from None

    async def _attempt(
        self, worker: WorkerState, model: str, version: str, request: service_pb2.ModelInferRequest,
        deadline: float | None, slot_taken: Callable[[], None] | None = None,
    ) -> service_pb2.ModelInferResponse:
        """One call on ``worker``: ``AttemptFailed`` when another replica may serve it, else the error as is."""
        timeout_s = self._remaining(deadline)
        if timeout_s is not None and timeout_s <= 0:
            raise DeadlineExceeded(f"deadline exceeded before model '{model}' was sent to a worker")
        if timeout_s is not None:
            # gRPC takes a far-off deadline (a client's `timeout` of years) as already passed.
            timeout_s = min(timeout_s, MAX_CALL_TIMEOUT_S)
        # The slot is held from here to the `finally`: inflight never leaks,
        # even when the attempt is cancelled mid-call.
        worker.inflight += 1
        worker.sent += 1
        if slot_taken is not None:
            slot_taken()
        try:
            started = self.row_costs.timer()
            response = await worker.client.infer(request, timeout_s)
            self.row_costs.observe(model, self.row_costs.timer() - started, _rows(request))
            return response
        except WorkerBusy as e:
            # A full queue is load, not a sick worker: another replica may have room.
            raise AttemptFailed(e, worker_fault=False) from None
        except Unavailable as e:
            worker.failures += 1
            if isinstance(e, WorkerUnreachable):
                self.cluster.mark_down(worker, str(e))
            elif isinstance(e, ModelNotReady):
                self.cluster.model_gone(worker, model, str(e))
                raise AttemptFailed(e, failover=True) from None  # one model going, not a sick worker
            raise AttemptFailed(e) from None
        except ModelNotFound as e:
            worker.failures += 1
            self.cluster.model_gone(worker, model, str(e))
            if not any(w is not worker for w in self.cluster.healthy(model, version)):
                raise
            raise AttemptFailed(e, failover=True) from None
        except Internal as e:
            # The worker's fault or the batch's: a confirming attempt elsewhere tells (gateway.routing.attempts).
            raise AttemptFailed(e, suspect=True) from None
        except InferGateError:
            raise  # the request's own fault, or its deadline: nothing against the worker
        finally:
            worker.inflight -= 1
            self._slot_freed(worker)

    # ---- replica choice ----------------------------------------------------

    def _remaining(self, deadline: float | None) -> float | None:
        return None if deadline is None else deadline - self._clock.now()

    async def _acquire(
        self, model: str, version: str, deadline: float | None, tried: set[WorkerState]
    ) -> WorkerState:
        """A replica with a free slot, waiting (within the deadline) while all are full."""
        while True:
            replicas = self.cluster.healthy(model, version)
            if not replicas:
                which = f"model '{model}' version {version}" if version else f"model '{model}'"
                raise Unavailable(f"no healthy replica of {which}")
            worker = self._pick(replicas, model, tried)
            if worker is not None:
                return worker
            remaining = self._remaining(deadline)
            if remaining is not None and remaining <= 0:
                raise DeadlineExceeded(f"deadline exceeded waiting for a free replica of model '{model}'")
            capacity = self.capacity(model, version)
            waiter = capacity._register()
            try:
                await asyncio.wait_for(waiter, remaining)
            except asyncio.TimeoutError:
                raise DeadlineExceeded(f"deadline exceeded waiting for a free replica of model '{model}'") from None
            finally:
                capacity._waiters.discard(waiter)

    def _usable(self, pool: Sequence[WorkerState]) -> list[WorkerState]:
        """The READY replicas of ``pool`` whose circuit lets an attempt through now."""
        routable = self.outliers.routable
        return [w for w in pool if w.state is WorkerStatus.READY and routable(w.address)]

    def limits(self, worker: WorkerState, model: str) -> tuple[int, int]:
        """(busy, max): batches of ``model`` in flight on ``worker`` at which it is busy, and full.

        Busy at its execution slots (every execution running), full one batch
        later (one waiting, so the next starts without a round trip), unless
        the config fixes either bound; a light batching model is busy at one,
        a heavy one at its slots plus the waiting batch (``gateway.routing.light``).
        In flight counts the worker's batches of every model: models on one
        worker share its cores (our worker's one pool).
        """
        fixed_busy, fixed_most = self._bounds.get(model, (0, 0))
        fixed_busy, fixed_most = fixed_busy or self.busy_inflight_per_replica, fixed_most or self.max_inflight_per_replica
        served = worker.models.get(model)
        busy, waiting = fixed_busy or (served.slots if served is not None else 1), 1
        if not fixed_busy and served is not None and served.config.max_batch_size > 0:
            # Light: one batch runs, the rest batch up behind it. Heavy: the waiting
            # batch goes at once, to be on the worker when a slot frees.
            verdict = self.row_costs.verdict(model)
            busy, waiting = (busy, 1) if verdict is None else (1, 1) if verdict else (busy + 1, 0)
        most = fixed_most or busy + waiting
        return min(busy, most), most

    def _free_slots(self, replicas: Sequence[WorkerState], model: str, *, busy: bool) -> int:
        """Batches the usable replicas can take before each is busy (or full)."""
        usable = self._usable(replicas) or [w for w in replicas if w.state is WorkerStatus.READY]
        free = 0
        for w in usable:
            limit = self.limits(w, model)[0 if busy else 1]
            if w.inflight < limit:
                free += limit - w.inflight
        return free

    def _below(self, workers: Sequence[WorkerState], model: str, *, busy: bool = False) -> list[WorkerState]:
        """The workers below their max (or, with ``busy``, their busy) bound for ``model``."""
        which = 0 if busy else 1
        return [w for w in workers if w.inflight < self.limits(w, model)[which]]

    def _try_pick(self, model: str, version: str, avoid: set[WorkerState]) -> WorkerState | None:
        """A replica outside ``avoid`` with a free slot and a closed circuit, now or None (second attempts)."""
        pool = [w for w in self.cluster.healthy(model, version) if w not in avoid]
        candidates = self._below(self._usable(pool), model)
        return self._least_loaded(candidates, model) if candidates else None

    def _pick(
        self, replicas: Sequence[WorkerState], model: str, tried: set[WorkerState], *, busy: bool = False
    ) -> WorkerState | None:
        # A retry goes to a replica not tried yet while one is healthy, even if
        # it has to wait for its slot; tried ones are reused only when none is left.
        # Ejected replicas are skipped while any other can serve; with every
        # replica ejected, all of them serve again (panic mode).
        untried = [w for w in replicas if w not in tried] if tried else replicas
        usable = (
            self._usable(untried)
            or (self._usable(replicas) if tried else [])
            or [w for w in replicas if w.state is WorkerStatus.READY]
        )
        # busy: only a replica with a free execution slot (the batch starts at once).
        candidates = self._below(usable, model, busy=busy)
        if not candidates:
            return None
        return self._least_loaded(candidates, model)

    def _least_loaded(self, candidates: Sequence[WorkerState], model: str) -> WorkerState:
        # Load = batches in flight per execution slot: a replica with more slots takes
        # more batches before it counts as loaded as a smaller one, and idle replicas
        # (load 0) stay equals, so light load is shared whatever their sizes.
        def load(w: WorkerState) -> float:
            return w.inflight / self.limits(w, model)[0]

        if len(candidates) > P2C_THRESHOLD:
            a, b = self._rng.sample(candidates, 2)
            return a if load(a) <= load(b) else b
        loads = [load(w) for w in candidates]
        least = min(loads)
        best = [w for w, n in zip(candidates, loads) if n == least]
        # Random among equals so idle replicas share light load.
        return best[0] if len(best) == 1 else self._rng.choice(best)

    # ---- wake-ups ----------------------------------------------------------

    def _slot_freed(self, worker: WorkerState) -> None:
        for name in worker.models:
            for cap in self._capacities.get(name, {}).values():
                if cap._waiters:
                    cap._wake()

    def _cluster_changed(self) -> None:
        self.outliers.sync((w.address, w.is_up) for w in self.cluster.workers())
        self._wake_all()

    def _wake_all(self) -> None:
        for by_version in self._capacities.values():
            for cap in by_version.values():
                cap._wake()


def _rows(request: service_pb2.ModelInferRequest | wire.RawInferRequest) -> int:
    """The rows of a batch: its first input's first dimension (1 when it has none)."""
    inputs = (request.header if isinstance(request, wire.RawInferRequest) else request).inputs
    return inputs[0].shape[0] if inputs and inputs[0].shape else 1
