"""Replica capacity: how many batches each replica may hold, and the per-model view the batcher waits on.

A replica's slots for a model are what its served config states
(``WorkerModel.slots``: instances, or our worker's stated execution count).
:class:`InflightBounds` turns them into two bounds per replica and model: a
replica is *busy* while every execution slot runs a batch and *full* one
batch later (the waiting batch that hides the round trip; a busy replica
still takes a full one). ``busy_inflight_per_replica`` and
``max_inflight_per_replica`` fix the two bounds instead when set (0 =
derived from the slots), gateway-wide or per model. A light model (little
worker time per row, ``gateway.routing.light``) is busy at one batch: its
requests batch up behind it instead of splitting over the slots; a heavy
one only once its waiting batch is on the worker too.

A model that batches its own sequences on the worker (a generation backend's
``max_sequences`` in its config's ``parameters``) is bounded by that instead:
a replica takes up to ``max_sequences`` streams of it at once, counted apart
(:meth:`InflightBounds.stream_started`), so they neither wait on the
execution slots nor make the replica look busy to other models' batches.

A model always on the relay lane (``gateway.core.relay``: a stateful model,
or one the gateway does not batch) is counted apart too, in calls
(:meth:`InflightBounds.call_started`): a replica is busy at its slots times
the model's ``max_batch_size`` calls (the rows its executions take at once,
which its own batcher fills) and full at twice that, so calls reach the
server's queue instead of waiting here one per slot. A model on the lane only
while a slot is free (its Triton servers batch it) is not: each relayed call
is a batch of one to these bounds, and beyond them its calls are batched here.

:class:`ModelCapacity` is the seam the batcher holds batches back on
(``gateway.batching.seams.Capacity``): a model has *capacity* while some
replica is below its busy bound (adaptive batching sends at once only then)
and *room* while some replica is below its full bound. The router wakes its
waiters when a slot frees or the cluster changes.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.fleet.cluster import Cluster, WorkerState, WorkerStatus
from gateway.routing.light import RowCosts
from gateway.routing.outlier import OutlierDetector

# The config parameter of a model that runs many sequences at once on one replica.
MAX_SEQUENCES = "max_sequences"


def max_sequences(config: Any) -> int:
    """The sequences one replica runs at once as its config states them; 0 when it states none."""
    stated = config.parameters.get(MAX_SEQUENCES)
    if stated is not None and stated.string_value.isdigit():
        return int(stated.string_value)
    return 0


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


class InflightBounds:
    """Each replica's busy and full bounds per model, and which replicas count now."""

    def __init__(
        self,
        outliers: OutlierDetector,
        *,
        max_inflight_per_replica: int = 0,
        busy_inflight_per_replica: int = 0,
        per_model: Mapping[str, Mapping[str, Any]] | None = None,
        row_costs: RowCosts | None = None,
    ) -> None:
        if max_inflight_per_replica < 0 or busy_inflight_per_replica < 0:
            raise ValueError("max_inflight_per_replica and busy_inflight_per_replica must be >= 0 (0 = derived)")
        self._outliers = outliers
        # 0 = derived per replica and model from its execution slots (see limits).
        self.max_inflight_per_replica = max_inflight_per_replica
        self.busy_inflight_per_replica = (
            min(busy_inflight_per_replica, max_inflight_per_replica) if max_inflight_per_replica else busy_inflight_per_replica
        )
        # Per-model bounds (config ``models.<name>.busy_inflight_per_replica`` / ``max_inflight_per_replica``)
        # over the gateway-wide ones: a light model batches better when one batch in flight makes a replica busy.
        self._bounds = {name: (int(s.get("busy_inflight_per_replica", 0)), int(s.get("max_inflight_per_replica", 0)))
                        for name, s in (per_model or {}).items()
                        if s.get("busy_inflight_per_replica") or s.get("max_inflight_per_replica")}
        self.row_costs = row_costs or RowCosts(0.0)  # the light-model rule, off unless given
        # Open streams of sequence-batching models and calls of relayed models, per replica and model (see held).
        self._sequences: dict[WorkerState, dict[str, int]] = {}
        # Models whose every call takes the relay lane (set by gateway.core.relay when it decides a model's lane).
        self.relayed: set[str] = set()

    def sequence_limit(self, worker: WorkerState, model: str) -> int:
        """Streams of ``model`` ``worker`` runs at once when the model batches its own sequences; else 0."""
        served = worker.models.get(model)
        return max_sequences(served.config) if served is not None else 0

    def _apart(self, worker: WorkerState, model: str) -> bool:
        """Whether ``model``'s calls on ``worker`` count apart from the worker's batches."""
        return model in self.relayed or bool(self.sequence_limit(worker, model))

    def stream_started(self, worker: WorkerState, model: str) -> bool:
        """Count a stream of ``model`` on ``worker`` apart from its batches; False when the model has no
        sequence bound (the stream then counts as a batch in ``worker.inflight``)."""
        if not self.sequence_limit(worker, model):
            return False
        return self._count(worker, model)

    def call_started(self, worker: WorkerState, model: str) -> bool:
        """Count a call of a relayed model on ``worker`` apart from the batches (end it with
        :meth:`call_ended`); False when the model is not on the relay lane."""
        if model not in self.relayed:
            return False
        return self._count(worker, model)

    def _count(self, worker: WorkerState, model: str) -> bool:
        by_model = self._sequences.setdefault(worker, {})
        by_model[model] = by_model.get(model, 0) + 1
        return True

    def call_ended(self, worker: WorkerState, model: str) -> None:
        """A call counted by :meth:`call_started` ended."""
        self.stream_ended(worker, model)

    def stream_ended(self, worker: WorkerState, model: str) -> None:
        by_model = self._sequences.get(worker)
        if by_model is None or model not in by_model:
            return
        by_model[model] -= 1
        if not by_model[model]:
            del by_model[model]
            if not by_model:
                del self._sequences[worker]

    def held(self, worker: WorkerState, model: str) -> int:
        """What counts against ``worker``'s bounds for ``model``: its open streams when the model batches
        its own sequences, else the worker's batches (``inflight`` less those streams)."""
        by_model = self._sequences.get(worker)
        if by_model is None:
            return 0 if self._apart(worker, model) else worker.inflight
        if model in by_model or self._apart(worker, model):
            return by_model.get(model, 0)
        return worker.inflight - sum(by_model.values())

    def limits(self, worker: WorkerState, model: str) -> tuple[int, int]:
        """(busy, max): batches of ``model`` in flight on ``worker`` at which it is busy, and full.

        Busy at its execution slots (every execution running), full one batch
        later (one waiting, so the next starts without a round trip), unless
        the config fixes either bound; a light batching model is busy at one,
        a heavy one at its slots plus the waiting batch (``gateway.routing.light``).
        In flight counts the worker's batches of every model: models on one
        worker share its cores (our worker's one pool).
        """
        sequences = self.sequence_limit(worker, model)
        if sequences:
            return sequences, sequences  # the worker refuses past it ("is at capacity")
        fixed_busy, fixed_most = self._bounds.get(model, (0, 0))
        fixed_busy, fixed_most = fixed_busy or self.busy_inflight_per_replica, fixed_most or self.max_inflight_per_replica
        served = worker.models.get(model)
        if model in self.relayed:
            # Calls, not batches: the rows the server's executions take at once, then as many waiting.
            rows = (served.slots if served is not None else 1) * max(1, served.config.max_batch_size if served else 1)
            busy = fixed_busy or rows
            most = fixed_most or 2 * busy
            return min(busy, most), most
        busy, waiting = fixed_busy or (served.slots if served is not None else 1), 1
        if not fixed_busy and served is not None and served.config.max_batch_size > 0:
            # Light: one batch runs, the rest batch up behind it. Heavy: the waiting
            # batch goes at once, to be on the worker when a slot frees.
            # Not judged yet counts as light: a first burst batches up instead of spreading over the slots.
            if self.row_costs.threshold_s:  # the rule is on
                busy, waiting = (busy + 1, 0) if self.row_costs.verdict(model) is False else (1, 1)
        most = fixed_most or busy + waiting
        return min(busy, most), most

    def load(self, worker: WorkerState, model: str) -> float:
        """Batches in flight per execution slot: idle replicas are equals whatever their sizes.

        Where the server reports its own figures (an OpenAI-protocol server's
        metrics, ``WorkerState.server_load``), its queue counts too (requests
        waiting there, every client's, per slot), and the share of its KV
        cache in use: of two servers with as many of our streams, the one
        with the shorter queue and the emptier cache is the less loaded.
        """
        busy = self.limits(worker, model)[0]
        load = self.held(worker, model) / busy
        reported = worker.server_load
        if reported is not None:
            load += reported.waiting / busy + reported.cache_usage
        return load

    def usable(self, pool: Sequence[WorkerState]) -> list[WorkerState]:
        """The READY replicas of ``pool`` whose circuit lets an attempt through now."""
        routable = self._outliers.routable
        return [w for w in pool if w.state is WorkerStatus.READY and routable(w.address)]

    def below(self, workers: Sequence[WorkerState], model: str, *, busy: bool = False) -> list[WorkerState]:
        """The workers below their max (or, with ``busy``, their busy) bound for ``model``."""
        which = 0 if busy else 1
        return [w for w in workers if self.held(w, model) < self.limits(w, model)[which]]

    def free(self, replicas: Sequence[WorkerState], model: str, *, busy: bool) -> int:
        """Batches the usable replicas can take before each is busy (or full)."""
        usable = self.usable(replicas) or [w for w in replicas if w.state is WorkerStatus.READY]
        free = 0
        for w in usable:
            limit, held = self.limits(w, model)[0 if busy else 1], self.held(w, model)
            if held < limit:
                free += limit - held
        return free


class ModelCapacity:
    """Whether a batch of one model could be sent now (implements ``gateway.batching.seams.Capacity``).

    With no healthy replica at all it reports capacity, so queued requests
    are dispatched and fail fast with ``Unavailable`` instead of waiting out
    their deadlines for a worker that may never come.
    """

    def __init__(self, cluster: Cluster, bounds: InflightBounds, model: str, version: str) -> None:
        self._cluster = cluster
        self._bounds = bounds
        self.model = model
        self.version = version
        self._waiters: set[asyncio.Future[None]] = set()
        # Calls of this model routed but not holding a replica slot yet (waiting for one,
        # or about to take one): a slot such a call takes next must not look free to the
        # batcher, or it would send another batch after it.
        self.starting = 0
        # Calls waiting for a replica slot (``Router.acquire``), first come first served:
        # only the head of the line takes a freed slot; each one's future is set when it is next.
        self.line: deque[asyncio.Future[None]] = deque()

    def join_line(self) -> asyncio.Future[None]:
        """A place at the back of the line; its future is done once it is the head. Pair with :meth:`leave_line`."""
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if not self.line:
            turn.set_result(None)
        self.line.append(turn)
        return turn

    def leave_line(self, turn: asyncio.Future[None]) -> None:
        """``turn`` leaves the line (served, failed or gone); the next one becomes the head."""
        head = bool(self.line) and self.line[0] is turn
        try:
            self.line.remove(turn)
        except ValueError:
            return
        if head and self.line and not self.line[0].done():
            self.line[0].set_result(None)

    def has_capacity(self) -> bool:
        """Some replica has a free execution slot: a batch sent now starts at once."""
        replicas = self._cluster.healthy(self.model, self.version)
        if not replicas:
            return True
        return self._bounds.free(replicas, self.model, busy=True) > self.starting

    def has_room(self) -> bool:
        """Some replica can take one more batch now (its slots plus one waiting batch)."""
        replicas = self._cluster.healthy(self.model, self.version)
        if not replicas:
            return True
        return self._bounds.free(replicas, self.model, busy=False) > self.starting

    async def wait(self) -> None:
        """Resolve when capacity may have become available (at once if it is)."""
        if self.has_capacity():
            return
        future = self.register()
        try:
            await future
        finally:
            self.forget(future)

    @property
    def waiting(self) -> bool:
        return bool(self._waiters)

    def register(self) -> asyncio.Future[None]:
        """A future the next wake-up resolves; pair it with :meth:`forget`."""
        # Synchronous, so no wake-up can slip between a caller's check and its wait.
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.add(future)
        return future

    def forget(self, future: asyncio.Future[None]) -> None:
        self._waiters.discard(future)

    def wake(self) -> None:
        waiters, self._waiters = self._waiters, set()
        for future in waiters:
            if not future.done():
                future.set_result(None)
