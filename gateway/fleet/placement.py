"""The placement controller: keeps whole models on workers where
:func:`gateway.fleet.rendezvous.plan` says, loading and unloading them through the
repository API.

Where: rendezvous hashing over the live workers (READY, not being drained,
able to load), each with the room ``gateway.fleet.worker_reports`` gives it, so
every gateway computes the same placement and membership changes move few
replicas. Models are packed most recently used first, so under memory
pressure the least recently used are the ones left out: they are unloaded
(evicted) and come back on their next request. Several models share one
worker (one GPU) wherever their memory fits.

What: the :class:`~gateway.fleet.demand.DemandBook` -- models declared with
``replicas`` in the config, models loaded on demand (``load_on_demand``),
their idle TTL and their autoscaled replica counts. Models this gateway did
not place (loaded at a worker's start, logical models' shards) are left
alone, except that a drained worker's models are adopted so they can move.

The controller runs one task: a round every ``placement.interval_s``, after
every cluster change and whenever a request or a drain asks for one. A
round plans, unloads what is no longer wanted, loads the new replicas, and
only then unloads replicas that moved (make before break). All changes to
workers happen in that task, so rounds never overlap; requests only read.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from gateway.fleet.cluster import Cluster, WorkerState, WorkerStatus
from gateway.fleet.demand import AutoscalePolicy, DemandBook
from gateway.fleet.rendezvous import Bin, Demand, plan
from gateway.replicas.errors import WorkerUnreachable
from gateway.fleet.worker_reports import ModelMemory, observed
from gateway.settings import AutoscaleSettings, PlacementSettings, logical_models
from protos.errors import InferGateError, ModelNotFound, Unavailable
from serverkit.tasks import log_task_death

if TYPE_CHECKING:
    from gateway.fleet.registry import Registry

log = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 300.0
LOAD_CONCURRENCY = 4
REFUSED_FOR_S = 30.0  # a worker that failed to load a model is not asked again for this long
NOT_FOUND_FOR_S = 5.0  # an unknown model name is answered from memory for this long
SHARD_PARAMETER = "infergate_shard_digest"  # marks a logical model's shard (gateway/parallel/serving.py)


def is_shard(worker: WorkerState, name: str) -> bool:
    """A logical model's shard: placed by the parallel registry, never by this controller."""
    model = worker.models.get(name)
    return model is not None and SHARD_PARAMETER in model.config.parameters


class PlacementController:
    """Keeps the placed models where :func:`plan` says, loading and unloading through the repository API."""

    def __init__(self, cluster: Cluster, registry: Registry | None = None, *, settings: PlacementSettings,
                 autoscale: AutoscaleSettings, models: Mapping[str, Mapping[str, Any]], model_repository: str = "",
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``settings``: the ``placement`` group; ``models``: the config's per-model entries (``replicas``,
        ``max_replicas``, ``idle_ttl_s``, ``memory_bytes``); ``model_repository``: where models' files are sized."""
        self._settings = settings
        self._models = models
        self._cluster = cluster
        self._registry = registry
        self._clock = clock
        self.book = DemandBook(
            AutoscalePolicy(autoscale.up_rate, autoscale.down_rate, autoscale.max_replicas, autoscale.cooldown_s),
            idle_ttl_s=settings.idle_ttl_s, clock=clock)
        self._logical = set(logical_models(models))
        for name, entry in models.items():
            if "replicas" in entry and name not in self._logical:
                self.book.declare(name, int(entry["replicas"]), idle_ttl_s=entry.get("idle_ttl_s"),
                                  ceiling=int(entry.get("max_replicas", 0)))
        self.targets: dict[str, tuple[str, ...]] = {}
        self.excluded: set[str] = set()  # workers being drained: no new replicas, nothing unloaded there
        self._refused: dict[tuple[str, str], float] = {}
        self._not_found: dict[str, float] = {}
        self._errors: dict[str, str] = {}
        self.memory = ModelMemory(settings, models, model_repository)
        self.moves = 0  # replicas re-placed on another worker (membership changes, drains)
        self.evictions = 0
        self.idle_unloads = 0
        self.loads = 0
        self.unloads = 0
        self.load_failures = 0
        self.rounds = 0  # rounds run: a gateway process that does not place runs none
        self._wake = asyncio.Event()
        self._round: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._unsubscribe: Callable[[], None] | None = None

    # ---- lifecycle -------------------------------------------------------

    async def start(self) -> None:
        """Place the declared models on the workers known now, then keep placing."""
        self._round = asyncio.get_running_loop().create_future()
        if any(True for _ in self.book) or self._settings.load_on_demand:
            await self._reconcile_logged()
        self._unsubscribe = self._cluster.on_change(self._wake.set)
        self._task = asyncio.create_task(self._run(), name="placement")
        self._task.add_done_callback(log_task_death)

    async def stop(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if self._round is not None and not self._round.done():
            self._round.set_result(None)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            # asyncio.wait, not wait_for: before Python 3.12, wait_for swallows a
            # cancellation that arrives as the event is set, and stop() would hang.
            waiter = asyncio.ensure_future(self._wake.wait())
            try:
                await asyncio.wait({waiter}, timeout=self._settings.interval_s)
            finally:
                waiter.cancel()
            self._wake.clear()
            # Callers waiting for "the next round" hold the current future; the
            # ones that arrive while this round runs wait for the one after.
            done, self._round = self._round, loop.create_future()
            try:
                await self._reconcile_logged()
            finally:
                if done is not None and not done.done():
                    done.set_result(None)

    async def _reconcile_logged(self) -> None:
        self.rounds += 1
        try:
            await self._reconcile()
        except asyncio.CancelledError:
            raise
        except Exception:  # one bad round must not end placement
            log.exception("placement round failed")

    async def wait_round(self, timeout_s: float | None) -> bool:
        """Ask for a round now and wait until one that started after this call ends; False on timeout."""
        future = self._round
        if future is None or self._task is None:
            return False
        self._wake.set()
        # Not wait_for (see _run); the round is never cancelled from here.
        await asyncio.wait({future}, timeout=timeout_s)
        return future.done()

    # ---- the request path ----------------------------------------------------

    def touch(self, name: str, rows: int = 1) -> None:
        self.book.touch(name, rows)

    def manages(self, name: str) -> bool:
        return name in self.book

    def can_load(self, name: str) -> bool:
        """Whether a request for ``name`` may place it now (declared, or load on demand)."""
        if name in self._logical or self._not_found.get(name, 0.0) > self._clock():
            return False
        demand = self.book.get(name)
        return (demand is not None and demand.declared) or self._settings.load_on_demand

    async def ensure(self, name: str, timeout_s: float) -> None:
        """Place ``name`` now if it has no READY replica; wait (at most ``timeout_s``) until it has one.

        Raises ``ModelNotFound`` when no worker knows the model, ``Unavailable``
        when it cannot be loaded or placed in time.
        """
        if self._cluster.model(name) is not None:
            return
        if not self.can_load(name):
            raise ModelNotFound(f"Request for unknown model: '{name}' is not found")
        settings = self._models.get(name, {})
        self.book.activate(name, floor=int(settings.get("replicas", 1)), idle_ttl_s=settings.get("idle_ttl_s"))
        self._errors.pop(name, None)
        deadline = self._clock() + timeout_s
        while True:
            if not await self.wait_round(max(0.0, deadline - self._clock())):
                raise Unavailable(f"model '{name}' is still being loaded")
            if self._cluster.model(name) is not None:
                return
            if self._not_found.get(name, 0.0) > self._clock():
                raise ModelNotFound(f"Request for unknown model: '{name}' is not found")
            demand = self.book.get(name)
            if demand is None or not demand.active or name in self._errors:
                log.info("model %s could not be placed: %s", name, self._errors.get(name) or (demand and demand.reason))
                raise Unavailable(f"model '{name}' could not be loaded on any worker right now")

    def note_load(self, name: str) -> None:
        """A repository load request: a placed model is active again (placement trims its extra copies)."""
        if name in self.book:
            self.book.activate(name)
            self._wake.set()

    def note_unload(self, name: str) -> None:
        """A repository unload request: a placed model is inactive until its next request."""
        self.book.deactivate(name, "unloaded by request")

    # ---- draining ----------------------------------------------------------

    def exclude(self, address: str) -> None:
        self.excluded.add(address)
        self._wake.set()

    def include(self, address: str) -> None:
        self.excluded.discard(address)
        self._wake.set()

    def adopt(self, name: str, replicas: int) -> None:
        """Place ``name`` from now on (a drained worker's model), with ``replicas`` replicas."""
        if name not in self._logical:
            self.book.adopt(name, replicas)
            self._wake.set()

    # ---- one round ---------------------------------------------------------

    def _eligible(self) -> list[WorkerState]:
        return [w for w in self._cluster.workers()
                if w.state is WorkerStatus.READY and w.address not in self.excluded and w.model_control != "none"]

    async def _reconcile(self) -> None:
        now = self._clock()
        reports = self._registry.reports() if self._registry is not None else {}
        live = self._eligible()
        for demand in self.book:
            if demand.active and self._cluster.model(demand.name) is None:
                # Not served yet (no worker, or loading): its idle time starts once it is.
                demand.last_used = max(demand.last_used, now)
        for name, what in self.book.tick(observed(reports, now), len(live)):
            demand = self.book.get(name)
            log.info("model %s: %s (%d replica(s) wanted)", name, demand.reason if demand else what,
                     demand.replicas if demand else 0)
            if what == "idle":
                self.idle_unloads += 1
        self._refused = {k: t for k, t in self._refused.items() if t > now}
        active = sorted((d for d in self.book if d.active), key=lambda d: (-d.last_used, d.name))
        demands = [Demand(d.name, d.replicas, self.memory.size(d.name, reports)) for d in active]
        bins = [Bin(w.address, self.memory.capacity(w.address, reports), self.memory.reserved(w.address, reports, self.book))
                for w in live]
        targets = plan(demands, bins, refused=set(self._refused))
        for d in demands:
            usable = [b for b in bins if (d.name, b.address) not in self._refused]
            if not targets[d.name] and usable:
                self.book.deactivate(d.name, "evicted: no worker has memory for it")
                self.evictions += 1
                log.warning("model %s (%d bytes) evicted: no worker has room for it", d.name, d.memory_bytes)
        for name, new in targets.items():
            old = self.targets.get(name, ())
            if old:
                self.moves += max(0, len(set(new) - set(old)) - max(0, len(new) - len(old)))
        self.targets = {n: t for n, t in targets.items() if t}
        await self._apply(now)

    async def _apply(self, now: float) -> None:
        cluster = self._cluster
        hosts = self._hosts()
        # 1. Models no longer wanted (idle, evicted) leave every worker first: their memory is what new loads need.
        unloads = [(w, name) for name, ws in hosts.items() if not self._active(name) for w in ws]
        await self._unload_all(unloads)
        # 2. New replicas.
        jobs = [(w, name) for name, addresses in self.targets.items() for a in addresses
                if (w := cluster.worker(a)) is not None and name not in w.models]
        if jobs:
            await self._load_all(jobs, now)
        # 3. Replicas that moved, once every target serves (make before break).
        hosts = self._hosts()
        surplus = []
        for name, ws in hosts.items():
            wanted = set(self.targets.get(name, ()))
            if self._active(name) and wanted and wanted <= {w.address for w in ws}:
                surplus.extend((w, name) for w in ws if w.address not in wanted)
        await self._unload_all(surplus)

    def _active(self, name: str) -> bool:
        demand = self.book.get(name)
        return demand is not None and demand.active

    def _hosts(self) -> dict[str, list[WorkerState]]:
        """Managed model -> the READY workers (not being drained) that hold it."""
        hosts: dict[str, list[WorkerState]] = {}
        for w in self._cluster.workers():
            if w.state is not WorkerStatus.READY or w.address in self.excluded:
                continue
            for name in w.models:
                if name in self.book and not is_shard(w, name):
                    hosts.setdefault(name, []).append(w)
        return hosts

    async def _load_all(self, jobs: list[tuple[WorkerState, str]], now: float) -> None:
        gate = asyncio.Semaphore(LOAD_CONCURRENCY)

        async def one(worker: WorkerState, name: str) -> None:
            async with gate:
                log.info("placing model %s on worker %s", name, worker.address)
                await worker.client.load(name, timeout_s=LOAD_TIMEOUT_S)
                worker.loaded.add(name)

        results = await asyncio.gather(*(one(w, n) for w, n in jobs), return_exceptions=True)
        await self._refresh({w.address for w, _ in jobs})
        failed: dict[str, list[BaseException]] = {}
        for (worker, name), result in zip(jobs, results):
            if isinstance(result, asyncio.CancelledError):
                raise result
            if result is None:
                self.loads += 1
                continue
            self.load_failures += 1
            failed.setdefault(name, []).append(result)
            log.warning("loading model %s on worker %s failed: %s", name, worker.address, result)
            if not isinstance(result, WorkerUnreachable):
                self._refused[(name, worker.address)] = now + REFUSED_FOR_S
            if not isinstance(result, InferGateError):
                log.error("unexpected error loading %s", name, exc_info=result)
        for name, errors in failed.items():
            if self._cluster.model(name) is not None:
                continue
            self._errors[name] = str(errors[0])
            demand = self.book.get(name)
            if demand is None or demand.declared:
                continue  # declared: tried again on other workers, and here once the refusal expires
            if all(isinstance(e, ModelNotFound) for e in errors):
                # No worker has it: an unknown name. Answer its next requests from memory for a while.
                self._not_found[name] = now + NOT_FOUND_FOR_S
                self.book.forget(name)
            else:
                # Its next request tries again, on a worker that has not refused it yet.
                self.book.deactivate(name, f"load failed: {errors[0]}")
            self.targets.pop(name, None)

    async def _unload_all(self, jobs: list[tuple[WorkerState, str]]) -> None:
        if not jobs:
            return

        async def one(worker: WorkerState, name: str) -> None:
            log.info("unloading model %s from worker %s", name, worker.address)
            await worker.client.unload(name, timeout_s=LOAD_TIMEOUT_S)
            worker.loaded.discard(name)

        results = await asyncio.gather(*(one(w, n) for w, n in jobs), return_exceptions=True)
        for (worker, name), result in zip(jobs, results):
            if isinstance(result, asyncio.CancelledError):
                raise result
            if result is None:
                self.unloads += 1
            else:
                log.warning("unloading model %s from worker %s failed: %s", name, worker.address, result)
        await self._refresh({w.address for w, _ in jobs})

    async def _refresh(self, addresses: set[str]) -> None:
        present = [a for a in addresses if self._cluster.worker(a) is not None]
        await asyncio.gather(*(self._cluster.refresh(a) for a in present), return_exceptions=True)

    # ---- the view ------------------------------------------------------------

    def view(self) -> dict[str, Any]:
        """The ``/v2/cluster/placement`` document."""
        reports = self._registry.reports() if self._registry is not None else {}
        hosts = self._hosts()
        now = self._clock()
        workers = []
        for w in self._cluster.workers():
            report = reports.get(w.address)
            planned = sum(self.memory.size(n, reports) for n, t in self.targets.items() if w.address in t)
            workers.append({
                "address": w.address, "state": w.state.name.lower(), "excluded": w.address in self.excluded,
                "capacity_bytes": self.memory.capacity(w.address, reports),
                "reserved_bytes": self.memory.reserved(w.address, reports, self.book),
                "planned_bytes": planned, "registered": report is not None,
                "report": report.to_json() if report is not None else None,
            })
        models = []
        for d in sorted(self.book, key=lambda d: d.name):
            models.append({
                "name": d.name, "declared": d.declared, "active": d.active, "replicas": d.replicas, "floor": d.floor,
                "targets": list(self.targets.get(d.name, ())), "ready": sorted(w.address for w in hosts.get(d.name, [])),
                "rate": round(d.rate, 3), "idle_s": round(now - d.last_used, 3), "reason": d.reason,
                "memory_bytes": self.memory.size(d.name, reports), "error": self._errors.get(d.name, ""),
            })
        counters = {k: getattr(self, k) for k in ("moves", "evictions", "idle_unloads", "loads", "unloads", "load_failures")}
        return {"counters": counters, "excluded": sorted(self.excluded), "workers": workers, "models": models}
