"""The gateway's core: what both frontends call (``Gateway``, the ``InferenceCore``).

``Gateway`` builds none of its parts: ``gateway.composition`` builds them from
the config and hands in the ones it calls, with the settings it reads
(``CoreSettings``). Inference goes through the
request path in ``gateway.core.pipeline`` (read it first: its docstring walks
one request through every step); model resolution is ``gateway.core.models``.
Here: start and stop in order, health, metadata, statistics and repository
requests, answered from the cluster's view. Where several gateway processes
serve together, statistics and repository control go through the seams in
``gateway.core.parts``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from tritonclient.grpc import model_config_pb2, service_pb2

from gateway import __version__
from gateway.batching.batcher import Batcher
from gateway.batching.registry import Batchers
from gateway.caching.response_cache import ResponseCache, fill_statistics
from gateway.core.models import ModelCatalog, version_key
from gateway.core.parts import CoreSettings, ModelControl, StatisticsScope
from gateway.core.pipeline import RequestPipeline
from gateway.core.relay import RelayVerdict
from gateway.ensembles.plan import is_ensemble
from gateway.ensembles.runner import Ensembles
from gateway.fleet import repository
from gateway.fleet.cluster import Cluster
from gateway.fleet.manager import Fleet
from gateway.fleet.placement import PlacementController
from gateway.fleet.readiness import unservable
from gateway.observability.latency import LatencyHistograms
from gateway.observability.stats import GatewayStats
from gateway.observability.streams import StreamStats
from gateway.observability.tracing import RequestTracing
from gateway.parallel.generation import SplitDecoders
from gateway.parallel.serving import ParallelModels
from gateway.routing.router import Router
from gateway.routing.sequences import SequenceRoutes
from gateway.types import InferRequest, InferResponse, RelayCall
from protos.errors import Unavailable

log = logging.getLogger(__name__)

EXTENSIONS = [
    "model_repository", "model_repository(unload_dependents)", "schedule_policy", "model_configuration", "statistics",
    "binary_tensor_data", "parameters", "system_shared_memory", "logging", "classification", "trace",
]


class Gateway:
    """Implements ``gateway.types.InferenceCore`` over a cluster of workers, with the parts it is given.

    ``models`` and ``pipeline`` are the core's two halves (resolution, the
    request path), built by the composition root with the same parts; nothing
    is made here. ``router``, ``latency`` and ``tracing`` are not called here:
    they are held for the observers (``gateway.observability.observed``) and
    the process wiring, which read them off the gateway.
    """

    def __init__(self, settings: CoreSettings, models: ModelCatalog, pipeline: RequestPipeline, *,
                 cluster: Cluster, router: Router, fleet: Fleet, parallel: ParallelModels, decoders: SplitDecoders,
                 batchers: Batchers, sequences: SequenceRoutes, cache: ResponseCache, ensembles: Ensembles,
                 stats: GatewayStats, latency: LatencyHistograms, tracing: RequestTracing,
                 statistics: StatisticsScope, control: ModelControl) -> None:
        self.settings = settings
        self.cluster = cluster
        self.router = router
        self.fleet = fleet  # membership beyond the static list, placement and model lifecycle
        self.parallel = parallel
        self.decoders = decoders  # split generation models' decoding loops (their figures: the observers')
        self.sequences = sequences
        self.cache = cache
        self.ensembles = ensembles
        self.stats = stats
        self.latency = latency
        self.tracing = tracing  # Triton's trace extension: the settings the frontends serve, the traces taken
        self._batchers = batchers
        self._statistics = statistics
        self._control = control
        self.models = models
        self.pipeline = pipeline
        self._shutting_down = False

    @property
    def streams(self) -> StreamStats:
        """Decoupled models' streams, for /metrics (the stream path's own)."""
        return self.pipeline.streaming.streams

    @property
    def placement(self) -> PlacementController:
        """The fleet's placement (read by the metrics: moves, loads, rounds)."""
        return self.fleet.placement

    # ---- lifecycle -------------------------------------------------------

    async def start(self) -> None:
        await self.cluster.start()
        try:
            await self.fleet.start()
            await self.parallel.start()
        except BaseException:
            await self.fleet.stop()
            await self.cluster.stop()
            raise
        self.pipeline.accepting = True

    def begin_shutdown(self) -> None:
        """Not ready from now on (requests already on their way are still served until ``stop``)."""
        self._shutting_down = True

    async def stop(self, grace_s: float | None = None) -> None:
        """Stop taking requests, let queued ones finish within the grace period, close."""
        grace = self.settings.shutdown_grace_s if grace_s is None else grace_s
        self._shutting_down = True
        self.pipeline.accepting = False
        loop = asyncio.get_running_loop()
        until = loop.time() + grace
        await self._batchers.close_all(grace)
        # Open streams end (within the grace) before the workers' channels close under them.
        await self.pipeline.streaming.wait_closed(until - loop.time())
        await self.fleet.stop()
        self.decoders.close()
        await self.parallel.stop()
        self.sequences.close()
        await self.cluster.stop()

    def batchers(self) -> dict[tuple[str, str], Batcher]:
        """The live batchers by (model, version), for metrics: a copy, safe to iterate."""
        return self._batchers.snapshot()

    # ---- inference (gateway.core.pipeline) ----------------------------------

    async def infer(self, request: InferRequest) -> InferResponse:
        return await self.pipeline.infer(request)

    def relays(self, model: str, version: str = "") -> bool:
        return self.pipeline.relays(model, version)

    async def relay(self, call: RelayCall) -> bytes:
        return await self.pipeline.relay(call)

    def relay_lanes(self) -> dict[str, RelayVerdict]:
        """Each ready model's relay verdict (``gateway.core.relay``), for ``/v2/cluster``."""
        lanes = self.pipeline.relaying.lanes
        return {name: lanes.verdict(name, info) for name, info in self.cluster.models().items()}

    def relayed_calls(self) -> dict[str, int]:
        """Each model's calls routed on the relay lane so far (a model relayed only while idle sends the
        rest on the full path), for ``/v2/cluster``."""
        return dict(self.pipeline.relaying.calls)

    def stream(self, request: InferRequest) -> AsyncIterator[InferResponse]:
        """The request's responses as its worker sends them (``gateway.core.streaming``); the last is
        ``final``. An ordinary model's request yields its one response. The worker's empty final
        response is dropped unless ``request.parameters`` holds ``triton_enable_empty_final_response``
        true. Close the iterator when done (``contextlib.aclosing``): that cancels the worker's call."""
        return self.pipeline.stream(request)

    def stream_written(self, response: InferResponse) -> None:
        """A frontend wrote a streamed response to its client (the forwarding gap is measured)."""
        self.pipeline.streaming.forwarded(response)

    async def run_request(self, request: InferRequest) -> InferResponse:
        """An admitted request (an ensemble's steps are): the request path after admission."""
        return await self.pipeline.run_request(request)

    # ---- health and metadata ----------------------------------------------

    def server_live(self) -> bool:
        return True

    def server_ready(self) -> bool:
        """Up and not shutting down; with strict readiness, also nothing in :meth:`unservable`."""
        if not self.pipeline.accepting or self._shutting_down:
            return False
        return not self.settings.strict_readiness or not self.unservable()

    def unservable(self) -> dict[str, str]:
        """What the gateway is asked to serve and cannot now (``gateway.fleet.readiness``)."""
        problems = unservable(self.cluster, self.fleet.placement.book, self.parallel.index_entries())
        for name, info in self.cluster.models().items():  # an ensemble is servable when its steps are
            if is_ensemble(info.config) and (why := self.models.missing_step(info.config)) is not None:
                problems.setdefault(name, why)
        return problems

    def server_metadata(self) -> service_pb2.ServerMetadataResponse:
        return service_pb2.ServerMetadataResponse(name=self.settings.server_name, version=__version__, extensions=EXTENSIONS)

    def model_ready(self, name: str, version: str = "") -> bool:
        return self.models.ready(name, version)

    def model_metadata(self, name: str, version: str = "") -> service_pb2.ModelMetadataResponse:
        info, _ = self.models.model(name, version)
        md = service_pb2.ModelMetadataResponse()
        md.CopyFrom(info.metadata)
        md.versions[:] = sorted(info.versions, key=version_key)
        return md

    def model_config(self, name: str, version: str = "") -> model_config_pb2.ModelConfig:
        info, _ = self.models.model(name, version)
        return info.config

    async def model_statistics(self, name: str = "", version: str = "") -> service_pb2.ModelStatisticsResponse:
        """The whole gateway's statistics: this process's, or every process's summed (``StatisticsScope``)."""
        return await self._statistics.whole(await self.local_statistics(name, version), name, version)

    async def local_statistics(self, name: str = "", version: str = "") -> service_pb2.ModelStatisticsResponse:
        """This process's own statistics of ``name`` (all models when empty)."""
        if name:
            _, resolved = self.models.model(name, version)
            version = resolved
        known = [(m, max(info.versions, key=version_key)) for m, info in self.cluster.models().items() if info.versions]
        known += [(e.name, e.version) for e in self.parallel.index_entries() if self.parallel.model(e.name)]
        response = self.stats.to_proto(name, version, known)
        fill_statistics(response, self.cache.counters())
        config = self.model_config(name) if name else None
        if config is not None and is_ensemble(config):  # after the ensemble's entry, its steps' shares
            steps = [(s.index, s.model, s.version or self.models.latest(s.model)) for s in self.ensembles.plan(config).steps]
            self.stats.add_step_entries(response, steps)
        return response

    async def worker_statistics(self, name: str = "", version: str = "") -> list[repository.WorkerStatistics]:
        """Each worker's own statistics of ``name`` (all models when empty): Triton's, or our worker's."""
        if name:
            self.models.model(name, version)
        return await repository.worker_statistics(self.cluster, name, version)

    # ---- repository --------------------------------------------------------

    async def repository_index(self, ready_only: bool = False) -> service_pb2.RepositoryIndexResponse:
        index = await repository.merged_index(self.cluster, ready_only)
        # Logical models are listed with the shard models their workers report.
        index.models.extend(e for e in self.parallel.index_entries() if not ready_only or e.state == "READY")
        return index

    def _check_model_control(self) -> None:
        if self.settings.model_control_mode != "explicit":
            # Triton's words and code (UNAVAILABLE) for a server without explicit model control.
            raise Unavailable("explicit model load / unload is not allowed if polling is enabled")

    async def load_model(self, name: str, parameters: dict[str, service_pb2.ModelRepositoryParameter]) -> None:
        self._check_model_control()
        if await self._control.forward_load(name, parameters):
            return
        if self.parallel.serves(name):
            await self.parallel.load(name)  # re-split the source and push what changed
        else:
            self.fleet.placement.note_load(name)
            self.cache.clear(name)  # a reload may answer differently
            await repository.load(self.cluster, name, parameters)
        await self._control.changed(name, service_pb2.RepositoryModelLoadRequest(model_name=name,
                                                                                       parameters=parameters))

    async def unload_model(self, name: str, unload_dependents: bool = False) -> None:
        self._check_model_control()
        if await self._control.forward_unload(name, unload_dependents):
            return
        if self.parallel.serves(name):
            await self.parallel.unload(name)
        else:
            self.fleet.placement.note_unload(name)
            await repository.unload(self.cluster, name, unload_dependents)
        self.cache.clear(name)
        await self._batchers.close_model(name, self.settings.shutdown_grace_s)
        await self._control.changed(name, None)

    async def reread(self, name: str) -> None:
        """Another process loaded or unloaded ``name``: read the workers again, forget cached answers."""
        self.cache.clear(name)
        await self.cluster.refresh()
        if self.cluster.model(name) is None:
            await self._batchers.close_model(name, self.settings.shutdown_grace_s)

    def placement_view(self) -> dict[str, Any]:
        return self.fleet.placement.view()
