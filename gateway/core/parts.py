"""The parts a ``Gateway`` works with (``GatewayParts``) and the seams where
several gateway processes differ from one.

``gateway.composition`` builds every part from the config and hands the
record to ``Gateway``; nothing in the core builds a collaborator. Two seams
are the core's own:

- ``StatisticsScope``: whose statistics a statistics request answers with:
  this process's (``LocalStatistics``) or every process's summed
  (``gateway.multiproc.group.GroupStatistics``);
- ``ModelControl``: who acts on a client's load or unload: this process
  (``LocalModelControl``) or the leader of several on its behalf, every
  process re-reading the workers after (``gateway.multiproc.group.GroupModelControl``).

Several-process mode's placement (a follower's) and trace settings (alike in
every process) arrive through the parts themselves (``fleet``, ``tracing``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from tritonclient.grpc import service_pb2

from gateway.batching.registry import Batchers
from gateway.caching.response_cache import ResponseCache
from gateway.ensembles.runner import Ensembles
from gateway.fleet.cluster import Cluster
from gateway.fleet.manager import Fleet
from gateway.limits import Admission
from gateway.observability.latency import LatencyHistograms
from gateway.observability.stats import GatewayStats
from gateway.observability.streams import StreamStats
from gateway.observability.tracing import RequestTracing
from gateway.parallel.generation import SplitDecoders
from gateway.parallel.serving import ParallelModels
from gateway.requests.classification import LabelFiles
from gateway.routing.router import Router
from gateway.routing.sequences import SequenceRoutes
from gateway.settings import GatewayConfig

class StatisticsScope(Protocol):
    """Whose statistics ``model_statistics`` answers with: this process's alone, or every process's summed."""

    async def whole(self, local: service_pb2.ModelStatisticsResponse, name: str,
                    version: str) -> service_pb2.ModelStatisticsResponse: ...


class ModelControl(Protocol):
    """Who acts on a client's load or unload: this process, or the leader of several on its behalf."""

    async def forward_load(self, name: str, parameters: dict[str, service_pb2.ModelRepositoryParameter]) -> bool:
        """True when another process did the load (this one does nothing more)."""

    async def forward_unload(self, name: str, unload_dependents: bool) -> bool:
        """True when another process did the unload."""

    async def changed(self, name: str, load: service_pb2.RepositoryModelLoadRequest | None) -> None:
        """After this process loaded (``load``: the request) or unloaded (None) ``name``: whoever else
        serves must learn of it."""


class LocalStatistics:
    """One gateway process: its own statistics are the whole gateway's."""

    async def whole(self, local: service_pb2.ModelStatisticsResponse, name: str,
                    version: str) -> service_pb2.ModelStatisticsResponse:
        return local


class LocalModelControl:
    """One gateway process: it acts on every load and unload itself, and no one else needs telling."""

    async def forward_load(self, name: str, parameters: dict[str, service_pb2.ModelRepositoryParameter]) -> bool:
        return False

    async def forward_unload(self, name: str, unload_dependents: bool) -> bool:
        return False

    async def changed(self, name: str, load: service_pb2.RepositoryModelLoadRequest | None) -> None:
        return None


@dataclass(frozen=True, slots=True)
class GatewayParts:
    """Everything the gateway works with, built by ``gateway.composition``."""

    config: GatewayConfig
    cluster: Cluster
    router: Router
    admission: Admission  # gateway-wide bounds on admitted requests (requests and bytes in flight)
    parallel: ParallelModels  # logical models split across workers: their batches run through plans
    decoders: SplitDecoders  # split generation models: their decoding loops run here, their steps as plans
    fleet: Fleet  # membership beyond the static list, placement and model lifecycle
    batchers: Batchers  # one batcher per (model, version), made on its first request
    stats: GatewayStats
    latency: LatencyHistograms  # end-to-end latency per model, for /metrics and the dashboard
    sequences: SequenceRoutes  # stateful models: each sequence pinned to the worker holding its state
    cache: ResponseCache  # Triton's response cache (off at cache_size 0)
    ensembles: Ensembles  # each step runs as a request of its own through ``Gateway.run_request``
    labels: LabelFiles  # label files of the classification extension
    tracing: RequestTracing  # Triton's trace extension: the settings served, the traces taken
    statistics: StatisticsScope
    control: ModelControl
    streams: StreamStats = field(default_factory=StreamStats)  # decoupled models' streams, for /metrics

