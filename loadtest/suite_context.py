"""What every section of the benchmark suite shares: its settings, progress
lines, how it starts workers and gateways, and the one way it measures
(``infergate bench``'s Python API, :func:`bench`).

A section gets a :class:`SuiteContext`, starts what it needs inside its own
:class:`~loadtest.suite_procs.ProcessGroup` (so everything it started is
stopped when it returns or fails) and returns a
:class:`~loadtest.suite_report.SectionResult`.
"""

from __future__ import annotations

import math
import os
import platform
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from loadtest.config import BenchConfig, Protocol
from loadtest.report import LevelResult
from loadtest.runner import run_bench
from loadtest.suite_procs import ProcessGroup, Service, SuiteError, wait_for_cluster


@dataclass(frozen=True, slots=True)
class SuiteSettings:
    model_repository: Path
    quick: bool = False
    # Time windows of a loaded level: a level ends once 3 windows agree
    # within stability_pct, or after max_trials windows.
    window_ms: int = 2000
    max_trials: int = 5
    stability_pct: float = 15.0
    warmup_s: float = 1.0
    # Low-load latency runs: shorter windows, several interleaved rounds.
    latency_window_ms: int = 1000
    latency_rounds: int = 3
    scale_workers: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    large_repository: Path | None = None  # holds encoder_large (the parallel_large section)

    @classmethod
    def for_run(cls, model_repository: Path, quick: bool) -> SuiteSettings:
        if not quick:
            return cls(model_repository)
        # A smoke run of the whole pipeline in well under a minute; numbers are rough.
        return cls(model_repository, quick=True, window_ms=500, max_trials=3, stability_pct=50.0, warmup_s=0.2,
                   latency_window_ms=300, latency_rounds=1, scale_workers=(1, 2))  # fmt: skip


def copy_model(source: Path, root: Path, name: str, as_name: str, parameters: Mapping[str, str]) -> None:
    """Model ``name`` of ``source`` as ``as_name`` under ``root``, with more config ``parameters``."""
    shutil.copytree(source / name, root / as_name, dirs_exist_ok=True)
    path = root / as_name / "config.pbtxt"
    config = path.read_text().replace(f'name: "{name}"', f'name: "{as_name}"')
    for key, value in parameters.items():
        config += f'parameters {{\n  key: "{key}"\n  value {{\n    string_value: "{value}"\n  }}\n}}\n'
    path.write_text(config)


class SuiteContext:
    def __init__(self, settings: SuiteSettings, workdir: Path) -> None:
        self.settings = settings
        self.workdir = workdir
        self._started = time.monotonic()
        self._configs = 0

    def progress(self, message: str) -> None:
        print(f"[bench {time.monotonic() - self._started:6.1f}s] {message}", file=sys.stderr, flush=True)

    # --- processes -------------------------------------------------------------------

    def worker_args(self, *extra: str) -> list[str]:
        # One intra-op thread per execution: the raw ONNX Runtime ceiling uses the same.
        return ["worker", "--model-repository", str(self.settings.model_repository), "--host", "127.0.0.1",
                "--port", "0", "--intra-op-threads", "1", "--log-level", "warning", *extra]  # fmt: skip

    def start_workers(self, procs: ProcessGroup, count: int, *extra: str, name: str = "worker") -> list[Service]:
        """Start ``count`` workers at once (see :func:`grpc_address`)."""
        return procs.start_many([(f"{name}-{i}", self.worker_args(*extra)) for i in range(count)])

    def start_gateway(self, procs: ProcessGroup, workers: Sequence[str], config: Mapping[str, Any],
                      models: Sequence[str]) -> Service:
        """A gateway in front of ``workers`` with a YAML ``config``; waits until it serves ``models``."""
        self._configs += 1
        path = self.workdir / f"gateway-{self._configs}.yaml"
        path.write_text(yaml.safe_dump(dict(config)))  # safe_dump quotes "off", which YAML would read as false
        args = ["gateway", "--host", "127.0.0.1", "--http-port", "0", "--grpc-port", "0", "--config", str(path),
                "--log-level", "WARNING"]  # fmt: skip
        for address in workers:
            args += ["--worker", address]
        gateway = procs.start("gateway", args)
        wait_for_cluster(gateway.ready["http_port"], len(workers), models)
        return gateway

    # --- measuring --------------------------------------------------------------------

    def bench(self, model: str, url: str, protocol: str = "grpc", *, concurrency: int = 1, batch_size: int = 1,
              requests: int = 0, warmup_requests: int = 0, window_ms: int = 0,
              http_binary: bool = True) -> LevelResult:
        """One load level with ``infergate bench``: ``requests`` > 0 counts requests, else time windows
        (of ``window_ms``, default the settings')."""
        s = self.settings
        config = BenchConfig(
            model=model, url=url, protocol=Protocol(protocol), batch_size=batch_size, concurrency=(concurrency,),
            request_count=requests, warmup_requests=warmup_requests if requests else 0,
            warmup_s=0.0 if requests else s.warmup_s,
            measurement_interval_ms=window_ms or s.window_ms, max_trials=s.max_trials, stability_percentage=s.stability_pct,
            http_binary=http_binary, seed=0,
        )  # fmt: skip
        result = run_bench(config)
        if not result.levels:
            raise SuiteError(f"bench of {model} at {url} returned no level")
        level = result.levels[0]
        if level.requests == 0:
            raise SuiteError(f"bench of {model} at {url} ({protocol}): no request succeeded; errors {level.errors}")
        return level


def grpc_address(service: Service) -> str:
    return f"127.0.0.1:{service.ready['grpc_port']}"


def ms(us: float) -> float:
    return us / 1000.0


def median(values: Sequence[float]) -> float:
    data = sorted(v for v in values if not math.isnan(v))
    if not data:
        return math.nan
    mid = len(data) // 2
    return data[mid] if len(data) % 2 else (data[mid - 1] + data[mid]) / 2


def describe_machine() -> dict[str, Any]:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory_gib = math.nan
    try:
        memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        pass
    gpu = any(Path("/dev").glob("nvidia[0-9]*"))
    summary = f"{cores} CPU cores ({cpu}), {memory_gib:.0f} GiB RAM, {'GPU present' if gpu else 'no GPU'}"
    return {"cores": cores, "cpu": cpu, "memory_gib": round(memory_gib, 1), "gpu": gpu, "summary": summary,
            "python": platform.python_version(), "os": platform.platform()}  # fmt: skip
