"""The parent of several gateway processes: ports, children, one shutdown.

Start: reserve the HTTP and gRPC ports (port 0 resolves here, once) and one
loopback peer port per child -> write each child's spec -> start the children
(``infergate gateway --process-spec FILE``, each in its own session and
killed with the parent) -> wait for every child's ready file. The parent
serves nothing itself; it holds the reservations, and a client of the
children's internal endpoints (``peers``: ``infergate up --register`` waits
on it until every child has the workers).

Stop (SIGTERM/SIGINT to the parent, or a child that dies): SIGTERM every
child, so each drains its own queued and in-flight requests within the
grace period, then wait; a child still running after the grace period and a
margin is killed. A child that dies unexpectedly stops the whole gateway
(exit 1), so whatever supervises the gateway restarts it whole.

Process wiring, as ``gateway.app`` is: it reads the whole config (ports,
grace period, what each child is told) and hands each child all of it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from gateway.multiproc.peers import OUTSIDE, ProcessGroup
from gateway.multiproc.spec import PEER_HOST, ProcessSpec, reserve_port
from gateway.settings import ConfigError, GatewayConfig
from serverkit.process import die_with_parent, wait_for_signal, write_ready_file

log = logging.getLogger(__name__)

CHILD_START_TIMEOUT_S = 120.0
# After the grace period: time for a child to close its channels and exit.
STOP_MARGIN_S = 10.0


def process_count(requested: int) -> int:
    """``0`` means one process per core this process may run on."""
    if requested > 0:
        return requested
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


class GatewayProcesses:
    """N gateway children sharing the HTTP and gRPC ports."""

    def __init__(self, config: GatewayConfig, count: int, *, log_level: str = "INFO",
                 worker_metrics_urls: Mapping[str, str] | None = None) -> None:
        self.config = config
        self.count = count
        self.log_level = log_level
        self.worker_metrics_urls = dict(worker_metrics_urls or {})
        self.http_port = 0
        self.grpc_port = 0
        self.peer_ports: tuple[int, ...] = ()
        self.children: list[asyncio.subprocess.Process] = []
        self._reserved: list[socket.socket] = []
        self._workdir: Path | None = None
        self.peers: ProcessGroup | None = None  # the children's internal endpoints, once started

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.children]

    async def start(self) -> None:
        try:
            await self._start()
        except BaseException:
            await self.stop(0.0)
            raise

    async def _start(self) -> None:
        cfg = self.config
        if cfg.logical_models():
            # Their shards and peer groups are set up by each gateway on its own; with several
            # processes that would happen once per process.
            raise ConfigError(f"split (logical) models ({', '.join(sorted(cfg.logical_models()))}) need one "
                              "gateway process: drop --processes / --gateway-processes")
        http = reserve_port(cfg.host, cfg.http_port, "HTTP", "--http-port")
        grpc_ = reserve_port(cfg.host, cfg.grpc_port, "gRPC", "--grpc-port")
        peers = [reserve_port(PEER_HOST, 0) for _ in range(self.count)]
        self._reserved = [http, grpc_, *peers]
        self.http_port, self.grpc_port = http.getsockname()[1], grpc_.getsockname()[1]
        self.peer_ports = tuple(s.getsockname()[1] for s in peers)
        config = replace(cfg, http_port=self.http_port, grpc_port=self.grpc_port)
        self._workdir = Path(tempfile.mkdtemp(prefix="infergate-gateway-"))  # mode 0700
        secret = secrets.token_urlsafe(32)
        self.peers = ProcessGroup(ProcessSpec(config, OUTSIDE, self.peer_ports, secret, ""))
        ready_files = []
        for index in range(self.count):
            ready = self._workdir / f"ready-{index}.json"
            spec_path = self._workdir / f"spec-{index}.pickle"
            ProcessSpec(config, index, self.peer_ports, secret, str(ready), self.log_level,
                        self.worker_metrics_urls).write(spec_path)
            cmd = [sys.executable, "-m", "infergate", "gateway", "--process-spec", str(spec_path)]
            # Own session: a terminal's Ctrl-C reaches only the parent, which
            # stops the children in order; they die with it if it is killed.
            child = await asyncio.create_subprocess_exec(*cmd, start_new_session=True, preexec_fn=die_with_parent)
            self.children.append(child)
            ready_files.append(ready)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CHILD_START_TIMEOUT_S
        while not all(r.exists() for r in ready_files):
            for index, child in enumerate(self.children):
                if child.returncode is not None:
                    raise RuntimeError(f"gateway process {index} exited with {child.returncode} while starting")
            if loop.time() > deadline:
                raise RuntimeError(f"gateway processes not ready after {CHILD_START_TIMEOUT_S:.0f}s")
            # Polling a condition (the children's ready files).
            await asyncio.sleep(0.05)
        log.info("gateway serving with %d processes (pids %s): HTTP %s:%d, gRPC %s:%d", self.count,
                 ", ".join(map(str, self.pids)), cfg.host, self.http_port, cfg.host, self.grpc_port)

    async def wait_any_exit(self) -> tuple[int, int]:
        """(index, exit code) of the first child to exit."""
        waits = {asyncio.ensure_future(c.wait()): i for i, c in enumerate(self.children)}
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        first = next(iter(done))
        return waits[first], first.result()

    async def stop(self, grace_s: float) -> int:
        """SIGTERM every child, wait for all; 0 when every child exited cleanly."""
        for child in self.children:
            if child.returncode is None:
                child.send_signal(signal.SIGTERM)
        codes = await asyncio.gather(*(self._reap(i, c, grace_s + STOP_MARGIN_S) for i, c in enumerate(self.children)))
        if self.peers is not None:
            await self.peers.close()
        for sock in self._reserved:
            sock.close()
        self._reserved = []
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
        return 0 if all(rc == 0 for rc in codes) else 1

    @staticmethod
    async def _reap(index: int, child: asyncio.subprocess.Process, timeout_s: float) -> int:
        try:
            return await asyncio.wait_for(child.wait(), timeout_s)
        except asyncio.TimeoutError:
            log.warning("gateway process %d did not stop in %.0fs; killing it", index, timeout_s)
            child.kill()
            return await child.wait()


async def serve_processes(config: GatewayConfig, count: int, ready_file: str | None, log_level: str) -> int:
    """``infergate gateway --processes N``: run the children until a signal (0) or a child's death (1)."""
    group = GatewayProcesses(config, count, log_level=log_level)
    await group.start()
    write_ready_file(ready_file, {"http_port": group.http_port, "grpc_port": group.grpc_port, "pid": os.getpid(),
                                  "gateway_pids": group.pids, "peer_ports": list(group.peer_ports)})
    signalled = asyncio.ensure_future(wait_for_signal())
    died = asyncio.ensure_future(group.wait_any_exit())
    await asyncio.wait({signalled, died}, return_when=asyncio.FIRST_COMPLETED)
    signalled.cancel()
    rc = 0
    if died.done():
        index, code = died.result()
        log.error("gateway process %d exited with %s; stopping the others", index, code)
        rc = 1
    else:
        died.cancel()
        log.info("shutting down %d gateway processes (grace %.1fs)", count, config.shutdown_grace_s)
    stopped = await group.stop(config.shutdown_grace_s)
    return rc or stopped
