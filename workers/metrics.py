"""The worker's Prometheus metrics.

Per loaded model version, Triton's ``nv_inference_*`` families, read from the
live ``ModelStats`` at scrape time (no second set of counters), and per
generation model the ``infergate_generation_*`` families (tokens, running and
waiting sequences, KV cache bytes) read from its schedulers. Per device,
Triton's ``nv_gpu_*`` gauges through NVML (the ``nvidia-ml-py`` package) when
it is installed and a driver answers, and the host's ``nv_cpu_*`` gauges from
``/proc``. A machine without a GPU simply has no ``nv_gpu_*`` series: that is
not an error and is logged at debug level only.

The endpoint is a small aiohttp server beside the gRPC one
(``--metrics-port``), on the same event loop: the collectors read counters
that only the loop thread writes, so a scrape never sees them mid-update.

The text format itself is ``serverkit.prometheus``'s, shared with the gateway.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from serverkit.nvml import Nvml
from serverkit.prometheus import CONTENT_TYPE, MODEL_LABELS, ModelCounters, TritonCounter, render_text

if TYPE_CHECKING:
    from execution.backends.prefix_cache import PrefixStats
    from execution.manager import ModelManager
    from execution.model import LoadedModel

logger = logging.getLogger(__name__)

# ---- devices --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GpuSample:
    index: int
    uuid: str
    name: str
    memory_total_bytes: int
    memory_used_bytes: int
    utilization: float | None  # 0..1 over NVML's last sample period; None where unsupported (MIG)


@dataclass(frozen=True, slots=True)
class HostSample:
    memory_total_bytes: int
    memory_used_bytes: int
    utilization: float | None  # 0..1 since the previous sample; None on the first


class GpuMonitor:
    """GPU memory and utilisation through NVML; empty when NVML or a GPU is absent."""

    def __init__(self) -> None:
        self._nvml = Nvml("GPU metrics")

    def sample(self) -> list[GpuSample]:
        nvml = self._nvml.get()
        if nvml is None:
            return []
        try:
            count = nvml.nvmlDeviceGetCount()
        except nvml.NVMLError as e:
            logger.debug("NVML device count failed: %s", e)
            return []
        visible = _visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES"))
        samples = []
        for index in range(count):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                uuid = _text(nvml.nvmlDeviceGetUUID(handle))
                if visible is not None and str(index) not in visible and not any(uuid.startswith(v) for v in visible):
                    continue
                memory = nvml.nvmlDeviceGetMemoryInfo(handle)
                name = _text(nvml.nvmlDeviceGetName(handle))
            except nvml.NVMLError as e:
                logger.debug("NVML query of GPU %d failed: %s", index, e)
                continue
            try:
                utilization: float | None = nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0
            except nvml.NVMLError:
                utilization = None  # not supported on MIG instances, for one
            samples.append(GpuSample(index, uuid, name, int(memory.total), int(memory.used), utilization))
        return samples

    def close(self) -> None:
        self._nvml.close()


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _visible_devices(value: str | None) -> set[str] | None:
    """The entries of ``CUDA_VISIBLE_DEVICES`` (indices or UUID prefixes); None = all devices."""
    if value is None:
        return None
    return {v.strip() for v in value.split(",") if v.strip()}


class HostMonitor:
    """The host's memory and CPU use from ``/proc`` (Linux); None elsewhere."""

    def __init__(self, proc: Path = Path("/proc")) -> None:
        self._proc = proc
        self._last_cpu: tuple[int, int] | None = None  # (idle, total) ticks at the last sample
        self._utilization: float | None = None

    def sample(self) -> HostSample | None:
        if not sys.platform.startswith("linux"):
            return None
        try:
            meminfo = (self._proc / "meminfo").read_text()
            cpu_line = (self._proc / "stat").read_text().split("\n", 1)[0]
        except OSError:
            return None
        fields = {}
        for line in meminfo.splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                fields[key] = int(parts[0]) * 1024
        total = fields.get("MemTotal", 0)
        available = fields.get("MemAvailable", fields.get("MemFree", 0))
        ticks = [int(v) for v in cpu_line.split()[1:] if v.isdigit()]
        # idle + iowait count as idle, as top does.
        idle, busy_total = (ticks[3] + (ticks[4] if len(ticks) > 4 else 0)), sum(ticks)
        if self._last_cpu is None:
            self._last_cpu = (idle, busy_total)
        else:
            d_total = busy_total - self._last_cpu[1]
            # Two scrapes within one clock tick: keep the last rate and its baseline.
            if d_total > 0:
                d_idle = idle - self._last_cpu[0]
                self._utilization = max(0.0, min(1.0, 1.0 - d_idle / d_total))
                self._last_cpu = (idle, busy_total)
        return HostSample(total, max(0, total - available), self._utilization)


class DeviceCollector(Collector):
    """``nv_gpu_*`` and ``nv_cpu_*`` gauges, sampled at scrape time."""

    def __init__(self, gpus: GpuMonitor | None = None, host: HostMonitor | None = None) -> None:
        self.gpus = gpus or GpuMonitor()
        self.host = host or HostMonitor()

    def collect(self) -> Iterator[Metric]:
        gpus = self.gpus.sample()
        if gpus:
            info = GaugeMetricFamily("infergate_gpu_info", "GPU name and index (value 1)", labels=["gpu_uuid", "name", "index"])
            util = GaugeMetricFamily("nv_gpu_utilization", "GPU utilization rate [0.0 - 1.0)", labels=["gpu_uuid"])
            total = GaugeMetricFamily("nv_gpu_memory_total_bytes", "GPU total memory, in bytes", labels=["gpu_uuid"])
            used = GaugeMetricFamily("nv_gpu_memory_used_bytes", "GPU used memory, in bytes", labels=["gpu_uuid"])
            for g in gpus:
                info.add_metric([g.uuid, g.name, str(g.index)], 1)
                if g.utilization is not None:
                    util.add_metric([g.uuid], g.utilization)
                total.add_metric([g.uuid], g.memory_total_bytes)
                used.add_metric([g.uuid], g.memory_used_bytes)
            yield from (info, util, total, used)
        host = self.host.sample()
        if host is not None:
            if host.utilization is not None:
                yield GaugeMetricFamily("nv_cpu_utilization", "CPU utilization rate [0.0 - 1.0]", value=host.utilization)
            yield GaugeMetricFamily("nv_cpu_memory_total_bytes", "CPU total memory (RAM), in bytes", value=host.memory_total_bytes)
            yield GaugeMetricFamily("nv_cpu_memory_used_bytes", "CPU used memory (RAM), in bytes", value=host.memory_used_bytes)

    def close(self) -> None:
        self.gpus.close()


# ---- per-model inference metrics ------------------------------------------------------


class WorkerModelCollector(Collector):
    """Triton's per-model families over the worker's loaded model versions."""

    def __init__(self, manager: ModelManager) -> None:
        self._manager = manager

    def collect(self) -> Iterator[Metric]:
        labels = list(MODEL_LABELS)
        counters = ModelCounters.declare()
        input_us = TritonCounter(
            "nv_inference_compute_input_duration_us", "Cumulative compute input duration in microseconds", labels
        )
        output_us = TritonCounter(
            "nv_inference_compute_output_duration_us", "Cumulative inference compute output duration in microseconds", labels
        )
        pending = GaugeMetricFamily(
            "nv_inference_pending_request_count",
            "Instantaneous number of requests in progress (waiting for an instance or running)",
            labels=labels,
        )
        models = sorted(self._manager.loaded(), key=lambda m: (m.name, m.version))
        for model in models:
            key = [model.name, model.version_str]
            s = model.stats
            counters.success.add_metric(key, s.success.count)
            # The worker does not tell failure causes apart yet; Triton's catch-all reason.
            counters.failure.add_metric([*key, "OTHER"], s.fail.count)
            counters.count.add_metric(key, s.inference_count)
            counters.execs.add_metric(key, s.execution_count)
            counters.request_us.add_metric(key, s.success.ns // 1000)
            counters.queue_us.add_metric(key, s.queue.ns // 1000)
            input_us.add_metric(key, s.compute_input.ns // 1000)
            counters.infer_us.add_metric(key, s.compute_infer.ns // 1000)
            output_us.add_metric(key, s.compute_output.ns // 1000)
            pending.add_metric(key, model.inflight)
        yield from (counters.success, counters.failure, counters.count, counters.execs, counters.request_us, counters.queue_us, input_us, counters.infer_us, output_us, pending)
        yield from _generation_metrics(models, labels)
        yield GaugeMetricFamily("infergate_worker_models_loaded", "Model versions loaded now", value=len(models))


def _generation_metrics(models: list[LoadedModel], labels: list[str]) -> Iterator[Metric]:
    """Per generation model (instances with ``generation_stats``): tokens, sequences, KV cache in use."""
    tokens = CounterMetricFamily("infergate_generation_tokens", "Tokens generated", labels=labels)
    running = GaugeMetricFamily("infergate_generation_sequences_running", "Sequences in the running batch", labels=labels)
    waiting = GaugeMetricFamily("infergate_generation_sequences_waiting", "Sequences admitted, waiting to join the batch",
                                labels=labels)
    cache = GaugeMetricFamily("infergate_generation_cache_bytes", "KV cache held by running sequences, in bytes",
                              labels=labels)
    reserved = GaugeMetricFamily("infergate_generation_cache_reserved_bytes",
                                 "KV cache reserved by admitted sequences (prompt + max_tokens), in bytes", labels=labels)
    prefix = _PrefixFamilies(labels)
    found = False
    for model in models:
        samples = [stats() for stats in (getattr(i, "generation_stats", None) for i in model.instances) if stats is not None]
        if not samples:
            continue
        found = True
        key = [model.name, model.version_str]
        tokens.add_metric(key, sum(s.tokens_generated for s in samples))
        running.add_metric(key, sum(s.running for s in samples))
        waiting.add_metric(key, sum(s.waiting for s in samples))
        cache.add_metric(key, sum(s.cache_bytes for s in samples))
        reserved.add_metric(key, sum(s.reserved_cache_bytes for s in samples))
        prefix.add(key, [s.prefix for s in samples if s.prefix is not None])
    if found:
        yield from (tokens, running, waiting, cache, reserved)
        yield from prefix.families()


class _PrefixFamilies:
    """The prefix caches' figures per model (those with one): tokens looked up and found (vLLM's
    ``prefix_cache_queries`` / ``prefix_cache_hits``), requests with a hit, blocks cached (and of those,
    held in running sequences' caches), the bytes of the cache's own copies, blocks evicted."""

    def __init__(self, labels: list[str]) -> None:
        self.queries = CounterMetricFamily("infergate_generation_prefix_cache_queries",
                                           "Prompt tokens looked up in the prefix cache", labels=labels)
        self.hits = CounterMetricFamily("infergate_generation_prefix_cache_hits",
                                        "Prompt tokens found in the prefix cache (not prefilled again)", labels=labels)
        self.requests = CounterMetricFamily("infergate_generation_prefix_cache_hit_requests",
                                            "Requests whose prompt opened with cached blocks", labels=labels)
        self.evicted = CounterMetricFamily("infergate_generation_prefix_cache_evicted_blocks",
                                           "Prefix cache blocks evicted to make room", labels=labels)
        self.blocks = GaugeMetricFamily("infergate_generation_prefix_cache_blocks", "Prompt blocks cached now",
                                        labels=labels)
        self.held = GaugeMetricFamily("infergate_generation_prefix_cache_held_blocks",
                                      "Cached prompt blocks whose entries are in a running sequence's cache",
                                      labels=labels)
        self.bytes = GaugeMetricFamily("infergate_generation_prefix_cache_bytes",
                                       "KV cache taken by the prefix cache's own copies of blocks, in bytes",
                                       labels=labels)
        self._any = False

    def add(self, key: list[str], samples: list[PrefixStats]) -> None:
        if not samples:
            return
        self._any = True
        self.queries.add_metric(key, sum(s.queried_tokens for s in samples))
        self.hits.add_metric(key, sum(s.hit_tokens for s in samples))
        self.requests.add_metric(key, sum(s.hits for s in samples))
        self.evicted.add_metric(key, sum(s.evicted_blocks for s in samples))
        self.blocks.add_metric(key, sum(s.blocks for s in samples))
        self.held.add_metric(key, sum(s.held_blocks for s in samples))
        self.bytes.add_metric(key, sum(s.bytes for s in samples))

    def families(self) -> Iterator[Metric]:
        if self._any:
            yield from (self.queries, self.hits, self.requests, self.evicted, self.blocks, self.held, self.bytes)


# ---- the endpoint -------------------------------------------------------------------


class MetricsServer:
    """``GET /metrics`` on its own port, served on the worker's event loop."""

    def __init__(self, collectors: list[Collector]) -> None:
        self._collectors = [*collectors, ProcessCollector(registry=None)]
        self._runner: web.AppRunner | None = None

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=render_text(self._collectors), headers={"Content-Type": CONTENT_TYPE})

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0 = a free port); returns the real port."""
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        self._runner = runner
        site = web.TCPSite(runner, host, port, reuse_port=False)
        await site.start()
        return int(runner.addresses[0][1])

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
