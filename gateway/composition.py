"""The composition root: every part of the gateway, built from the config in one place.

``build_gateway`` reads the config, builds the parts (cluster, router,
admission, split models, fleet with its placement, batchers, statistics,
latency, sequences, response cache, ensembles, label files, tracing) and
hands each core part (``Gateway``, ``ModelCatalog``, ``RequestPipeline``,
``StreamPath``) the parts it calls and the settings it reads
(``core_settings``); no record of everything is passed, and no module below
reads the whole config: each is given its settings group or a few values.
The core builds none of its own parts. Where
a setup differs, it passes different parts through the same seams
(``Seams``) instead of subclassing or patching the core: several gateway
processes (``gateway.multiproc``) supply a follower's placement, statistics
summed over the processes, repository control taken by the leader and trace
settings alike in every process (``group_seams``).

``compose`` adds what the frontends share beside the core (the clients'
shared-memory regions and the log settings: replicated among several
processes) and is what ``gateway.app`` calls. Tests build gateways here too,
passing a cluster or router of their own.

With ``local.enabled`` (``infergate serve``) it builds the local replica
(``gateway.replicas.local``: the repository's models run in this
process) and hands it to the cluster as one more worker, and the router a
choice policy that tries it first (``LocalFirst``). Streams of generative
models are routed by their prompt's prefix (``gateway.routing.prefix``): the
router's policy wraps the least loaded one, and the stream path hands it the
prompt's key.

May import every gateway package (it sits above the core), except
``gateway.app`` and ``gateway.up``, which import it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tritonclient.grpc import model_config_pb2

from gateway.batching.policy import BatchPolicy
from gateway.batching.registry import Batchers, PolicyFor
from gateway.caching.response_cache import ResponseCache
from gateway.core import CoreSettings, Gateway, LocalModelControl, LocalStatistics, ModelControl, StatisticsScope
from gateway.core.models import ModelCatalog
from gateway.core.pipeline import RequestPipeline
from gateway.core.relay import RelayLanes, RelayPath
from gateway.core.streaming import StreamPath
from gateway.ensembles.runner import Ensembles
from gateway.fleet.cluster import Cluster, ClientFactory
from gateway.replicas.local import LOCAL_SPEC, LocalOptions, LocalReplica
from gateway.fleet.manager import Fleet
from gateway.fleet.placement import PlacementController
from gateway.fleet.registry import Registry
from gateway.frontends.log_settings import LogSettings
from gateway.limits import Admission
from gateway.multiproc.group import FollowerPlacement, GroupModelControl, GroupStatistics
from gateway.multiproc.peers import ProcessGroup
from gateway.multiproc.replicated import GroupLogSettings, GroupRegions, GroupTraceSettings, Replicator
from gateway.observability.latency import LatencyHistograms
from gateway.observability.stats import GatewayStats
from gateway.observability.streams import StreamStats
from gateway.observability.trace_settings import TraceConfig, TraceSettings, trace_config
from gateway.observability.tracing import RequestTracing
from gateway.parallel.generation import SplitDecoders
from gateway.parallel.serving import ParallelModels
from gateway.requests.classification import LabelFiles
from gateway.requests.shared_memory import SharedMemoryRegistry
from gateway.routing.choice import LeastLoaded, LocalFirst, ReplicaChooser
from gateway.routing.light import RowCosts
from gateway.routing.outlier import OutlierDetector
from gateway.routing.prefix import Balance, PrefixAffinity, PrefixStreamRouting
from gateway.routing.retry_budget import RetryBudget
from gateway.routing.router import Router
from gateway.routing.sequences import SequenceRoutes
from gateway.security.setup import worker_client_factory, worker_token
from gateway.replicas.replica import Replica
from gateway.settings import ConfigError, GatewayConfig, WorkerSpec
from gateway.types import InferRequest, InferResponse
from protos.errors import InferGateError

# (the config, the cluster, the fleet's registry) -> the placement controller of a setup.
PlacementFactory = Callable[[GatewayConfig, Cluster, Registry], PlacementController]
# (the config's trace settings, whether a model name is known) -> the trace settings the frontends serve.
TraceSettingsFactory = Callable[[TraceConfig, Callable[[str], bool]], TraceSettings]


@dataclass(frozen=True, slots=True)
class Seams:
    """What a setup supplies in place of the single-process parts; the defaults are one process's."""

    placement: PlacementFactory | None = None  # None: this process's own ``PlacementController`` (``build_placement``)
    statistics: StatisticsScope = LocalStatistics()
    control: ModelControl = LocalModelControl()
    trace_settings: TraceSettingsFactory | None = None  # None: ``TraceSettings`` of this process alone
    process_index: int | None = None  # among several processes: each writes its own trace file


@dataclass(frozen=True, slots=True)
class Composition:
    """The core and what the frontends share beside it, as ``gateway.app`` serves them."""

    gateway: Gateway
    shm: SharedMemoryRegistry  # the clients' shared-memory regions, one registry for both frontends
    logs: LogSettings
    group: ProcessGroup | None = None  # set for a process among several
    replicator: Replicator | None = None  # its extension state, changed in every process
    local: LocalReplica | None = None  # the models this process runs itself (``local.enabled``); started by the app


def compose(config: GatewayConfig, group: ProcessGroup | None = None) -> Composition:
    """One process's gateway; with ``group``, one process among several (``gateway.multiproc``)."""
    if group is None:
        local = build_local(config)
        return Composition(build_gateway(config, local=local), SharedMemoryRegistry(), LogSettings(), local=local)
    replicator = Replicator(group)
    local = build_local(config)  # each process runs its own copy of the repository's models
    gateway = build_gateway(config, seams=group_seams(group, replicator, local), local=local)
    return Composition(gateway, GroupRegions(replicator), GroupLogSettings(replicator), group, replicator, local=local)


def group_seams(group: ProcessGroup, replicator: Replicator, local: LocalReplica | None = None) -> Seams:
    """A process among several: the leader's placement decides (a follower's asks it), statistics
    are summed over the processes, the leader acts on repository control, trace settings are replicated."""

    def follower(config: GatewayConfig, cluster: Cluster, registry: Registry) -> PlacementController:
        return FollowerPlacement(cluster, registry, group, settings=config.placement, autoscale=config.autoscale,
                                 models=config.models, model_repository=config.model_repository)

    def trace_settings(trace: TraceConfig, known_model: Callable[[str], bool]) -> TraceSettings:
        return GroupTraceSettings(trace, known_model, replicator)

    return Seams(placement=None if group.is_leader else follower, statistics=GroupStatistics(group),
                 control=GroupModelControl(group, local), trace_settings=trace_settings, process_index=group.index)


def core_settings(config: GatewayConfig) -> CoreSettings:
    """What the core reads of the config."""
    return CoreSettings(
        server_name=config.server_name,
        strict_readiness=config.strict_readiness,
        model_control_mode=config.model_control_mode,
        shutdown_grace_s=config.shutdown_grace_s,
        default_timeout_s=config.default_timeout_s,
        cluster_join_wait_s=config.probe.timeout_s,  # a joining worker's first probe, at most
    )


def build_gateway(config: GatewayConfig, *, cluster: Cluster | None = None, router: Router | None = None,
                  seams: Seams = Seams(), local: LocalReplica | None = None) -> Gateway:
    """The gateway of ``config``: every part built here (``cluster`` and ``router`` may be given), then the core,
    each core part handed the parts it calls.

    ``local``: a replica in this process, one more member of the cluster, tried first by the router."""
    settings = core_settings(config)
    cluster = cluster or build_cluster(config, local)
    router = router or build_router(config, cluster, local_first=local is not None)
    gateway: Gateway  # bound at the end: two parts call back into the gateway, through these two functions

    def known_model(name: str) -> bool:  # the trace settings' check of a model name
        return gateway.model_ready(name)

    async def run_step(request: InferRequest) -> InferResponse:  # an ensemble's step: a request of its own
        return await gateway.run_request(request)

    trace = trace_config(config.extra)
    trace_settings = (seams.trace_settings(trace, known_model) if seams.trace_settings is not None
                      else TraceSettings(trace, known_model=known_model))
    tracing = RequestTracing(trace_settings, process_index=seams.process_index)
    # Logical models split across workers (config `models.<name>.from/path`).
    parallel = ParallelModels(config.logical_models(), cluster, router, model_repository=config.model_repository,
                              max_inflight_per_replica=config.batching.max_inflight_per_replica)
    decoders = SplitDecoders(parallel)  # split generation models: their decoding loops run here
    make_placement = seams.placement or build_placement
    fleet = Fleet(cluster, lambda c, registry: make_placement(config, c, registry), workers=config.workers,
                  worker_dns=config.worker_dns, membership=config.membership, token=worker_token(config.security))
    batchers = Batchers(batch_policy_for(config))  # one batcher per (model, version), made on its first request
    stats, latency = GatewayStats(), LatencyHistograms()
    sequences = SequenceRoutes(cluster, router)  # stateful models: each sequence pinned to the worker holding it
    cache = ResponseCache(config.cache.size_bytes)  # Triton's response cache (off at cache_size 0)
    ensembles = Ensembles(run_step)
    models = ModelCatalog(cluster, parallel, fleet.placement, ensembles, default_timeout_s=settings.default_timeout_s,
                          cluster_join_wait_s=settings.cluster_join_wait_s)
    streaming = StreamPath(PrefixStreamRouting(router, in_process=decoders), StreamStats(), stats=stats,
                           latency=latency)
    admission = Admission(config.admission)
    # Calls no gateway feature needs to read go on as their bytes (the relay lane), decided per model.
    lanes = RelayLanes(config.relay_mode, router=router, batchers=batchers, cache=cache, parallel=parallel,
                       gateway_batching=lambda name: bool(config.batching_settings(name)))
    relaying = RelayPath(lanes, models, admission=admission, cluster=cluster, router=router, batchers=batchers,
                         sequences=sequences, placement=fleet.placement, stats=stats, latency=latency,
                         default_timeout_s=settings.default_timeout_s)
    pipeline = RequestPipeline(
        models, streaming, admission=admission, cluster=cluster, router=router, parallel=parallel,
        placement=fleet.placement, batchers=batchers, sequences=sequences, cache=cache, ensembles=ensembles,
        # Label files of the classification extension, read from the repository the gateway knows.
        labels=LabelFiles(config.model_repository), tracing=tracing, stats=stats, latency=latency,
        default_timeout_s=settings.default_timeout_s, relaying=relaying)
    gateway = Gateway(
        settings, models, pipeline, cluster=cluster, router=router, fleet=fleet, parallel=parallel, decoders=decoders,
        batchers=batchers, sequences=sequences, cache=cache, ensembles=ensembles, stats=stats, latency=latency,
        tracing=tracing, statistics=seams.statistics, control=seams.control)
    return gateway


def build_placement(config: GatewayConfig, cluster: Cluster, registry: Registry) -> PlacementController:
    """This process's own placement controller (a follower among several processes has its own: ``group_seams``)."""
    return PlacementController(cluster, registry, settings=config.placement, autoscale=config.autoscale,
                               models=config.models, model_repository=config.model_repository)


def build_local(config: GatewayConfig) -> LocalReplica | None:
    """The local replica of ``local.enabled``: the repository's models, loaded when the app starts it."""
    if not config.local.enabled:
        return None
    if not Path(config.model_repository).is_dir():
        raise ConfigError(f"local execution: model repository {config.model_repository} is not a directory")
    try:
        return LocalReplica(LocalOptions.from_settings(config.model_repository, config.local, config.shutdown_grace_s))
    except InferGateError as e:  # e.g. local.device cuda without a usable GPU
        raise ConfigError(f"local execution: {e.message}") from None


def remote_replicas(config: GatewayConfig) -> ClientFactory:
    """Makes each remote worker's replica: with the worker token and TLS when configured, its transports
    (``worker_calls``, ``worker_streams``) and its keepalive period (per kind)."""
    return worker_client_factory(config.security, stream_calls=config.worker_calls == "stream",
                                 packed_streams=config.worker_streams == "packed",
                                 worker_keepalive_s=config.worker_keepalive_s,
                                 triton_keepalive_s=config.triton_keepalive_s)


def build_cluster(config: GatewayConfig, local: LocalReplica | None = None) -> Cluster:
    remote = remote_replicas(config)

    def factory(spec: WorkerSpec) -> Replica:  # the local replica is one more replica, in this process
        return local if local is not None and spec == LOCAL_SPEC else remote(spec)

    return Cluster(
        (LOCAL_SPEC, *config.workers) if local is not None else config.workers,
        probe_interval_s=config.probe.interval_s,
        failures_to_down=config.probe.failures_to_down,
        probe_timeout_s=config.probe.timeout_s,
        model_hints=tuple(config.models),
        client_factory=factory,
    )


def build_router(config: GatewayConfig, cluster: Cluster, *, local_first: bool = False) -> Router:
    retry = config.retry
    # Streams of generative models go where their prompt's prefix went (gateway.routing.prefix).
    affinity = PrefixAffinity(LeastLoaded(), balance=Balance(config.prefix_balance_abs_threshold,
                                                             config.prefix_balance_rel_threshold)) \
        if config.prefix_routing else None
    chooser: ReplicaChooser = affinity or LeastLoaded()
    if local_first:  # the replica in this process while it has a free slot
        chooser = LocalFirst(chooser)
    return Router(
        cluster,
        max_inflight_per_replica=config.batching.max_inflight_per_replica,
        busy_inflight_per_replica=config.batching.busy_inflight_per_replica,
        retry_limit=config.retry.limit,
        retry_backoff_s=retry.backoff_base_s,
        retry_backoff_max_s=retry.backoff_max_s,
        retry_budget=RetryBudget.from_settings(retry),
        outliers=OutlierDetector(config.outlier),
        hedging=config.hedge, per_model=config.models, row_costs=RowCosts(config.batching.light_row_ms / 1000),
        chooser=chooser,  # the replica choice policy
        prefix_affinity=affinity,
    )


def batch_policy_for(config: GatewayConfig) -> PolicyFor:
    """Each model's batching policy: its Triton config, then the gateway config's entry for it."""

    def policy_for(name: str, model_config: model_config_pb2.ModelConfig, backend_batches: bool) -> BatchPolicy:
        return BatchPolicy.from_model_config(
            model_config,
            config.batching_settings(name),
            default_mode=config.batching.mode,
            # Only the default: the model's own queue policy wins, the gateway config's entry for it wins over both.
            default_max_queue_size=config.batching.max_queue_size,
            default_burst_hold_us=config.batching.burst_hold_us,
            # Triton servers run the config's dynamic batcher themselves.
            backend_batches=backend_batches,
        )

    return policy_for
