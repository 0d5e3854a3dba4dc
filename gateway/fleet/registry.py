"""Worker self-registration: the gateway's side of ``infergate.cluster.v1.ClusterMembership``.

A worker started with ``--gateway`` calls Register (it joins the cluster,
probed before the answer), then Heartbeat every ``heartbeat_interval_s``
with its devices, load and models; the gateway keeps the latest of each as
a :class:`WorkerReport` for placement and the cluster pages. A worker whose
heartbeats stop for ``heartbeat_misses_to_down`` intervals leaves the
cluster (unless the static list names it too: then probes decide), and a
clean stop's Deregister removes it at once. A heartbeat from a worker the
registry does not know (the gateway restarted, or dropped it) answers
``known: false``, and the worker registers again.

When the gateway has a worker token (``worker_token_file``), a worker must
present it (``authorization: Bearer TOKEN``) to register: a registered
worker receives inference traffic, so registration is not open to anyone
who can reach the port.

The service runs on the gateway's gRPC server, on the event loop; reports
are replaced whole, never mutated, so a reader holds a consistent one.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import grpc

from gateway.fleet.membership import REGISTERED, Membership
from gateway.settings import ConfigError, WorkerSpec, check_address
from protos import cluster_pb2, cluster_pb2_grpc
from protos.errors import InferGateError, InvalidArgument, Unauthenticated
from serverkit.tasks import log_task_death

log = logging.getLogger(__name__)

MetricsListener = Callable[[str, "str | None"], None]
# (address, worker id): a worker whose heartbeats stopped, dropped here (gateway.multiproc.registrations).
ExpiryListener = Callable[[str, str], Awaitable[None]]
# A worker whose heartbeats reach this process only through another one (several gateway
# processes) is dropped by that process, which passes its verdict on; here only after this
# many of its heartbeat windows, in case that process went away too.
RELAYED_WINDOWS = 5


@dataclass(frozen=True, slots=True)
class DeviceReport:
    kind: str
    index: int
    name: str
    uuid: str
    memory_total_bytes: int
    memory_free_bytes: int


@dataclass(frozen=True, slots=True)
class ModelReport:
    name: str
    versions: tuple[str, ...]
    memory_bytes: int
    estimated_bytes: int
    measured_bytes: int
    measured_on: str
    inflight: int
    queued: int
    rows_per_s: float
    last_inference_ms: int


@dataclass(frozen=True, slots=True)
class WorkerReport:
    """What a registered worker said last."""

    address: str
    worker_id: str
    backend: str
    version: str
    metrics_port: int
    devices: tuple[DeviceReport, ...]
    inflight: int
    queued: int
    rows_per_s: float
    models: Mapping[str, ModelReport]
    registered_at: float  # time.monotonic()
    last_seen: float

    @property
    def memory_total_bytes(self) -> int:
        """Memory models can live in: the GPUs' when it has any, else the host's."""
        gpus = [d.memory_total_bytes for d in self.devices if d.kind == "gpu"]
        return sum(gpus) if gpus else sum(d.memory_total_bytes for d in self.devices if d.kind == "host")

    @property
    def model_memory_bytes(self) -> int:
        return sum(m.memory_bytes for m in self.models.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "worker_id": self.worker_id, "backend": self.backend, "version": self.version,
            "metrics_port": self.metrics_port,
            "devices": [{"kind": d.kind, "index": d.index, "name": d.name, "uuid": d.uuid,
                         "memory_total_bytes": d.memory_total_bytes, "memory_free_bytes": d.memory_free_bytes}
                        for d in self.devices],
            "inflight": self.inflight, "queued": self.queued, "rows_per_s": round(self.rows_per_s, 3),
            "memory_total_bytes": self.memory_total_bytes, "model_memory_bytes": self.model_memory_bytes,
            "models": {n: {"versions": list(m.versions), "memory_bytes": m.memory_bytes,
                           "estimated_bytes": m.estimated_bytes, "measured_bytes": m.measured_bytes,
                           "measured_on": m.measured_on, "inflight": m.inflight, "queued": m.queued,
                           "rows_per_s": round(m.rows_per_s, 3), "last_inference_ms": m.last_inference_ms}
                       for n, m in sorted(self.models.items())},
            "heartbeat_age_s": round(time.monotonic() - self.last_seen, 3),
        }


def _report(address: str, worker_id: str, devices: Any, load: cluster_pb2.WorkerLoad, *, backend: str = "",
            version: str = "", metrics_port: int = 0, registered_at: float, now: float) -> WorkerReport:
    models = {
        m.name: ModelReport(m.name, tuple(m.versions), m.memory_bytes, m.estimated_bytes, m.measured_bytes,
                            m.measured_on, m.inflight, m.queued, m.rows_per_s, m.last_inference_ms)
        for m in load.models
    }
    return WorkerReport(
        address, worker_id, backend, version, metrics_port,
        tuple(DeviceReport(d.kind, d.index, d.name, d.uuid, d.memory_total_bytes, d.memory_free_bytes) for d in devices),
        load.inflight, load.queued, load.rows_per_s, MappingProxyType(models), registered_at, now,
    )


class Registry:
    """Registered workers and their latest reports."""

    def __init__(self, membership: Membership, *, heartbeat_interval_s: float = 2.0, misses_to_down: int = 3,
                 token: str = "", clock: Callable[[], float] = time.monotonic) -> None:
        self.membership = membership
        self.heartbeat_interval_s = heartbeat_interval_s
        self.misses_to_down = misses_to_down
        self.token = token
        self.clock = clock
        self.gateway_id = uuid.uuid4().hex
        self._reports: dict[str, WorkerReport] = {}
        self._listeners: list[MetricsListener] = []
        self._task: asyncio.Task[None] | None = None
        self._leaving: set[asyncio.Task[bool]] = set()
        # Workers whose latest registration or heartbeat came relayed by another process.
        self._relayed: set[str] = set()
        self.on_expired: ExpiryListener | None = None

    def reports(self) -> Mapping[str, WorkerReport]:
        return MappingProxyType(self._reports)

    def report(self, address: str) -> WorkerReport | None:
        return self._reports.get(address)

    def on_metrics(self, listener: MetricsListener) -> None:
        """Tell ``listener(address, url or None)`` where registered workers serve their metrics."""
        self._listeners.append(listener)

    # ---- lifecycle -------------------------------------------------------

    async def start(self) -> None:
        self._task = asyncio.create_task(self._expire_loop(), name="registry-expiry")
        self._task.add_done_callback(log_task_death)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await asyncio.gather(*self._leaving, return_exceptions=True)

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval_s / 2)
            await self.expire()

    async def expire(self) -> list[str]:
        """Drop the workers whose heartbeats stopped; returns their addresses."""
        limit = self.heartbeat_interval_s * self.misses_to_down
        now = self.clock()
        # Silence is counted in the loop's own time: a heartbeat that waited unread while this
        # process could not run (a loaded machine) is no missed heartbeat.
        stalled = self.membership.cluster.loop_stalled_s
        gone = [a for a, r in self._reports.items()
                if now - r.last_seen - stalled(r.last_seen, now) > limit * (RELAYED_WINDOWS if a in self._relayed else 1)]
        for address in gone:
            report = self._reports.pop(address)
            relayed = address in self._relayed
            self._relayed.discard(address)
            log.warning("worker %s missed its heartbeats for %.1fs: it leaves the cluster", address, now - report.last_seen)
            worker = self.membership.cluster.worker(address)
            if worker is not None and self.membership.is_static(address):
                self.membership.cluster.mark_down(worker, "missed heartbeats")
            self._metrics(address, None)
            await self._leave(address)
            if self.on_expired is not None and not relayed:
                await self.on_expired(address, report.worker_id)
        return gone

    async def _leave(self, address: str) -> None:
        """Take ``address`` out of the cluster now; its channel closes in the background.

        The removal itself (out of rotation) happens before the leave task's
        first await, which the sleep(0) lets it reach; closing the channel
        waits for batches in flight there (up to the grace), and no caller
        should wait for that.
        """
        task = asyncio.create_task(self.membership.leave(address, REGISTERED), name=f"leave:{address}")
        self._leaving.add(task)
        task.add_done_callback(self._left)
        await asyncio.sleep(0)

    def _left(self, task: asyncio.Task[bool]) -> None:
        self._leaving.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("removing a worker failed", exc_info=task.exception())

    # ---- the calls -----------------------------------------------------------

    async def register(self, request: cluster_pb2.RegisterRequest, *, relayed: bool = False
                       ) -> cluster_pb2.RegisterResponse:
        """``relayed``: passed on by the process the worker talks to (several gateway processes)."""
        address = request.address.strip()
        try:
            check_address(address)
        except ConfigError as e:
            raise InvalidArgument(str(e)) from None
        if not request.worker_id:
            raise InvalidArgument("a registration needs a worker_id")
        now = self.clock()
        previous = self._reports.get(address)
        self._reports[address] = _report(address, request.worker_id, request.devices, request.load,
                                         backend=request.backend, version=request.version,
                                         metrics_port=request.metrics_port, registered_at=now, now=now)
        self._relay(address, relayed)
        worker = await self.membership.join(WorkerSpec(address), REGISTERED)
        if previous is not None and previous.worker_id != request.worker_id:
            # A new process on a known address: a fresh member, not the one that was drained.
            log.info("worker %s restarted (new worker id): re-reading it", address)
            if worker.draining and not self.membership.is_static(address):
                self.membership.cluster.set_draining(address, False)
        if previous is None or previous.worker_id != request.worker_id:
            await self.membership.cluster.refresh(address)
            log.info("worker %s registered (%s, %d device(s), %d model(s))", address, request.backend or "?",
                     len(request.devices), len(request.load.models))
        if request.metrics_port:
            self._metrics(address, f"http://{address.rpartition(':')[0]}:{request.metrics_port}/metrics")
        return cluster_pb2.RegisterResponse(heartbeat_interval_s=self.heartbeat_interval_s, gateway_id=self.gateway_id)

    def _relay(self, address: str, relayed: bool) -> None:
        if relayed:
            self._relayed.add(address)
        else:
            self._relayed.discard(address)

    def heartbeat(self, request: cluster_pb2.HeartbeatRequest, *, relayed: bool = False) -> cluster_pb2.HeartbeatResponse:
        previous = self._reports.get(request.address)
        worker = self.membership.cluster.worker(request.address)
        if previous is None or previous.worker_id != request.worker_id or worker is None:
            return cluster_pb2.HeartbeatResponse(known=False, heartbeat_interval_s=self.heartbeat_interval_s)
        self._reports[request.address] = _report(
            request.address, request.worker_id, request.devices, request.load, backend=previous.backend,
            version=previous.version, metrics_port=previous.metrics_port, registered_at=previous.registered_at,
            now=self.clock())
        self._relay(request.address, relayed)
        return cluster_pb2.HeartbeatResponse(known=True, draining=worker.draining,
                                             heartbeat_interval_s=self.heartbeat_interval_s)

    async def deregister(self, request: cluster_pb2.DeregisterRequest) -> cluster_pb2.DeregisterResponse:
        previous = self._reports.get(request.address)
        if previous is None or previous.worker_id != request.worker_id:
            return cluster_pb2.DeregisterResponse(known=False)
        del self._reports[request.address]
        self._relayed.discard(request.address)
        log.info("worker %s deregistered (clean stop)", request.address)
        self._metrics(request.address, None)
        worker = self.membership.cluster.worker(request.address)
        if worker is not None and self.membership.is_static(request.address):
            self.membership.cluster.mark_down(worker, "stopped")
        # Out of rotation before this answers; its channel closes with a grace
        # period, so batches already sent there finish.
        await self._leave(request.address)
        return cluster_pb2.DeregisterResponse(known=True)

    def check_token(self, metadata: Any) -> None:
        if not self.token:
            return
        presented = ""
        for key, value in metadata or ():
            if key == "authorization":
                text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
                scheme, _, secret = text.strip().partition(" ")
                presented = secret.strip() if scheme.lower() == "bearer" else ""
        if not hmac.compare_digest(presented.encode(), self.token.encode()):
            raise Unauthenticated("missing or invalid worker token")

    def _metrics(self, address: str, url: str | None) -> None:
        for listener in self._listeners:
            try:
                listener(address, url)
            except Exception:  # a listener's bug must not fail a registration
                log.exception("metrics listener failed")


class RegistryService(cluster_pb2_grpc.ClusterMembershipServicer):
    """The gRPC edge: token check, errors to statuses."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry

    async def _guard(self, context: grpc.aio.ServicerContext, call: Any) -> Any:
        try:
            self._registry.check_token(context.invocation_metadata())
            return await call()
        except InferGateError as e:
            await context.abort(e.grpc_code, e.message)

    async def Register(self, request: cluster_pb2.RegisterRequest, context: grpc.aio.ServicerContext
                       ) -> cluster_pb2.RegisterResponse:
        return await self._guard(context, lambda: self._registry.register(request))

    async def Heartbeat(self, request: cluster_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
                        ) -> cluster_pb2.HeartbeatResponse:
        async def call() -> cluster_pb2.HeartbeatResponse:
            return self._registry.heartbeat(request)

        return await self._guard(context, call)

    async def Deregister(self, request: cluster_pb2.DeregisterRequest, context: grpc.aio.ServicerContext
                         ) -> cluster_pb2.DeregisterResponse:
        return await self._guard(context, lambda: self._registry.deregister(request))


def add_registry_service(server: grpc.aio.Server, registry: Registry) -> None:
    cluster_pb2_grpc.add_ClusterMembershipServicer_to_server(RegistryService(registry), server)
