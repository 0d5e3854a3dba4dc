"""The processes a benchmark suite run starts, and their CPU clocks.

:class:`ProcessGroup` starts ``infergate`` subcommands (workers, gateways) as
child processes on ephemeral ports, waits for each one's ready file, and
stops everything it started when its ``with`` block ends (SIGTERM, then
SIGKILL after a grace period), newest first, so gateways stop before the
workers behind them. The suite talks to them only over their public
protocols; nothing here imports the servers.

:func:`cpu_seconds` reads a process's user + system CPU time from
``/proc/<pid>/stat`` and :func:`machine_busy_seconds` the whole machine's
from ``/proc/stat``, so the suite can report how busy a gateway (and the
machine) was during a measurement without extra dependencies.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self

log = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0
_POLL_S = 0.05
_ROOT = Path(__file__).resolve().parent.parent


class SuiteError(RuntimeError):
    """A process of the suite could not start or the cluster never became ready."""


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of ``pid`` so far; None where /proc is not available."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    rest = text.rsplit(")", 1)[1].split()
    utime, stime = int(rest[11]), int(rest[12])  # fields 14 and 15 of proc(5)
    return (utime + stime) / os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of ``pid`` and every process below it (a Triton server's Python backend stubs, the
    workers of ``up``), from /proc."""
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        total += cpu_seconds(current) or 0.0
        for task in Path(f"/proc/{current}/task").glob("*/children"):
            try:
                todo.extend(int(child) for child in task.read_text().split())
            except OSError:
                continue
    return total


def machine_busy_seconds() -> float | None:
    """CPU seconds all cores together have spent not idle since boot (``/proc/stat``)."""
    try:
        first = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    ticks = [int(v) for v in first[1:]]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    # user nice system idle iowait irq softirq; steal is the hypervisor's, and
    # guest time is already inside user.
    return (sum(ticks[:7]) - idle) / os.sysconf("SC_CLK_TCK")


@dataclass
class Service:
    """One started process and what its ready file said."""

    name: str
    popen: subprocess.Popen[bytes]
    ready_path: Path
    log_path: Path
    ready: dict[str, Any] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0fs of SIGTERM; killing it", self.name, timeout_s)
                self.popen.kill()
                self.popen.wait()
        rc = self.popen.returncode
        if rc != 0:
            log.warning("%s exited with %s; log tail:\n%s", self.name, rc, self.log_tail())
        return rc


class ProcessGroup:
    """Owns every process it starts; leaving the ``with`` block stops them all."""

    def __init__(self, workdir: Path | None = None) -> None:
        # A directory of its own: ready files of another group's processes must never be mistaken for ours.
        self._workdir = Path(tempfile.mkdtemp(prefix="procs-", dir=workdir))
        self._services: list[Service] = []
        self._counter = itertools.count()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop_all()

    def stop_all(self) -> None:
        while self._services:
            self.stop(self._services[-1])

    def stop(self, service: Service) -> int:
        if service in self._services:
            self._services.remove(service)
        return service.stop()

    def start(self, name: str, args: Sequence[str], timeout_s: float = START_TIMEOUT_S, *,
              module: str = "infergate") -> Service:
        return self.start_many([(name, args)], timeout_s, module=module)[0]

    def start_many(self, specs: Sequence[tuple[str, Sequence[str]]], timeout_s: float = START_TIMEOUT_S, *,
                   module: str = "infergate") -> list[Service]:
        """Start ``python -m MODULE ARGS --ready-file F`` (``infergate`` by default) for each spec at once,
        then wait for all to be ready."""
        started = [self._spawn(name, args, module) for name, args in specs]
        deadline = time.monotonic() + timeout_s
        pending = list(started)
        while pending:
            for service in list(pending):
                if service.ready_path.exists():
                    service.ready = json.loads(service.ready_path.read_text())
                    pending.remove(service)
                elif service.popen.poll() is not None:
                    raise SuiteError(f"{service.name} exited with {service.popen.returncode} while starting:\n{service.log_tail()}")
            if pending and time.monotonic() > deadline:
                raise SuiteError(f"{pending[0].name} not ready after {timeout_s:.0f}s:\n{pending[0].log_tail()}")
            if pending:
                time.sleep(_POLL_S)  # polling a condition (the ready files), not standing in for one
        return started

    def _spawn(self, name: str, args: Sequence[str], module: str) -> Service:
        # Never reuse a name: a stopped process may leave its ready file behind.
        index = next(self._counter)
        ready_path = self._workdir / f"{index}-{name}.ready.json"
        log_path = self._workdir / f"{index}-{name}.log"
        cmd = [sys.executable, "-m", module, *args, "--ready-file", str(ready_path)]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with open(log_path, "wb") as log_file:
            popen = subprocess.Popen(cmd, cwd=_ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
        service = Service(name, popen, ready_path, log_path)
        self._services.append(service)  # owned from here on, even if it never gets ready
        return service


def http_json(url: str, timeout_s: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout_s) as reply:
        return json.loads(reply.read())


def wait_for_cluster(http_port: int, workers: int, models: Sequence[str], timeout_s: float = 60.0) -> None:
    """Wait until the gateway sees ``workers`` ready workers and serves every one of ``models``."""
    base = f"http://127.0.0.1:{http_port}"
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            cluster = http_json(base + "/v2/cluster")
            up = sum(1 for w in cluster.get("workers", []) if w.get("state") == "ready")
            serving = {m["name"] for m in cluster.get("models", []) if m.get("state") == "ready"}
            if up >= workers and set(models) <= serving:
                return
            last = f"{up}/{workers} workers ready, models ready: {sorted(serving)}"
        except (urllib.error.URLError, OSError, ValueError) as exc:
            last = str(exc)
        time.sleep(0.2)  # polling the gateway's own view of its cluster
    raise SuiteError(f"gateway on port {http_port} not ready for {workers} workers and {list(models)}: {last}")
