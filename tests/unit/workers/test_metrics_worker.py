"""The worker's metrics: Triton's per-model families over the live model
statistics, the device gauges (NVML stood in for by a fake module, /proc by
files), the text renderer, and reading devices back from that text."""

from __future__ import annotations

import logging
import sys
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from gateway.observability.cluster_api import parse_devices
from workers.metrics import (
    DeviceCollector,
    GpuMonitor,
    HostMonitor,
    TritonCounter,
    WorkerModelCollector,
    render_text,
)
from execution.backends.generate_scheduler import GenerationStats
from execution.backends.prefix_cache import PrefixStats
from execution.stats import ExecutionTiming, ModelStats


class Families(Collector):
    def __init__(self, *families: Any) -> None:
        self.families = families

    def collect(self) -> Any:
        return iter(self.families)


def parse(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {(s.name, frozenset(s.labels.items())): s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_render_text_keeps_triton_names_and_standard_suffixes() -> None:
    triton = TritonCounter("nv_inference_count", "Inferences", ["model", "version"])
    triton.add_metric(["a\"b\\c\nd", "1"], 7)
    standard = CounterMetricFamily("infergate_things", "Things", labels=["x"])
    standard.add_metric(["y"], 2.5)
    gauge = GaugeMetricFamily("infergate_level", "Level\nwith a newline", value=0.25)
    hist = HistogramMetricFamily("infergate_sizes", "Sizes", labels=["m"])
    hist.add_metric(["m1"], [("1.0", 1), ("+Inf", 3)], 7)
    text = render_text([Families(triton, standard, gauge, hist)]).decode()
    assert "# TYPE nv_inference_count counter\nnv_inference_count{model=" in text
    assert "# TYPE infergate_things_total counter\ninfergate_things_total{x=\"y\"} 2.5\n" in text
    assert "# HELP infergate_level Level\\nwith a newline\n" in text
    samples = parse(text)
    assert samples[("nv_inference_count_total", frozenset({("model", "a\"b\\c\nd"), ("version", "1")}))] == 7
    assert samples[("infergate_things_total", frozenset({("x", "y")}))] == 2.5
    assert samples[("infergate_level", frozenset())] == 0.25
    assert samples[("infergate_sizes_bucket", frozenset({("m", "m1"), ("le", "+Inf")}))] == 3
    assert samples[("infergate_sizes_sum", frozenset({("m", "m1")}))] == 7


def loaded(name: str, version: int, inflight: int = 0, instances: tuple[object, ...] = ()) -> SimpleNamespace:
    return SimpleNamespace(name=name, version=version, version_str=str(version), stats=ModelStats(), inflight=inflight,
                           instances=list(instances))


def test_worker_model_families_read_live_statistics() -> None:
    a, b = loaded("simple", 1, inflight=2), loaded("mlp", 3)
    manager = SimpleNamespace(loaded=lambda: [a, b])
    a.stats.record_success(ExecutionTiming(4, 1_000, 2_000, 30_000, 4_000, 40_000))
    a.stats.record_success(ExecutionTiming(2, 1_000, 2_000, 30_000, 4_000, 40_000))
    a.stats.record_failure(5_000)
    samples = parse(render_text([WorkerModelCollector(manager)]).decode())  # type: ignore[arg-type]
    m = frozenset({("model", "simple"), ("version", "1")})
    assert samples[("nv_inference_request_success_total", m)] == 2
    assert samples[("nv_inference_request_failure_total", m | {("reason", "OTHER")})] == 1
    assert samples[("nv_inference_count_total", m)] == 6
    assert samples[("nv_inference_exec_count_total", m)] == 2
    assert samples[("nv_inference_request_duration_us_total", m)] == 80
    assert samples[("nv_inference_queue_duration_us_total", m)] == 2
    assert samples[("nv_inference_compute_input_duration_us_total", m)] == 4
    assert samples[("nv_inference_compute_infer_duration_us_total", m)] == 60
    assert samples[("nv_inference_compute_output_duration_us_total", m)] == 8
    assert samples[("nv_inference_pending_request_count", m)] == 2
    assert samples[("nv_inference_count_total", frozenset({("model", "mlp"), ("version", "3")}))] == 0
    assert samples[("infergate_worker_models_loaded", frozenset())] == 2
    assert not any(name.startswith("infergate_generation_") for name, _ in samples)


def test_generation_families_sum_a_model_s_schedulers() -> None:
    def instance(running: int, waiting: int) -> SimpleNamespace:
        prefix = PrefixStats(queried_tokens=50 * running, hit_tokens=32 * running, queries=2, hits=running,
                             blocks=running, bytes=1024 * running, evicted_blocks=1, held_blocks=running - 1)
        stats = GenerationStats(running, waiting, cache_bytes=100 * running, reserved_cache_bytes=300 * running,
                                tokens_generated=7, steps=3, prefix=prefix)
        return SimpleNamespace(generation_stats=lambda: stats)

    manager = SimpleNamespace(loaded=lambda: [loaded("tiny_lm", 1, instances=(instance(3, 1), instance(2, 0))),
                                              loaded("mlp", 1, instances=(SimpleNamespace(),))])
    samples = parse(render_text([WorkerModelCollector(manager)]).decode())  # type: ignore[arg-type]
    m = frozenset({("model", "tiny_lm"), ("version", "1")})
    assert samples[("infergate_generation_tokens_total", m)] == 14
    assert samples[("infergate_generation_sequences_running", m)] == 5
    assert samples[("infergate_generation_sequences_waiting", m)] == 1
    assert samples[("infergate_generation_cache_bytes", m)] == 500
    assert samples[("infergate_generation_cache_reserved_bytes", m)] == 1500
    assert samples[("infergate_generation_prefix_cache_queries_total", m)] == 250
    assert samples[("infergate_generation_prefix_cache_hits_total", m)] == 160
    assert samples[("infergate_generation_prefix_cache_hit_requests_total", m)] == 5
    assert samples[("infergate_generation_prefix_cache_evicted_blocks_total", m)] == 2
    assert samples[("infergate_generation_prefix_cache_blocks", m)] == 5
    assert samples[("infergate_generation_prefix_cache_held_blocks", m)] == (3 - 1) + (2 - 1)
    assert samples[("infergate_generation_prefix_cache_bytes", m)] == 5 * 1024
    assert ("infergate_generation_tokens_total", frozenset({("model", "mlp"), ("version", "1")})) not in samples


class FakeNvml(types.ModuleType):
    """Enough of pynvml for two GPUs, the second without utilisation (as on MIG)."""

    class NVMLError(Exception):
        pass

    def __init__(self, fail_init: bool = False) -> None:
        super().__init__("pynvml")
        self.fail_init = fail_init
        self.shutdown = False

    def nvmlInit(self) -> None:
        if self.fail_init:
            raise self.NVMLError("NVML Shared Library Not Found")

    def nvmlShutdown(self) -> None:
        self.shutdown = True

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetUUID(self, h: int) -> bytes:
        return f"GPU-{h}aaa".encode()

    def nvmlDeviceGetName(self, h: int) -> str:
        return "Test GPU"

    def nvmlDeviceGetMemoryInfo(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(total=80 * 2**30, used=(h + 1) * 2**30)

    def nvmlDeviceGetUtilizationRates(self, h: int) -> SimpleNamespace:
        if h == 1:
            raise self.NVMLError("Not Supported")
        return SimpleNamespace(gpu=42)


def test_no_nvml_means_no_gpu_metrics_and_no_warnings(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(fail_init=True))
    caplog.set_level(logging.DEBUG)
    collector = DeviceCollector(host=HostMonitor(Path("/nonexistent")))
    assert list(collector.collect()) == []
    assert list(collector.collect()) == []
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    collector.close()


def test_no_nvml_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    assert GpuMonitor().sample() == []


def test_gpu_gauges_and_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monitor = GpuMonitor()
    gpus = monitor.sample()
    assert [(g.index, g.uuid, g.memory_used_bytes, g.utilization) for g in gpus] == [
        (0, "GPU-0aaa", 2**30, 0.42), (1, "GPU-1aaa", 2 * 2**30, None)]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-1")
    assert [g.index for g in monitor.sample()] == [1]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert [g.index for g in monitor.sample()] == [0]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")

    text = render_text([DeviceCollector(monitor, HostMonitor(Path("/nonexistent")))]).decode()
    samples = parse(text)
    assert samples[("nv_gpu_utilization", frozenset({("gpu_uuid", "GPU-0aaa")}))] == 0.42
    assert ("nv_gpu_utilization", frozenset({("gpu_uuid", "GPU-1aaa")})) not in samples
    assert samples[("nv_gpu_memory_total_bytes", frozenset({("gpu_uuid", "GPU-1aaa")}))] == 80 * 2**30
    # The gateway reads the same text back into the cluster view's devices.
    devices = parse_devices(text)
    assert [(d["kind"], d["name"], d["index"], d["memory_used_bytes"]) for d in devices] == [
        ("gpu", "Test GPU", 0, 2**30), ("gpu", "Test GPU", 1, 2 * 2**30)]
    assert devices[0]["utilization"] == 0.42 and "utilization" not in devices[1]
    monitor.close()
    assert nvml.shutdown


def write_proc(root: Path, idle: int, busy: int) -> None:
    (root / "meminfo").write_text("MemTotal:       1000 kB\nMemFree:         100 kB\nMemAvailable:    400 kB\n")
    (root / "stat").write_text(f"cpu  {busy} 0 0 {idle} 0 0 0 0 0 0\ncpu0 1 2 3 4\n")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="host metrics read /proc")
def test_host_memory_and_utilisation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # whatever this machine has: no GPU here
    write_proc(tmp_path, idle=100, busy=100)
    host = HostMonitor(tmp_path)
    first = host.sample()
    assert first is not None
    assert (first.memory_total_bytes, first.memory_used_bytes, first.utilization) == (1024_000, 600 * 1024, None)
    write_proc(tmp_path, idle=130, busy=170)  # 70 busy ticks of 100
    second = host.sample()
    assert second is not None and second.utilization == pytest.approx(0.7)
    samples = parse(render_text([DeviceCollector(GpuMonitor(), host)]).decode())
    assert samples[("nv_cpu_memory_total_bytes", frozenset())] == 1024_000
    assert samples[("nv_cpu_utilization", frozenset())] == pytest.approx(0.7)  # no tick since: the last rate
    [device] = parse_devices(render_text([DeviceCollector(GpuMonitor(), HostMonitor(tmp_path))]).decode())
    assert device == {"kind": "cpu", "name": "host", "memory_total_bytes": 1024_000, "memory_used_bytes": 600 * 1024}
