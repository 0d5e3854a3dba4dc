"""The records of the gateway's view of its fleet: each worker as the gateway
sees it (``WorkerState``), each model as one worker serves it
(``WorkerModel``) and as the whole cluster serves it (``ModelInfo``).

``gateway.fleet.cluster`` keeps them up to date from its probes; the router,
placement and the observability endpoints read them.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field

from tritonclient.grpc import model_config_pb2, service_pb2

from gateway.replicas.replica import Replica, ServerLoad
from gateway.settings import WorkerSpec


class WorkerStatus(enum.Enum):
    READY = "READY"
    DOWN = "DOWN"
    DRAINING = "DRAINING"  # up, but takes no new work


@dataclass(frozen=True, slots=True)
class WorkerModel:
    """One model as one worker serves it."""

    name: str
    versions: tuple[str, ...]
    config: model_config_pb2.ModelConfig
    metadata: service_pb2.ModelMetadataResponse
    # Batches of this model the worker executes at once (protos.execution_slots).
    slots: int = 1


@dataclass(slots=True, eq=False)
class WorkerState:
    """One worker as the gateway sees it. Identity-hashed: one object per worker.

    ``state``, ``consecutive_failures`` and ``models`` belong to the cluster;
    ``inflight``, ``sent``, ``failures`` and ``retries`` to the router.
    """

    spec: WorkerSpec
    client: Replica
    state: WorkerStatus = WorkerStatus.DOWN
    consecutive_failures: int = 0
    last_error: str = ""
    models: dict[str, WorkerModel] = field(default_factory=dict)
    draining: bool = False
    inflight: int = 0  # batches sent and not answered yet
    sent: int = 0  # batches sent
    failures: int = 0  # batches that failed here (any error)
    retries: int = 0  # batches that failed here and were retried on a replica
    # READY (name, version) pairs of the last index; details are re-read only when it changes.
    index: frozenset[tuple[str, str]] = frozenset()
    # Calls this worker refused (call -> reason), e.g. a restricted repository index.
    unreadable: dict[str, str] = field(default_factory=dict)
    # "explicit", "none" (it refused a load or unload) or "" (not known yet).
    model_control: str = ""
    # Models loaded here through the gateway: looked up by name when no list is readable.
    loaded: set[str] = field(default_factory=set)
    # Models its index shows it was asked to serve and cannot (name -> why): strict readiness.
    failed: dict[str, str] = field(default_factory=dict)
    # The server's own queue and cache figures at the last probe, where its replica reads them (ReportsLoad).
    server_load: ServerLoad | None = None
    # Serialises probes of this worker (the periodic loop and refresh()).
    probe_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def address(self) -> str:
        return self.spec.address

    @property
    def kind(self) -> str:
        return self.spec.kind

    @property
    def is_up(self) -> bool:
        """Reachable and probed: READY or DRAINING."""
        return self.state is not WorkerStatus.DOWN

    def __repr__(self) -> str:
        return f"WorkerState({self.address}, {self.state.name}, inflight={self.inflight})"


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """One model across the cluster: its READY replicas and a config/metadata to validate against."""

    name: str
    versions: tuple[str, ...]
    config: model_config_pb2.ModelConfig
    metadata: service_pb2.ModelMetadataResponse
    replicas: tuple[WorkerState, ...]


def version_key(version: str) -> tuple[int, str]:
    return (int(version), version) if version.isdigit() else (-1, version)
