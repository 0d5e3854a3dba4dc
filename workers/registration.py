"""The worker's side of cluster membership: register with one or more
gateways (``--gateway HOST:PORT``, the gateway's gRPC port), heartbeat,
deregister on a clean stop.

One task per gateway: Register, then Heartbeat every interval (the
gateway's answer sets it) carrying the devices (GPU name, total and free
memory through NVML where present, else the host's memory), the load
(in-flight and queued requests, inferences per second) and each loaded
model with its memory. A heartbeat answered ``known: false`` (the gateway
restarted or dropped us) registers again at once; an unreachable gateway is
retried every interval, quietly after the first failure. :meth:`stop`
deregisters from every gateway (bounded), so the gateway stops sending work
before the server stops accepting it.

Model memory: ``estimated_bytes`` is the size of the loaded versions' files;
``measured_bytes`` is how much the process's memory (this process's GPU
memory through NVML when the backend runs on a GPU, else its RSS) grew
between the two reports around the load, when exactly one model was loaded
in between (else not measured). ``memory_bytes``, what placement counts, is
the GPU measurement where there is one, else the estimate: a CPU process's
RSS moves with allocator arenas and thread stacks too much to trust.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from protos import cluster_pb2, cluster_pb2_grpc
from execution.manager import ModelManager
from workers.metrics import GpuMonitor, HostMonitor
from serverkit.nvml import Nvml
from serverkit.tasks import log_task_death

logger = logging.getLogger(__name__)

MIN_SAMPLE_INTERVAL_S = 0.2  # reports closer together than this share one sample (rates need a span)


@dataclass(frozen=True, slots=True)
class RegistrationConfig:
    gateways: tuple[str, ...]
    address: str  # where gateways reach this worker
    backend: str
    metrics_port: int = 0
    heartbeat_interval_s: float = 2.0  # until a gateway says otherwise
    token: str = field(default="", repr=False)
    tls_root_certificates: bytes | None = None
    rpc_timeout_s: float = 10.0
    version: str = ""


@dataclass(slots=True)
class _Measured:
    bytes: int
    on: str


class WorkerReporter:
    """Builds the devices and load parts of registration messages from the manager's live state."""

    def __init__(self, manager: ModelManager, *, use_gpus: bool, gpus: GpuMonitor | None = None,
                 host: HostMonitor | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._manager = manager
        self._use_gpus = use_gpus
        self._gpus = gpus or GpuMonitor()
        self._gpu_memory = ProcessGpuMemory()
        self._host = host or HostMonitor()
        self._clock = clock
        self._sizes: dict[tuple[str, int, Path], int] = {}
        self._measured: dict[str, _Measured] = {}
        self._last: tuple[float, dict[tuple[str, int], int], frozenset[tuple[str, int]], int] | None = None
        self._snapshot: tuple[list[cluster_pb2.Device], cluster_pb2.WorkerLoad] | None = None
        self._snapshot_at = -1e9

    async def sample(self) -> tuple[list[cluster_pb2.Device], cluster_pb2.WorkerLoad]:
        """Devices and load now (shared by reports less than MIN_SAMPLE_INTERVAL_S apart)."""
        now = self._clock()
        if self._snapshot is not None and now - self._snapshot_at < MIN_SAMPLE_INTERVAL_S:
            return self._snapshot
        # NVML and /proc reads block briefly: off the loop. The manager's state is read on it.
        devices, process_bytes, measured_on = await asyncio.to_thread(self._devices)
        load = self._load(self._clock(), process_bytes, measured_on)
        self._snapshot, self._snapshot_at = (devices, load), now
        return devices, load

    def close(self) -> None:
        self._gpus.close()
        self._gpu_memory.close()

    def _devices(self) -> tuple[list[cluster_pb2.Device], int, str]:
        devices = []
        process_bytes, on = 0, "host"
        if self._use_gpus:
            for g in self._gpus.sample():
                devices.append(cluster_pb2.Device(kind="gpu", index=g.index, name=g.name, uuid=g.uuid,
                                                  memory_total_bytes=g.memory_total_bytes,
                                                  memory_free_bytes=max(0, g.memory_total_bytes - g.memory_used_bytes)))
            gpu_bytes = self._gpu_memory.bytes()
            if gpu_bytes is not None:
                process_bytes, on = gpu_bytes, "gpu"
        host = self._host.sample()
        if host is not None:
            devices.append(cluster_pb2.Device(kind="host", name="host", memory_total_bytes=host.memory_total_bytes,
                                              memory_free_bytes=max(0, host.memory_total_bytes - host.memory_used_bytes)))
        if on == "host":
            process_bytes = _rss_bytes()
        return devices, process_bytes, on

    def _load(self, now: float, process_bytes: int, measured_on: str) -> cluster_pb2.WorkerLoad:
        by_name: dict[str, list[Any]] = {}
        for model in self._manager.loaded():
            by_name.setdefault(model.name, []).append(model)
        counts = {(m.name, m.version): m.stats.inference_count for ms in by_name.values() for m in ms}
        keys = frozenset(counts)
        self._attribute(keys, process_bytes, measured_on)
        dt = now - self._last[0] if self._last is not None else 0.0
        previous_counts = self._last[1] if self._last is not None else {}
        self._last = (now, counts, keys, process_bytes)
        load = cluster_pb2.WorkerLoad()
        for name, versions in sorted(by_name.items()):
            inflight = sum(m.inflight for m in versions)
            instances = sum(max(1, sum(g.count for g in m.config.instance_group)) for m in versions)
            # A reloaded version starts its counters again: never a negative rate.
            rows = sum(max(0, counts[(name, m.version)] - previous_counts.get((name, m.version), counts[(name, m.version)]))
                       for m in versions)
            estimated = sum(self._files_bytes(name, m.version) for m in versions)
            measured = self._measured.get(name)
            use_measured = measured is not None and measured.on == "gpu" and measured.bytes > 0
            load.models.add(
                name=name, versions=[m.version_str for m in sorted(versions, key=lambda m: m.version)],
                memory_bytes=measured.bytes if use_measured and measured else estimated,
                estimated_bytes=estimated, measured_bytes=measured.bytes if measured else 0,
                measured_on=measured.on if measured else "", inflight=inflight,
                queued=max(0, inflight - instances), rows_per_s=rows / dt if dt > 0 else 0.0,
                last_inference_ms=max(m.stats.last_inference_ms for m in versions),
            )
        load.inflight = sum(m.inflight for m in load.models)
        load.queued = sum(m.queued for m in load.models)
        load.rows_per_s = sum(m.rows_per_s for m in load.models)
        return load

    def _attribute(self, keys: frozenset[tuple[str, int]], process_bytes: int, on: str) -> None:
        """Credit the process's memory growth to the one model loaded since the last sample."""
        names = {name for name, _ in keys}
        for gone in set(self._measured) - names:
            del self._measured[gone]
        if self._last is None:
            return
        previous = self._last[2]
        added = {name for name, _ in keys - previous}
        if len(added) == 1 and previous <= keys:
            (name,) = added
            growth = process_bytes - self._last[3]
            self._measured[name] = _Measured(max(0, growth), on)

    def _files_bytes(self, name: str, version: int) -> int:
        source = self._manager.source_dir(name)
        if source is None:
            return 0
        key = (name, version, source)
        size = self._sizes.get(key)
        if size is None:
            try:
                size = sum(f.stat().st_size for f in (source / str(version)).rglob("*") if f.is_file())
            except OSError:
                size = 0
            self._sizes[key] = size
        return size


def _rss_bytes() -> int:
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


class ProcessGpuMemory:
    """This process's memory on every GPU, through NVML (the nvidia-ml-py package)."""

    def __init__(self) -> None:
        self._nvml = Nvml("GPU memory measurement")

    def bytes(self) -> int | None:
        """None when NVML cannot tell (no package, driver or GPU)."""
        nvml = self._nvml.get()
        if nvml is None:
            return None
        total = 0
        try:
            for index in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                for process in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    if process.pid == os.getpid() and process.usedGpuMemory:
                        total += int(process.usedGpuMemory)
        except nvml.NVMLError as e:
            logger.debug("NVML process query failed: %s", e)
            return None
        # Not listed: no CUDA context yet (nothing loaded), or a PID namespace hides us.
        return total

    def close(self) -> None:
        self._nvml.close()


class Registration:
    """Registers with each gateway and keeps heartbeating until :meth:`stop`."""

    def __init__(self, config: RegistrationConfig, reporter: WorkerReporter) -> None:
        self._config = config
        self._reporter = reporter
        self.worker_id = uuid.uuid4().hex
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._registered: dict[str, bool] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.draining: dict[str, bool] = {}
        self._metadata = (("authorization", f"Bearer {config.token}"),) if config.token else ()

    def registered(self, gateway: str) -> bool:
        return self._registered.get(gateway, False)

    async def start(self) -> None:
        """Start one loop per gateway; returns at once (a gateway may come later)."""
        for gateway in self._config.gateways:
            if self._config.tls_root_certificates is not None:
                credentials = grpc.ssl_channel_credentials(root_certificates=self._config.tls_root_certificates)
                channel = grpc.aio.secure_channel(gateway, credentials)
            else:
                channel = grpc.aio.insecure_channel(gateway)
            self._channels[gateway] = channel
            task = asyncio.create_task(self._loop(gateway, cluster_pb2_grpc.ClusterMembershipStub(channel)),
                                       name=f"register:{gateway}")
            task.add_done_callback(log_task_death)
            self._tasks[gateway] = task

    async def stop(self, timeout_s: float = 3.0) -> None:
        """Stop heartbeating and deregister from every gateway (at most ``timeout_s``).

        Idempotent: the worker calls it before its listener closes and again on its way out.
        """
        tasks, self._tasks = list(self._tasks.values()), {}
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # Every gateway, not only those that answered a Register: one cancelled
        # mid-call may have registered us anyway. An unknown worker is a no-op there.
        self._registered.clear()
        await asyncio.gather(*(self._deregister(g, timeout_s) for g in self._channels))
        channels, self._channels = list(self._channels.values()), {}
        await asyncio.gather(*(c.close() for c in channels), return_exceptions=True)
        self._reporter.close()

    async def _deregister(self, gateway: str, timeout_s: float) -> None:
        stub = cluster_pb2_grpc.ClusterMembershipStub(self._channels[gateway])
        request = cluster_pb2.DeregisterRequest(address=self._config.address, worker_id=self.worker_id)
        try:
            answer = await stub.Deregister(request, timeout=timeout_s, metadata=self._metadata)
            if answer.known:
                logger.info("deregistered from gateway %s", gateway)
        except grpc.aio.AioRpcError as e:
            logger.warning("deregistering from gateway %s failed: %s", gateway, e.details() or e.code().name)

    async def _loop(self, gateway: str, stub: cluster_pb2_grpc.ClusterMembershipStub) -> None:
        interval = self._config.heartbeat_interval_s
        failing = False
        while True:
            try:
                interval = await self._beat(gateway, stub, interval)
                if failing:
                    logger.info("gateway %s reachable again", gateway)
                failing = False
            except grpc.aio.AioRpcError as e:
                # Unreachable: keep heartbeating (a restarted gateway answers `known: false`).
                # Refused (token, bad address...): register again next time.
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    self._registered[gateway] = False
                if not failing:
                    logger.warning("gateway %s: %s: %s (retrying every %.1fs)", gateway, e.code().name,
                                   e.details(), interval)
                failing = True
            # A timer between heartbeats, not a readiness wait.
            await asyncio.sleep(interval)

    async def _beat(self, gateway: str, stub: cluster_pb2_grpc.ClusterMembershipStub, interval: float) -> float:
        devices, load = await self._reporter.sample()
        timeout = self._config.rpc_timeout_s
        if self.registered(gateway):
            answer = await stub.Heartbeat(
                cluster_pb2.HeartbeatRequest(address=self._config.address, worker_id=self.worker_id,
                                             devices=devices, load=load),
                timeout=timeout, metadata=self._metadata)
            if answer.known:
                if answer.draining != self.draining.get(gateway, False):
                    logger.info("gateway %s %s this worker", gateway, "drains" if answer.draining else "no longer drains")
                self.draining[gateway] = answer.draining
                return answer.heartbeat_interval_s or interval
            logger.info("gateway %s does not know this worker (it restarted?): registering again", gateway)
            self._registered[gateway] = False
        answer = await stub.Register(
            cluster_pb2.RegisterRequest(address=self._config.address, worker_id=self.worker_id,
                                        backend=self._config.backend, devices=devices, load=load,
                                        metrics_port=self._config.metrics_port, version=self._config.version),
            timeout=timeout, metadata=self._metadata)
        self._registered[gateway] = True
        logger.info("registered with gateway %s as %s", gateway, self._config.address)
        return answer.heartbeat_interval_s or interval


# ---- command line ------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("cluster membership")
    group.add_argument("--gateway", action="append", default=[], metavar="HOST:PORT",
                       help="register with this gateway (its gRPC port) and send it heartbeats; repeat for more")
    group.add_argument("--advertise-address", default=None, metavar="HOST:PORT",
                       help="where gateways reach this worker (default: --host and the bound port; "
                            "for a wildcard --host, this host's address)")
    group.add_argument("--heartbeat-interval", type=float, default=2.0, metavar="S",
                       help="seconds between heartbeats until a gateway sets it (default: %(default)s)")
    group.add_argument("--gateway-tls-ca", type=Path, default=None, metavar="FILE",
                       help="PEM CA certificate of the gateways' TLS (default: plain text)")


def advertised_address(host: str, port: int, advertise: str | None) -> str:
    if advertise:
        return advertise
    if host in ("", "0.0.0.0", "::", "[::]"):
        try:
            host = socket.gethostbyname(socket.gethostname())
        except OSError:
            host = socket.gethostname()
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def start_registration(args: argparse.Namespace, manager: ModelManager, *, use_gpus: bool, port: int,
                             metrics_port: int | None) -> Registration | None:
    """Start registering with the ``--gateway`` gateways; None when there are none."""
    if not args.gateway:
        return None
    token_file = getattr(args, "auth_token_file", None)
    config = RegistrationConfig(
        gateways=tuple(dict.fromkeys(args.gateway)),
        address=advertised_address(args.host, port, args.advertise_address),
        backend=args.backend,
        metrics_port=metrics_port or 0,
        heartbeat_interval_s=max(0.05, args.heartbeat_interval),
        # The worker's own token doubles as its credential towards the gateways.
        token=token_file.read_text(encoding="utf-8").strip() if token_file is not None else "",
        tls_root_certificates=args.gateway_tls_ca.read_bytes() if args.gateway_tls_ca is not None else None,
        version=_package_version(),
    )
    registration = Registration(config, WorkerReporter(manager, use_gpus=use_gpus))
    await registration.start()
    logger.info("registering as %s with %s", config.address, ", ".join(config.gateways))
    return registration


def _package_version() -> str:
    try:
        return importlib.metadata.version("infergate")
    except importlib.metadata.PackageNotFoundError:
        return "0.0.0"
