"""The router: sends each batch to one healthy replica of its model.

Choice: least outstanding batches among the READY replicas that are below
``max_inflight_per_replica`` (with more than a handful of candidates, the
better of two random ones: power of two choices). When every replica is at
its bound the call waits, within the deadline, for a slot; the per-model
:class:`ModelCapacity` tells the batcher when to hold batches back instead.

Failures: ``Unavailable`` answers and transport failures are retried -- the
whole batch, on a replica not tried yet when there is one -- after a small
jittered backoff, at most ``retry_limit`` times and never past the deadline.
A worker whose connection failed is marked DOWN at once; the cluster's probe
brings it back. Any other error passes through unchanged: inference is
idempotent, so a retry never answers a request twice, and the caller answers
each request exactly once.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tritonclient.grpc import service_pb2

from protos.errors import DeadlineExceeded, InferGateError, Unavailable

from .batcher import Clock, LoopClock
from .cluster import Cluster, WorkerState, WorkerStatus
from .worker_client import WorkerUnreachable

log = logging.getLogger(__name__)

# Above this many candidates, sample two instead of scanning (power of two choices).
P2C_THRESHOLD = 4


@dataclass(frozen=True, slots=True)
class WorkerCounters:
    """A snapshot of one worker's routing counters (for metrics and the dashboard)."""

    address: str
    state: str
    inflight: int
    sent: int
    failures: int
    retries: int


class ModelCapacity:
    """Whether a batch of one model could be sent now (implements ``gateway.batcher.Capacity``).

    With no healthy replica at all it reports capacity, so queued requests
    are dispatched and fail fast with ``Unavailable`` instead of waiting out
    their deadlines for a worker that may never come.
    """

    def __init__(self, router: Router, model: str, version: str) -> None:
        self._router = router
        self.model = model
        self.version = version
        self._waiters: set[asyncio.Future[None]] = set()

    def has_capacity(self) -> bool:
        replicas = self._router.cluster.healthy(self.model, self.version)
        if not replicas:
            return True
        limit = self._router.max_inflight_per_replica
        return any(w.inflight < limit and w.state is WorkerStatus.READY for w in replicas)

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
        max_inflight_per_replica: int = 4,
        retry_limit: int = 3,
        retry_backoff_s: float = 0.005,
        retry_backoff_max_s: float = 0.1,
        clock: Clock | None = None,
        rng: random.Random | None = None,
    ) -> None:
        if max_inflight_per_replica < 1:
            raise ValueError("max_inflight_per_replica must be at least 1")
        self.cluster = cluster
        self.max_inflight_per_replica = max_inflight_per_replica
        self.retry_limit = retry_limit
        self._backoff_s = retry_backoff_s
        self._backoff_max_s = retry_backoff_max_s
        self._clock: Clock = clock or LoopClock()
        self._rng = rng or random.Random()
        # model -> version -> capacity; "" is the model's any-version capacity.
        self._capacities: dict[str, dict[str, ModelCapacity]] = {}
        # Replicas going up or down change every model's capacity.
        self._unsubscribe: Callable[[], None] = cluster.on_change(self._wake_all)

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
            WorkerCounters(w.address, w.state.name, w.inflight, w.sent, w.failures, w.retries)
            for w in self.cluster.workers()
        ]

    async def infer(
        self, model: str, version: str, request: service_pb2.ModelInferRequest, deadline: float | None
    ) -> service_pb2.ModelInferResponse:
        """Send ``request`` to a replica of ``model``, retrying elsewhere on ``Unavailable``.

        ``deadline`` is absolute, on the event loop's clock; None means none.
        """
        tried: set[WorkerState] = set()
        failures = 0
        error: Unavailable | None = None
        while True:
            worker = await self._acquire(model, version, deadline, tried)
            timeout_s = self._remaining(deadline)
            if timeout_s is not None and timeout_s <= 0:
                raise DeadlineExceeded(f"deadline exceeded before model '{model}' was sent to a worker")
            # The slot is held from here to the `finally`: inflight never leaks,
            # even when the caller is cancelled mid-call.
            worker.inflight += 1
            worker.sent += 1
            try:
                return await worker.client.infer(request, timeout_s)
            except Unavailable as e:
                worker.failures += 1
                error = e
                if isinstance(e, WorkerUnreachable):
                    self.cluster.mark_down(worker, str(e))
            except InferGateError:
                worker.failures += 1
                raise
            finally:
                worker.inflight -= 1
                self._slot_freed(worker)

            assert error is not None
            failures += 1
            tried.add(worker)
            # Worker addresses and their messages go to the log; the caller gets
            # a message that names nothing inside the cluster.
            if failures > self.retry_limit:
                log.warning("model %s: giving up after %d attempts, last on %s: %s", model, failures, worker.address, error)
                raise Unavailable(f"no replica of model '{model}' could serve the request ({failures} attempts)")
            delay_s = min(self._backoff_max_s, self._backoff_s * 2 ** (failures - 1)) * self._rng.uniform(0.5, 1.5)
            remaining = self._remaining(deadline)
            if remaining is not None and remaining <= delay_s:
                log.info("model %s: deadline leaves no time to retry after failure on %s: %s", model, worker.address, error)
                raise DeadlineExceeded(f"deadline exceeded for model '{model}' after {failures} failed attempts")
            worker.retries += 1
            log.info("model %s: retrying batch after failure on %s: %s", model, worker.address, error)
            await self._clock.sleep(delay_s)

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
            worker = self._pick(replicas, tried)
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

    def _pick(self, replicas: Sequence[WorkerState], tried: set[WorkerState]) -> WorkerState | None:
        # A retry goes to a replica not tried yet while one is healthy, even if
        # it has to wait for its slot; tried ones are reused only when none is left.
        pool = [w for w in replicas if w not in tried] if tried else replicas
        if not pool:
            pool = replicas
        limit = self.max_inflight_per_replica
        candidates = [w for w in pool if w.inflight < limit and w.state is WorkerStatus.READY]
        if not candidates:
            return None
        if len(candidates) > P2C_THRESHOLD:
            a, b = self._rng.sample(candidates, 2)
            return a if a.inflight <= b.inflight else b
        least = min(w.inflight for w in candidates)
        best = [w for w in candidates if w.inflight == least]
        # Random among equals so idle replicas share light load.
        return best[0] if len(best) == 1 else self._rng.choice(best)

    # ---- wake-ups ----------------------------------------------------------

    def _slot_freed(self, worker: WorkerState) -> None:
        for name in worker.models:
            for cap in self._capacities.get(name, {}).values():
                if cap._waiters:
                    cap._wake()

    def _wake_all(self) -> None:
        for by_version in self._capacities.values():
            for cap in by_version.values():
                cap._wake()
