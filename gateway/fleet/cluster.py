"""Cluster membership and health: which workers exist, which are up, and which
models each one serves.

The cluster probes every worker periodically (ServerReady, then
RepositoryIndex, then ModelConfig and ModelMetadata of each READY model when
the index changed), each on its own clock: a probe waiting out its timeout
holds up no other worker's. It keeps the gateway's model map: the union of
the models of the healthy workers. A worker goes DOWN after ``failures_to_down``
consecutive failed probes, or at once when the router sees its connection
fail; one successful probe brings it back. A worker that answers that it no
longer serves a model (unloaded, or a Triton server shutting down) leaves
that model's rotation at once (:meth:`Cluster.model_gone`).

How one worker is read (health, index, configs), Triton servers and their
restricted protocols included, is :mod:`gateway.fleet.triton_discovery`; what
could not be read is kept in ``WorkerState.unreadable`` for the logs and the
statistics page. In a mixed pool the model map batches to the smallest
``max_batch_size`` of the replicas.

Workers can be added and removed while the gateway runs. Listeners registered
with :meth:`Cluster.on_change` hear about every change of the map or of a
worker's state.

Everything here runs on the gateway's one event loop; state is changed only
between awaits, so readers (the router, on the hot path) never see a
half-applied probe.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType

from tritonclient.grpc import model_config_pb2

from gateway.fleet.probe_deadline import LoopStalls, within
from gateway.fleet.triton_discovery import check_health, read_model, ready_index
from gateway.fleet.view import ModelInfo, WorkerModel, WorkerState, WorkerStatus, version_key
from gateway.replicas.openai_server import OpenAIServer
from gateway.replicas.replica import Replica, ReportsLoad
from gateway.replicas.worker_client import WorkerClient
from gateway.settings import WorkerSpec
from protos.errors import InferGateError
from protos.execution_slots import execution_slots

log = logging.getLogger(__name__)

ChangeListener = Callable[[], None]
ClientFactory = Callable[[WorkerSpec], Replica]


def _default_client(spec: WorkerSpec) -> Replica:
    if spec.kind == "openai":
        return OpenAIServer.for_spec(spec)
    return WorkerClient(spec.address, kind=spec.kind, headers=dict(spec.headers))


class Cluster:
    def __init__(
        self,
        workers: Sequence[WorkerSpec] = (),
        *,
        probe_interval_s: float = 2.0,
        failures_to_down: int = 2,
        probe_timeout_s: float = 5.0,
        start_timeout_s: float = 10.0,
        client_factory: ClientFactory = _default_client,
        model_hints: Sequence[str] = (),
    ) -> None:
        if failures_to_down < 1:
            raise ValueError("failures_to_down must be at least 1")
        self._interval_s = probe_interval_s
        self._failures_to_down = failures_to_down
        self._probe_timeout_s = probe_timeout_s
        self._start_timeout_s = start_timeout_s
        self._client_factory = client_factory
        # Names to ask a worker about when its repository index is unreadable.
        self._model_hints = tuple(model_hints)
        self._workers: dict[str, WorkerState] = {}
        for spec in workers:
            if spec.address not in self._workers:
                self._workers[spec.address] = WorkerState(spec, client_factory(spec))
        self._models: dict[str, ModelInfo] = {}
        # First probes of workers joining now: until one ends, that worker's models are not known yet.
        self._joining: set[asyncio.Task[None]] = set()
        self._listeners: list[ChangeListener] = []
        self._task: asyncio.Task[None] | None = None
        # A probe's timeout counts the loop's time only, not its stalls (gateway.fleet.probe_deadline).
        self._stalls = LoopStalls()

    # ---- lifecycle -------------------------------------------------------

    async def start(self) -> None:
        """Probe every worker once (bounded by ``start_timeout_s``), then keep probing."""
        if self._task is not None:
            return
        self._stalls.start()
        try:
            await asyncio.wait_for(self._probe_all(force=True), self._start_timeout_s)
            # Workers whose models are looked up by name were probed beside the
            # others; now the names the others serve are known, ask them again.
            unlisted = {"repository_index", "statistics"}
            by_name = [w for w in self._workers.values() if w.is_up and unlisted <= w.unreadable.keys()]
            await asyncio.wait_for(asyncio.gather(*(self._probe(w, True) for w in by_name)), self._start_timeout_s)
        except asyncio.TimeoutError:
            log.warning("first probe of the workers took over %.1fs; unanswered workers start DOWN", self._start_timeout_s)
        self._task = asyncio.create_task(self._probe_loop(), name="cluster-probe")
        self._task.add_done_callback(self._probe_loop_done)
        up = sum(1 for w in self._workers.values() if w.is_up)
        log.info("cluster started: %d/%d workers up, %d models", up, len(self._workers), len(self._models))

    async def stop(self, grace_s: float | None = None) -> None:
        """Stop probing and close every channel (pending calls get ``grace_s``)."""
        task, self._task = self._task, None
        self._stalls.stop()
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        await asyncio.gather(*(w.client.close(grace_s) for w in self._workers.values()))

    def loop_stalled_s(self, since: float, until: float) -> float:
        """How long the event loop could not run between two times of its clock (``gateway.fleet.probe_deadline``)."""
        return self._stalls.stalled_s(since, until)

    def _probe_loop_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("cluster probe loop died", exc_info=task.exception())

    async def _probe_loop(self) -> None:
        # Each worker on its own clock: a probe waiting out its timeout (an unreachable
        # worker) delays no other worker's; that worker is probed again once it ends.
        probes: dict[str, asyncio.Task[None]] = {}
        try:
            while True:
                await asyncio.sleep(self._interval_s)
                probes = {a: t for a, t in probes.items() if not t.done()}
                for worker in list(self._workers.values()):
                    if worker.address not in probes:
                        probes[worker.address] = asyncio.create_task(self._probe(worker, force=False))
        finally:
            for task in probes.values():
                task.cancel()
            await asyncio.gather(*probes.values(), return_exceptions=True)

    # ---- views -----------------------------------------------------------

    def workers(self) -> list[WorkerState]:
        return list(self._workers.values())

    def worker(self, address: str) -> WorkerState | None:
        return self._workers.get(address)

    def models(self) -> Mapping[str, ModelInfo]:
        """Models served by at least one READY worker: a read-only snapshot, no copy."""
        # The dict is replaced, never mutated, on every change; a caller holding
        # the proxy keeps a consistent snapshot.
        return MappingProxyType(self._models)

    def model(self, name: str) -> ModelInfo | None:
        return self._models.get(name)

    def known_models(self) -> dict[str, WorkerModel]:
        """Every model any worker reported last, DOWN workers included (for 'unavailable' vs 'not found')."""
        known: dict[str, WorkerModel] = {}
        for w in self._workers.values():
            for name, wm in w.models.items():
                known.setdefault(name, wm)
        return known

    def healthy(self, model: str, version: str = "") -> Sequence[WorkerState]:
        """READY workers serving ``model`` (``version``, if given). Hot path: no copies."""
        info = self._models.get(model)
        if info is None:
            return ()
        if not version:
            return info.replicas
        return tuple(w for w in info.replicas if version in w.models[model].versions)

    def on_change(self, listener: ChangeListener) -> Callable[[], None]:
        """Call ``listener()`` after every change of the model map or a worker's state; returns an unsubscriber."""
        self._listeners.append(listener)

        def unsubscribe() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return unsubscribe

    # ---- membership ------------------------------------------------------

    async def add_worker(self, spec: WorkerSpec) -> WorkerState:
        """Add a worker (no-op if its address is known) and probe it before returning."""
        existing = self._workers.get(spec.address)
        if existing is not None:
            return existing
        worker = WorkerState(spec, self._client_factory(spec))
        self._workers[spec.address] = worker
        log.info("worker %s (%s) added", spec.address, spec.kind)
        probe = asyncio.ensure_future(self._probe(worker, force=True))
        self._joining.add(probe)
        probe.add_done_callback(self._joining.discard)
        await asyncio.shield(probe)
        return worker

    async def joined(self, timeout_s: float) -> bool:
        """Wait (up to ``timeout_s``) for the first probes of workers joining now; True when there were any.

        A worker registered through another gateway process is listed here before its
        models are: a request for a model it brings waits for that, not "unknown model".
        """
        if not self._joining:
            return False
        await asyncio.wait(set(self._joining), timeout=max(0.0, timeout_s))
        return True

    async def remove_worker(self, address: str, grace_s: float | None = 5.0) -> bool:
        """Forget a worker; calls already on its channel get ``grace_s`` to finish."""
        worker = self._workers.pop(address, None)
        if worker is None:
            return False
        log.info("worker %s removed", address)
        worker.state = WorkerStatus.DOWN
        self._changed()
        await worker.client.close(grace_s)
        return True

    def set_draining(self, address: str, draining: bool = True) -> None:
        """A draining worker takes no new batches; probing keeps it DRAINING while it lives."""
        worker = self._workers[address]
        worker.draining = draining
        if worker.state is not WorkerStatus.DOWN:
            worker.state = WorkerStatus.DRAINING if draining else WorkerStatus.READY
            self._changed()

    def mark_down(self, worker: WorkerState, reason: str) -> None:
        """Take a worker out of rotation now (its connection failed); probing brings it back."""
        if worker.state is WorkerStatus.DOWN or self._workers.get(worker.address) is not worker:
            return
        worker.state = WorkerStatus.DOWN
        worker.consecutive_failures = max(worker.consecutive_failures, self._failures_to_down)
        worker.last_error = reason
        log.warning("worker %s marked DOWN: %s", worker.address, reason)
        self._changed()

    def model_gone(self, worker: WorkerState, name: str, reason: str) -> None:
        """``worker`` answered that it does not serve ``name`` now: take it out of that model's rotation.

        The next probe re-reads the worker's models and brings the model back if it returns.
        """
        if name not in worker.models or self._workers.get(worker.address) is not worker:
            return
        # Replaced, not mutated: readers may hold the old dict.
        worker.models = {n: m for n, m in worker.models.items() if n != name}
        worker.index = frozenset()
        log.warning("worker %s no longer serves model %s: %s", worker.address, name, reason)
        self._changed()

    async def refresh(self, address: str | None = None) -> None:
        """Probe now, re-reading every model's config and metadata (after a load or unload)."""
        if address is None:
            await self._probe_all(force=True)
        else:
            await self._probe(self._workers[address], force=True)

    # ---- probing -----------------------------------------------------------

    async def _probe_all(self, force: bool) -> None:
        workers = list(self._workers.values())
        await asyncio.gather(*(self._probe(w, force) for w in workers))

    async def _probe(self, worker: WorkerState, force: bool) -> None:
        async with worker.probe_lock:
            try:
                # Judged by what it waited on: not the gateway's own stalls, and a worker busy
                # with calls of ours (a large message parsed on its loop) gets two timeouts more.
                result = await within(self._read_worker(worker, force), self._probe_timeout_s, self._stalls,
                                      busy=lambda: worker.inflight > 0)
            except (InferGateError, asyncio.TimeoutError) as e:
                self._probe_failed(worker, str(e) or "probe timed out")
                return
            except Exception as e:  # noqa: BLE001 - a probe bug must not kill the loop
                log.exception("probe of worker %s raised", worker.address)
                self._probe_failed(worker, f"probe error: {e!r}")
                return
            if self._workers.get(worker.address) is worker:
                self._probe_succeeded(worker, *result)

    async def _read_worker(
        self, worker: WorkerState, force: bool
    ) -> tuple[frozenset[tuple[str, str]], dict[str, WorkerModel] | None]:
        """The worker's READY index, and its models' details when they may have changed (else None)."""
        # Each call's own deadline is wide: ``within`` (in _probe) judges the probe's time.
        client, timeout_s = worker.client, 3 * self._probe_timeout_s
        await check_health(client, worker.kind, timeout_s)
        index = await ready_index(worker, timeout_s, self._lookup_names)
        if not worker.is_up:
            await client.data_lane_ready(timeout_s)
        if not force and worker.is_up and index == worker.index:
            return index, None
        names = sorted({name for name, _ in index})
        details = await asyncio.gather(*(read_model(client, name, timeout_s) for name in names))
        models: dict[str, WorkerModel] = {}
        for name, detail in zip(names, details):
            if detail is None:
                continue
            config, metadata = detail
            versions = {v for n, v in index if n == name and v} or set(metadata.versions)
            models[name] = WorkerModel(
                name, tuple(sorted(versions, key=version_key)), config, metadata, execution_slots(config))
        return index, models

    def _lookup_names(self) -> set[str]:
        """Names to ask a worker with no readable index about: configured hints and other workers' models."""
        names = set(self._model_hints)
        for other in self._workers.values():
            names.update(other.models)
        return names

    def _probe_succeeded(
        self, worker: WorkerState, index: frozenset[tuple[str, str]], models: dict[str, WorkerModel] | None
    ) -> None:
        changed = False
        if worker.state is WorkerStatus.DOWN:
            worker.state = WorkerStatus.DRAINING if worker.draining else WorkerStatus.READY
            changed = True
            log.info("worker %s is %s", worker.address, worker.state.name)
        worker.consecutive_failures = 0
        worker.last_error = ""
        worker.index = index
        if isinstance(worker.client, ReportsLoad):
            worker.server_load = worker.client.server_load()
        if models is not None and models != worker.models:
            worker.models = models
            changed = True
        if changed:
            self._changed()

    def _probe_failed(self, worker: WorkerState, reason: str) -> None:
        worker.consecutive_failures += 1
        worker.last_error = reason
        # Log transitions, not every failed probe of a worker that stays down.
        if worker.state is WorkerStatus.DOWN:
            if worker.consecutive_failures == 1:
                log.warning("worker %s is unreachable: %s", worker.address, reason)
            else:
                log.debug("worker %s still down: %s", worker.address, reason)
            return
        if worker.consecutive_failures < self._failures_to_down:
            log.info(
                "probe of worker %s failed (%d/%d): %s",
                worker.address, worker.consecutive_failures, self._failures_to_down, reason,
            )
            return
        worker.state = WorkerStatus.DOWN
        log.warning("worker %s marked DOWN after %d failed probes: %s", worker.address, worker.consecutive_failures, reason)
        self._changed()

    # ---- the model map -------------------------------------------------------

    def _changed(self) -> None:
        self._models = self._build_models()
        for listener in list(self._listeners):
            try:
                listener()
            except Exception:  # noqa: BLE001 - one listener's bug must not stop the others
                log.exception("cluster change listener %r failed", listener)

    def _build_models(self) -> dict[str, ModelInfo]:
        replicas: dict[str, list[WorkerState]] = {}
        for w in self._workers.values():
            if w.state is WorkerStatus.READY:
                for name in w.models:
                    replicas.setdefault(name, []).append(w)
        models: dict[str, ModelInfo] = {}
        for name, ws in replicas.items():
            # Config and metadata of the first worker (in the order workers were
            # added) so the view does not flap between replicas that differ.
            # Backends and instances may differ (our worker beside a Triton
            # server); the signature should not.
            first = ws[0].models[name]
            config = first.config
            if any(_signature(w.models[name].config) != _signature(config) for w in ws[1:]):
                log.warning("model %s: workers disagree on its inputs or outputs; using %s's", name, ws[0].address)
            sizes = {w.models[name].config.max_batch_size for w in ws}
            if len(sizes) > 1 and min(sizes) > 0:
                # Every batch must fit every replica it may be sent to.
                config = model_config_pb2.ModelConfig()
                config.CopyFrom(first.config)
                config.max_batch_size = min(sizes)
            versions = {v for w in ws for v in w.models[name].versions}
            models[name] = ModelInfo(name, tuple(sorted(versions, key=version_key)), config, first.metadata, tuple(ws))
        return models


def _signature(config: model_config_pb2.ModelConfig) -> tuple[object, ...]:
    """What requests to a model depend on: its tensors and whether it batches."""
    return (
        tuple(i.SerializeToString(deterministic=True) for i in config.input),
        tuple(o.SerializeToString(deterministic=True) for o in config.output),
        config.max_batch_size > 0,
    )
