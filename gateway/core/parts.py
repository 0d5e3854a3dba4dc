"""The settings the core reads (``CoreSettings``) and the seams where several
gateway processes differ from one.

``gateway.composition`` builds every part from the config and hands each core
part the few parts it calls and these settings; nothing in the core builds a
collaborator or reads the whole config. Two seams are the core's own:

- ``StatisticsScope``: whose statistics a statistics request answers with:
  this process's (``LocalStatistics``) or every process's summed
  (``gateway.multiproc.group.GroupStatistics``);
- ``ModelControl``: who acts on a client's load or unload: this process
  (``LocalModelControl``) or the leader of several on its behalf, every
  process re-reading the workers after (``gateway.multiproc.group.GroupModelControl``).

Several-process mode's placement (a follower's) and trace settings (alike in
every process) arrive through the parts themselves (the fleet's placement,
the tracing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from tritonclient.grpc import service_pb2


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
class CoreSettings:
    """What the core reads of the config, built by the composition root (``gateway.composition.core_settings``)."""

    server_name: str  # the ``name`` server metadata gives
    strict_readiness: bool  # Triton's --strict-readiness: ready only while every model asked for is servable
    model_control_mode: str  # Triton's --model-control-mode: "none" refuses clients' load and unload
    shutdown_grace_s: float  # how long queued requests and open streams may finish at stop (and unload)
    default_timeout_s: float  # a request's deadline when it sets no timeout; a placement's wait
    cluster_join_wait_s: float  # how long an unknown model waits for a joining worker's first probe, at most
