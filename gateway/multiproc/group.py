"""The parts of one gateway process among several: what it asks the others.

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

Each is a part the composition root hands the core in place of the
single-process one, through the same seams: ``FollowerPlacement`` (the
fleet's placement), ``GroupStatistics`` (``StatisticsScope``),
``GroupModelControl`` (``ModelControl``); the replicated extension state and
trace settings come from ``replicated``. Nothing here imports the core.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import orjson
from tritonclient.grpc import service_pb2

from gateway.replicas.local import LocalReplica
from gateway.fleet.placement import PlacementController
from gateway.multiproc.merge import merge_statistics
from gateway.multiproc.peers import ProcessGroup
from gateway.settings import AutoscaleSettings, PlacementSettings
from protos.errors import ModelNotFound, Unavailable
from serverkit.tasks import log_task_death

if TYPE_CHECKING:
    from gateway.fleet.cluster import Cluster
    from gateway.fleet.registry import Registry

log = logging.getLogger(__name__)

TOUCH_FLUSH_S = 1.0
REFRESH_POLL_S = 0.05


class FollowerPlacement(PlacementController):
    """A follower's placement: the config's demand book for readiness, decisions left to the leader."""

    def __init__(self, cluster: Cluster, registry: Registry, group: ProcessGroup, *, settings: PlacementSettings,
                 autoscale: AutoscaleSettings, models: Mapping[str, Mapping[str, Any]],
                 model_repository: str = "") -> None:
        super().__init__(cluster, registry, settings=settings, autoscale=autoscale, models=models,
                         model_repository=model_repository)
        self._group = group
        self._touched: Counter[str] = Counter()
        self._flusher: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._flusher = asyncio.create_task(self._flush_loop(), name="placement-demand-to-leader")
        self._flusher.add_done_callback(log_task_death)

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


class GroupStatistics:
    """``StatisticsScope`` of a process among several: its own statistics summed with every other process's."""

    def __init__(self, group: ProcessGroup) -> None:
        self._group = group

    async def whole(self, local: service_pb2.ModelStatisticsResponse, name: str,
                    version: str) -> service_pb2.ModelStatisticsResponse:
        others = await self._group.gather("GET", "stats", params={"name": name, "version": version})
        return merge_statistics([local, *(service_pb2.ModelStatisticsResponse.FromString(b) for b in others)])


class GroupModelControl:
    """``ModelControl`` of a process among several: a follower forwards a client's load or unload
    to the leader; the leader acts, then has every other process re-read the workers before it answers.

    With local execution every process runs its own copy of the repository's models: the others
    then load (with the same request) or unload their copy of a model as the leader's did."""

    def __init__(self, group: ProcessGroup, local: LocalReplica | None = None) -> None:
        self._group = group
        self._local = local

    async def forward_load(self, name: str, parameters: dict[str, service_pb2.ModelRepositoryParameter]) -> bool:
        if self._group.is_leader:
            return False
        request = service_pb2.RepositoryModelLoadRequest(model_name=name, parameters=parameters)
        await self._group.call(0, "POST", "load", body=request.SerializeToString(), timeout_s=_LOAD_TIMEOUT_S)
        return True

    async def forward_unload(self, name: str, unload_dependents: bool) -> bool:
        if self._group.is_leader:
            return False
        await self._group.call(0, "POST", "unload",
                               params={"name": name, "unload_dependents": str(unload_dependents).lower()},
                               timeout_s=_LOAD_TIMEOUT_S)
        return True

    async def changed(self, name: str, load: service_pb2.RepositoryModelLoadRequest | None) -> None:
        params, body = {"name": name}, b""
        if self._local is not None:
            params[LOCAL_ACTION] = "load" if load is not None and self._local.serves(name) else "unload"
            body = load.SerializeToString() if load is not None else b""
        await self._group.gather("POST", "reread", params=params, body=body, timeout_s=_LOAD_TIMEOUT_S)


# The reread call's parameter naming what a process does with its own local copy of the model.
LOCAL_ACTION = "local"
_LOAD_TIMEOUT_S = 330.0  # the placement's own load timeout, and a margin
