"""The gateway's inference core: what both frontends call (``InferenceCore``).

It owns the request path behind the frontends: resolve the model from the
cluster's view, validate, set the deadline, queue the request in the model's
batcher, and turn each batch into one routed worker call. It also answers
metadata, statistics and repository requests from the cluster's view.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from tritonclient.grpc import model_config_pb2, service_pb2

from gateway import __version__
from gateway.batching.assembly import build_batch_request, split_batch_response
from gateway.batching.batcher import Batcher, BatchPolicy
from gateway.caching.response_cache import Lookup, ResponseCache, cache_enabled, fill_statistics
from gateway.ensembles.plan import is_ensemble
from gateway.ensembles.readiness import missing_step
from gateway.ensembles.runner import Ensembles, StepRun
from gateway.fleet import repository
from gateway.fleet.cluster import Cluster
from gateway.fleet.manager import Fleet
from gateway.fleet.readiness import unservable
from gateway.frontends.classification import LabelFiles, apply_classification
from gateway.frontends.validation import validate_request
from gateway.limits import Admission
from gateway.observability.latency import LatencyHistograms
from gateway.observability.stats import GatewayStats
from gateway.observability.trace_settings import TraceSettings, trace_config
from gateway.observability.tracing import RequestTracing
from gateway.parallel.serving import ParallelModels
from gateway.routing.light import RowCosts
from gateway.routing.outlier import OutlierDetector
from gateway.routing.retry_budget import RetryBudget
from gateway.routing.router import Router
from gateway.routing.sequences import SequenceRoutes, is_stateful
from gateway.security.setup import worker_client_factory
from gateway.settings import GatewayConfig
from gateway.types import InferRequest, InferResponse
from protos.errors import InferGateError, Internal, InvalidArgument, ModelNotFound, Unavailable

log = logging.getLogger(__name__)

EXTENSIONS = [
    "model_repository", "model_repository(unload_dependents)", "schedule_policy", "model_configuration", "statistics",
    "binary_tensor_data", "parameters", "system_shared_memory", "logging", "classification", "trace",
]


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def _version_key(v: str) -> tuple[int, str]:
    return (int(v), v) if v.isdigit() else (-1, v)


class Gateway:
    """Implements ``gateway.types.InferenceCore`` over a cluster of workers."""

    def __init__(self, config: GatewayConfig, *, cluster: Cluster | None = None, router: Router | None = None) -> None:
        self.config = config
        self.cluster = cluster or Cluster(
            config.workers,
            probe_interval_s=config.probe.interval_s,
            failures_to_down=config.probe.failures_to_down,
            probe_timeout_s=config.probe.timeout_s,
            model_hints=tuple(config.models),
            # The worker token and TLS credentials, when configured.
            client_factory=worker_client_factory(config),
        )
        retry = config.retry
        self.router = router or Router(
            self.cluster,
            max_inflight_per_replica=config.batching.max_inflight_per_replica,
            busy_inflight_per_replica=config.batching.busy_inflight_per_replica,
            retry_limit=retry.limit,
            retry_backoff_s=retry.backoff_base_s,
            retry_backoff_max_s=retry.backoff_max_s,
            retry_budget=RetryBudget.from_settings(retry),
            outliers=OutlierDetector(config.outlier),
            hedging=config.hedge, per_model=config.models, row_costs=RowCosts(config.batching.light_row_ms / 1000),
        )
        # Gateway-wide bounds on admitted requests (requests and bytes in flight).
        self.admission = Admission(config.admission)
        # Logical models split across workers (config `models.<name>.from/path`):
        # their batches run through the registry's plans instead of one routed call.
        self.parallel = ParallelModels(config, self.cluster, self.router)
        # Membership beyond the static list (DNS, registration), placement and
        # model lifecycle, draining. `placement` is read by the metrics (moves).
        self.fleet = Fleet(config, self.cluster)
        self.placement = self.fleet.placement
        self.stats = GatewayStats()
        # Stateful models (sequence_batching): each sequence pinned to the worker holding its state.
        self.sequences = SequenceRoutes(self.cluster, self.router)
        # Triton's response cache, for models whose config enables it (off at cache.size_bytes 0).
        self.cache = ResponseCache(config.cache.size_bytes)
        # Ensembles (platform "ensemble"): each step runs as a request of its own through _infer.
        self.ensembles = Ensembles(self._infer)
        # End-to-end latency distribution per model, for /metrics and the dashboard.
        self.latency = LatencyHistograms()
        # Label files of the classification extension, read from the repository the gateway knows.
        self.labels = LabelFiles(config.model_repository)
        # Triton's trace extension: the settings the frontends serve, and the traces they and _run_batch take.
        self.tracing = RequestTracing(TraceSettings(trace_config(config), known_model=self.model_ready))
        self._batchers: dict[tuple[str, str], Batcher] = {}
        self._accepting = False
        self._shutting_down = False
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- lifecycle -------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self.cluster.start()
        try:
            await self.fleet.start()
            await self.parallel.start()
        except BaseException:
            await self.fleet.stop()
            await self.cluster.stop()
            raise
        self._accepting = True

    def begin_shutdown(self) -> None:
        """Not ready from now on (requests already on their way are still served until ``stop``)."""
        self._shutting_down = True

    async def stop(self, grace_s: float | None = None) -> None:
        """Stop taking requests, let queued ones finish within the grace period, close."""
        grace = self.config.shutdown_grace_s if grace_s is None else grace_s
        self._shutting_down = True
        self._accepting = False
        batchers = list(self._batchers.values())
        self._batchers.clear()
        if batchers:
            await asyncio.gather(*(b.close(grace) for b in batchers), return_exceptions=True)
        await self.fleet.stop()
        await self.parallel.stop()
        self.sequences.close()
        await self.cluster.stop()

    def batchers(self) -> dict[tuple[str, str], Batcher]:
        """The live batchers by (model, version), for metrics: a copy, safe to iterate."""
        return dict(self._batchers)

    # ---- model resolution ------------------------------------------------

    def _model(self, name: str, version: str = "") -> tuple[Any, str]:
        info = self.parallel.model(name) or self.cluster.model(name)
        if info is None:
            if name in self.cluster.known_models():
                # Known but every replica is down (e.g. a worker restarting): retryable.
                raise Unavailable(f"model '{name}' has no healthy replica right now")
            raise ModelNotFound(f"Request for unknown model: '{name}' is not found")
        versions = info.versions
        if version:
            if version not in versions:
                raise ModelNotFound(f"Request for unknown model: '{name}' version {version} is not found")
            return info, version
        # Per request: the newest version without sorting them all.
        return info, (max(versions, key=_version_key) if versions else "")

    async def _resolve(self, name: str, version: str, timeout_us: int) -> tuple[Any, str]:
        """``_model``, placing the model first when it has no replica and may be
        placed on request (declared with replicas, or ``load_on_demand``)."""
        try:
            return self._model(name, version)
        except (ModelNotFound, Unavailable):
            if not self.fleet.placement.can_load(name):
                raise
        await self.fleet.placement.ensure(name, timeout_us / 1e6 if timeout_us else self.config.default_timeout_s)
        return self._model(name, version)

    async def _batcher(self, name: str, version: str, config: model_config_pb2.ModelConfig) -> Batcher:
        key = (name, version)
        batcher = self._batchers.get(key)
        if batcher is None:
            info = self.cluster.model(name)
            policy = BatchPolicy.from_model_config(
                config,
                self.config.batching_settings(name),
                default_mode=self.config.batching.mode,
                # Only the default: the model's own queue policy wins, the gateway config's entry for it wins over both.
                default_max_queue_size=self.config.batching.max_queue_size,
                # Triton servers run the config's dynamic batcher themselves.
                backend_batches=info is not None and all(w.kind == "triton" for w in info.replicas),
            )
            batched = policy.max_batch_size > 0
            # Under a queue timeout a batch never waits for a replica outside the batcher (see Batcher).
            wait_for_slot = not policy.has_queue_timeouts

            async def dispatch(batch: list[InferRequest]) -> list[InferResponse]:
                return await self._run_batch(name, version, batch, batched, wait_for_slot=wait_for_slot)

            capacity = self.parallel.capacity(name) if self.parallel.serves(name) else self.router.capacity(name, version)
            batcher = Batcher(f"{name}:{version}", policy, dispatch, capacity)
            self._batchers[key] = batcher
            await batcher.start()
        return batcher

    # ---- inference -------------------------------------------------------

    async def infer(self, request: InferRequest) -> InferResponse:
        # The gateway-wide bounds come first: beyond them a request is refused at once.
        with self.admission.admit(request):
            return await self._infer(request)

    async def _infer(self, request: InferRequest) -> InferResponse:
        loop = asyncio.get_running_loop()
        now = loop.time()
        # Durations for the statistics come from time.monotonic(): the same clock
        # as loop.time() under asyncio and uvloop, but uvloop's loop.time() is
        # cached per loop turn in whole milliseconds, too coarse for latencies.
        started = time.monotonic()
        request.arrival = started
        if not self._accepting:
            raise Unavailable("the gateway is shutting down")
        info, version = await self._resolve(request.model, request.version, request.timeout_us)
        try:
            rows = validate_request(request, info.metadata, info.config)
        except InferGateError as e:
            self.stats.record_failure(request.model, version, 0, type(e).__name__)
            raise
        request.version = version
        timeout_s = request.timeout_us / 1e6 if request.timeout_us else self.config.default_timeout_s
        deadline = now + timeout_s
        request.deadline = deadline if request.deadline is None else min(deadline, request.deadline)
        request.rows = rows
        ensemble = is_ensemble(info.config)
        if not ensemble:  # an ensemble is placed through its steps
            self.fleet.placement.touch(request.model, rows)  # idle TTL, LRU and request rate
        miss: Lookup | None = None
        if is_stateful(info.config):
            return await self._infer_in_sequence(request, info.config, version, rows, started)
        if self.cache.enabled and cache_enabled(info.config):
            # A hit is answered here: it never reaches a batcher, so batches hold only misses.
            found = self.cache.lookup(request)
            if isinstance(found, InferResponse):
                total_s = time.monotonic() - started
                self.stats.record_cache_hit(request.model, version, _ns(total_s))
                self.latency.observe(request.model, version, total_s)
                return apply_classification(request, found, info.config, self.labels)
            miss = found
        try:
            if ensemble:
                # Each step is a request of its own through this path; the deadline set above covers them all.
                runs: list[StepRun] = []
                try:
                    response = await self.ensembles.run(self.ensembles.plan(info.config), request, runs)
                finally:  # its queue time is its steps' (Triton's counts; see observability.stats)
                    request.dispatched = started + self.stats.record_ensemble(request.model, version, rows, runs) / 1e9
            else:
                batcher = await self._batcher(request.model, version, info.config)
                # However long its batch runs for others, a request is answered by its deadline:
                # the batcher keeps each request's deadline on its one timer heap, queued or running.
                response = await batcher.submit(request)
        except InferGateError as e:
            self._cache_failed(miss)
            self.stats.record_failure(request.model, version, _ns(time.monotonic() - started), type(e).__name__)
            raise
        except asyncio.CancelledError:
            self._cache_failed(miss)
            self.stats.record_failure(request.model, version, _ns(time.monotonic() - started), "Cancelled")
            raise
        if miss is not None:
            self.cache.insert(miss, response)
        # After the cache: it holds the model's outputs, whatever form each request asks for.
        response = apply_classification(request, response, info.config, self.labels)
        queue_ns = _ns(max(0.0, request.dispatched - started))
        total_s = time.monotonic() - started
        self.stats.record_success(request.model, version, rows, _ns(total_s), queue_ns)
        self.latency.observe(request.model, version, total_s)
        return response

    async def _infer_in_sequence(
        self, request: InferRequest, config: model_config_pb2.ModelConfig, version: str, rows: int, started: float
    ) -> InferResponse:
        """A request of a stateful sequence: alone, in order, on the worker holding the sequence (no cache, no batch)."""
        request.dispatched = started
        try:
            response = await self.sequences.infer(request, config)
        except InferGateError as e:
            self.stats.record_failure(request.model, version, _ns(time.monotonic() - started), type(e).__name__)
            raise
        total_s = time.monotonic() - started
        self.stats.record_execution(request.model, version, rows, _ns(total_s))
        self.stats.record_success(request.model, version, rows, _ns(total_s), 0)
        self.latency.observe(request.model, version, total_s)
        return response

    def _cache_failed(self, miss: Lookup | None) -> None:
        if miss is not None:
            self.cache.record_miss(miss)

    async def _run_batch(
        self, name: str, version: str, batch: list[InferRequest], batched: bool, *, wait_for_slot: bool = True
    ) -> list[InferResponse]:
        start = time.monotonic()
        for r in batch:
            r.dispatched = start
        rows = [r.rows for r in batch]
        # Split models read the message's contents: they get them inside it.
        pb = build_batch_request(name, version, batch, rows, batched, raw_aside=not self.parallel.serves(name))
        deadlines = [r.deadline for r in batch if r.deadline is not None]
        # The batch may live as long as its most patient member; members whose
        # deadline passes while queued were dropped by the batcher already.
        deadline = max(deadlines) if deadlines else None
        try:
            with self.tracing.batch(batch, name):
                if self.parallel.serves(name):
                    response = await self.parallel.infer(name, version, pb, deadline)
                else:
                    response = await self.router.infer(name, version, pb, deadline, wait_for_slot=wait_for_slot)
        except (InvalidArgument, Internal):
            if len(batch) == 1:
                raise
            # The worker refused the batch for something in its rows (e.g. a
            # token id out of range): run each request alone so one client's
            # bad row does not fail its batch-mates.
            return await self._run_alone(name, version, batch, batched)
        self.stats.record_execution(name, version, sum(rows), _ns(time.monotonic() - start), len(batch))
        responses = split_batch_response(response, batch, rows, batched)
        if len(responses) != len(batch):
            raise Internal(f"batch of {len(batch)} requests produced {len(responses)} responses")
        return responses

    async def _run_alone(
        self, name: str, version: str, batch: list[InferRequest], batched: bool
    ) -> list[InferResponse | BaseException]:
        """Each request of a refused batch on its own; the batcher answers each with its outcome."""
        outcomes = await asyncio.gather(
            *(self._run_batch(name, version, [r], batched) for r in batch), return_exceptions=True
        )
        return [o if isinstance(o, BaseException) else o[0] for o in outcomes]

    # ---- health and metadata ----------------------------------------------

    def server_live(self) -> bool:
        return True

    def server_ready(self) -> bool:
        """Up and not shutting down; with strict readiness, also nothing in :meth:`unservable`."""
        if not self._accepting or self._shutting_down:
            return False
        return not self.config.strict_readiness or not self.unservable()

    def unservable(self) -> dict[str, str]:
        """What the gateway is asked to serve and cannot now (``gateway.fleet.readiness``)."""
        problems = unservable(self.cluster, self.fleet.placement.book, self.parallel.index_entries())
        for name, info in self.cluster.models().items():  # an ensemble is servable when its steps are
            if is_ensemble(info.config) and (why := self._missing_step(info.config)) is not None:
                problems.setdefault(name, why)
        return problems

    def server_metadata(self) -> service_pb2.ServerMetadataResponse:
        return service_pb2.ServerMetadataResponse(name="infergate", version=__version__, extensions=EXTENSIONS)

    def model_ready(self, name: str, version: str = "") -> bool:
        try:
            info, _ = self._model(name, version)
        except ModelNotFound:
            return False
        return not is_ensemble(info.config) or self._missing_step(info.config) is None

    def _missing_step(self, config: model_config_pb2.ModelConfig) -> str | None:
        """Why an ensemble cannot run now (``gateway.ensembles.readiness``), or None."""
        return missing_step(config, self.ensembles.plan, self._servable_config)

    def _servable_config(self, name: str, version: str) -> model_config_pb2.ModelConfig | None:
        try:
            return self._model(name, version)[0].config
        except (ModelNotFound, Unavailable):
            return None

    def model_metadata(self, name: str, version: str = "") -> service_pb2.ModelMetadataResponse:
        info, _ = self._model(name, version)
        md = service_pb2.ModelMetadataResponse()
        md.CopyFrom(info.metadata)
        md.versions[:] = sorted(info.versions, key=_version_key)
        return md

    def model_config(self, name: str, version: str = "") -> model_config_pb2.ModelConfig:
        info, _ = self._model(name, version)
        return info.config

    async def model_statistics(self, name: str = "", version: str = "") -> service_pb2.ModelStatisticsResponse:
        if name:
            _, resolved = self._model(name, version)
            version = resolved
        known = [(m, max(info.versions, key=_version_key)) for m, info in self.cluster.models().items() if info.versions]
        known += [(e.name, e.version) for e in self.parallel.index_entries() if self.parallel.model(e.name)]
        response = self.stats.to_proto(name, version, known)
        fill_statistics(response, self.cache.counters())
        config = self.model_config(name) if name else None
        if config is not None and is_ensemble(config):  # after the ensemble's entry, its steps' shares
            steps = [(s.index, s.model, s.version or self._latest(s.model)) for s in self.ensembles.plan(config).steps]
            self.stats.add_step_entries(response, steps)
        return response

    def _latest(self, name: str) -> str:
        try:
            return self._model(name)[1]
        except (ModelNotFound, Unavailable):
            return ""

    async def worker_statistics(self, name: str = "", version: str = "") -> list[repository.WorkerStatistics]:
        """Each worker's own statistics of ``name`` (all models when empty): Triton's, or our worker's."""
        if name:
            self._model(name, version)
        return await repository.worker_statistics(self.cluster, name, version)

    # ---- repository --------------------------------------------------------

    async def repository_index(self, ready_only: bool = False) -> service_pb2.RepositoryIndexResponse:
        index = await repository.merged_index(self.cluster, ready_only)
        # Logical models are listed with the shard models their workers report.
        index.models.extend(e for e in self.parallel.index_entries() if not ready_only or e.state == "READY")
        return index

    def _check_model_control(self) -> None:
        if self.config.model_control_mode != "explicit":
            # Triton's words and code (UNAVAILABLE) for a server without explicit model control.
            raise Unavailable("explicit model load / unload is not allowed if polling is enabled")

    async def load_model(self, name: str, parameters: dict[str, service_pb2.ModelRepositoryParameter]) -> None:
        self._check_model_control()
        if self.parallel.serves(name):
            await self.parallel.load(name)  # re-split the source and push what changed
            return
        self.fleet.placement.note_load(name)
        self.cache.clear(name)  # a reload may answer differently
        await repository.load(self.cluster, name, parameters)

    async def unload_model(self, name: str, unload_dependents: bool = False) -> None:
        self._check_model_control()
        if self.parallel.serves(name):
            await self.parallel.unload(name)
        else:
            self.fleet.placement.note_unload(name)
            await repository.unload(self.cluster, name, unload_dependents)
        self.cache.clear(name)
        for key in [k for k in self._batchers if k[0] == name]:
            batcher = self._batchers.pop(key)
            await batcher.close(self.config.shutdown_grace_s)
