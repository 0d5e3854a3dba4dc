"""The gateway of one process among several: what it asks the others.

Each process batches and routes its own requests with its own cluster view
(every process probes the workers, which only reads them). Decisions that
change the workers are taken once, by the leader (process 0):

- placement: only the leader's controller runs rounds. A follower's
  controller (:class:`FollowerPlacement`) sends its requests' demand (the
  idle TTL's and the autoscaler's input) to the leader every
  ``TOUCH_FLUSH_S`` and asks the leader to place a model a request needs
  (``load_on_demand``, ``replicas``), then re-reads the workers;
- repository control (load, unload): a follower forwards the call to the
  leader, which acts and has every process re-read the workers before it
  answers, so after a load returns every process serves the model;
- Triton's extension state (shared-memory regions, log and trace settings):
  changed in every process, in the leader's order (``replicated``).

Statistics are summed over all processes at every call (``merge``), never
sampled from one.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import TYPE_CHECKING, Any

import orjson
from tritonclient.grpc import service_pb2

from gateway.core import Gateway
from gateway.fleet.placement import PlacementController
from gateway.multiproc.merge import merge_statistics
from gateway.multiproc.peers import ProcessGroup
from gateway.multiproc.replicated import GroupLogSettings, GroupRegions, GroupTraceSettings, Replicator
from gateway.observability.trace_settings import trace_config
from gateway.settings import GatewayConfig
from protos.errors import ModelNotFound, Unavailable

if TYPE_CHECKING:
    from gateway.fleet.cluster import Cluster
    from gateway.fleet.registry import Registry

log = logging.getLogger(__name__)

TOUCH_FLUSH_S = 1.0
REFRESH_POLL_S = 0.05


class FollowerPlacement(PlacementController):
    """A follower's placement: the config's demand book for readiness, decisions left to the leader."""

    def __init__(self, config: GatewayConfig, cluster: Cluster, registry: Registry, group: ProcessGroup) -> None:
        super().__init__(config, cluster, registry)
        self._group = group
        self._touched: Counter[str] = Counter()
        self._flusher: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._flusher = asyncio.create_task(self._flush_loop(), name="placement-demand-to-leader")
        self._flusher.add_done_callback(_log_death)

    async def stop(self) -> None:
        task, self._flusher = self._flusher, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def touch(self, name: str, rows: int = 1) -> None:
        self._touched[name] += rows

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(TOUCH_FLUSH_S)
            if not self._touched:
                continue
            touched, self._touched = self._touched, Counter()
            try:
                await self._group.call(0, "POST", "touch", body=orjson.dumps(dict(touched)))
            except Unavailable as e:  # the leader is stopping or restarting: this demand is lost, the next is not
                log.info("demand not sent to the leader: %s", e)

    async def wait_round(self, timeout_s: float | None) -> bool:
        return False  # no rounds here: the leader's drain waits on its own

    async def ensure(self, name: str, timeout_s: float) -> None:
        """Have the leader place ``name``, then wait until this process sees a READY replica."""
        if self._cluster.model(name) is not None:
            return
        if not self.can_load(name):
            raise ModelNotFound(f"Request for unknown model: '{name}' is not found")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        await self._group.call(0, "POST", "ensure", params={"name": name, "timeout_s": str(timeout_s)},
                               timeout_s=timeout_s + 5.0)
        # The leader saw a replica READY; this process learns it by probing.
        while True:
            await self._cluster.refresh()
            if self._cluster.model(name) is not None:
                return
            if loop.time() > deadline:
                raise Unavailable(f"model '{name}' is still being loaded")
            await asyncio.sleep(REFRESH_POLL_S)


def _log_death(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("task %s died", task.get_name(), exc_info=task.exception())


class GroupGateway(Gateway):
    """A ``Gateway`` whose statistics cover every process, whose fleet decisions are the leader's, and whose
    extension state (``regions``, ``logs``, the trace settings) every process holds alike."""

    def __init__(self, config: GatewayConfig, group: ProcessGroup) -> None:
        super().__init__(config)
        self.group = group
        self.replicator = Replicator(group)
        self.regions = GroupRegions(self.replicator)
        self.logs = GroupLogSettings(self.replicator)
        self.tracing.settings = GroupTraceSettings(trace_config(config), self.model_ready, self.replicator)
        self.tracing.file_of_process(group.index)  # no two processes write one trace file
        if not group.is_leader:
            follower = FollowerPlacement(config, self.cluster, self.fleet.registry, group)
            self.fleet.placement = self.placement = follower

    # ---- statistics: summed over the processes ---------------------------------

    async def local_statistics(self, name: str = "", version: str = "") -> service_pb2.ModelStatisticsResponse:
        return await super().model_statistics(name, version)

    async def model_statistics(self, name: str = "", version: str = "") -> service_pb2.ModelStatisticsResponse:
        local = await self.local_statistics(name, version)
        others = await self.group.gather("GET", "stats", params={"name": name, "version": version})
        return merge_statistics([local, *(service_pb2.ModelStatisticsResponse.FromString(b) for b in others)])

    # ---- repository control: the leader's -----------------------------------------

    async def load_model(self, name: str, parameters: dict[str, service_pb2.ModelRepositoryParameter]) -> None:
        self._check_model_control()
        if not self.group.is_leader:
            request = service_pb2.RepositoryModelLoadRequest(model_name=name, parameters=parameters)
            await self.group.call(0, "POST", "load", body=request.SerializeToString(), timeout_s=_LOAD_TIMEOUT_S)
            return
        await super().load_model(name, parameters)
        await self._everyone_rereads(name)

    async def unload_model(self, name: str, unload_dependents: bool = False) -> None:
        self._check_model_control()
        if not self.group.is_leader:
            await self.group.call(0, "POST", "unload",
                                  params={"name": name, "unload_dependents": str(unload_dependents).lower()},
                                  timeout_s=_LOAD_TIMEOUT_S)
            return
        await super().unload_model(name, unload_dependents)
        await self._everyone_rereads(name)

    async def _everyone_rereads(self, name: str) -> None:
        await self.group.gather("POST", "reread", params={"name": name})

    async def reread(self, name: str) -> None:
        """Another process loaded or unloaded ``name``: read the workers again, forget cached answers."""
        self.cache.clear(name)
        await self.cluster.refresh()
        if self.cluster.model(name) is None:
            for key in [k for k in self._batchers if k[0] == name]:
                await self._batchers.pop(key).close(self.config.shutdown_grace_s)

    def placement_view(self) -> dict[str, Any]:
        return self.fleet.placement.view()


_LOAD_TIMEOUT_S = 330.0  # the placement's own load timeout, and a margin
