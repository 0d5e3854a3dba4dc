"""The gateway's metrics collector and the cluster API documents, over a
stand-in gateway built from the real statistics, latency histograms, worker
records and router: what a scrape and a poll would show, and that
prometheus-client's parser reads it back."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
import time
from types import MappingProxyType, SimpleNamespace
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.grpc import model_config_pb2, service_pb2

from gateway.batching.seams import BatcherStats
from gateway.fleet.cluster import ModelInfo, WorkerModel, WorkerState, WorkerStatus
from gateway.observability.cluster_api import DeviceMonitor, cluster_stats, cluster_view
from gateway.observability.latency import LATENCY_BUCKETS_S, LatencyHistograms
from gateway.observability.metrics import BATCH_SIZE_BUCKETS, GatewayCollector, batch_size_counts, triton_failure_reason
from gateway.observability.stats import GatewayStats
from gateway.parallel.served import ParallelStats
from gateway.routing.outlier import OutlierDetector
from gateway.routing.router import Router
from gateway.settings import OutlierSettings, WorkerSpec
from serverkit.prometheus import render_text


class FakeCluster:
    def __init__(self, workers: list[WorkerState]) -> None:
        self._workers = workers

    def on_change(self, listener: Callable[[], None]) -> Callable[[], None]:
        return lambda: None

    def workers(self) -> list[WorkerState]:
        return list(self._workers)

    def models(self) -> MappingProxyType[str, ModelInfo]:
        replicas: dict[str, list[WorkerState]] = {}
        for w in self._workers:
            if w.state is WorkerStatus.READY:
                for name in w.models:
                    replicas.setdefault(name, []).append(w)
        return MappingProxyType({
            name: ModelInfo(name, ws[0].models[name].versions, ws[0].models[name].config, ws[0].models[name].metadata, tuple(ws))
            for name, ws in replicas.items()
        })

    def known_models(self) -> dict[str, WorkerModel]:
        known: dict[str, WorkerModel] = {}
        for w in self._workers:
            for name, wm in w.models.items():
                known.setdefault(name, wm)
        return known


@dataclass
class FakeBatcher:
    depth: int
    inflight: int = 0
    policy: Any = field(default_factory=lambda: SimpleNamespace(max_queue_size=64))
    stats: BatcherStats = field(default_factory=BatcherStats)

    def queue_depth(self) -> int:
        return self.depth

    def inflight_batches(self) -> int:
        return self.inflight


def worker_model(name: str, max_batch_size: int = 8) -> WorkerModel:
    config = model_config_pb2.ModelConfig(name=name, max_batch_size=max_batch_size, platform="onnxruntime_onnx")
    return WorkerModel(name, ("1",), config, service_pb2.ModelMetadataResponse(name=name))


class FakeGateway:
    def __init__(self) -> None:
        up = WorkerState(WorkerSpec("10.0.0.1:8001"), client=object(), state=WorkerStatus.READY)  # type: ignore[arg-type]
        up.models = {"simple": worker_model("simple"), "mlp": worker_model("mlp", 64)}
        up.inflight, up.sent, up.failures, up.retries = 2, 10, 1, 1
        down = WorkerState(WorkerSpec("10.0.0.2:8001"), client=object(), state=WorkerStatus.DOWN,  # type: ignore[arg-type]
                           last_error="connection refused")
        down.models = {"mlp": worker_model("mlp", 64), "lonely": worker_model("lonely")}
        self.cluster = FakeCluster([up, down])
        self.router = Router(self.cluster)  # type: ignore[arg-type]
        self.stats = GatewayStats()
        self.latency = LatencyHistograms()
        self._batchers = {("simple", "1"): FakeBatcher(depth=3, inflight=1)}
        self._batchers[("simple", "1")].stats.rejected_full = 4
        self._batchers[("simple", "1")].stats.expired = 2

    def batchers(self) -> dict[tuple[str, str], FakeBatcher]:
        return dict(self._batchers)

    def server_ready(self) -> bool:
        return True


@pytest.fixture
def gw() -> FakeGateway:
    g = FakeGateway()
    for rows, total_ns in ((1, 2_000_000), (3, 4_000_000)):
        g.stats.record_success("simple", "1", rows, total_ns, queue_ns=500_000)
        g.latency.observe("simple", "1", total_ns / 1e9)
    g.stats.record_execution("simple", "1", 4, 3_000_000)
    g.stats.record_failure("simple", "1", 1_000, "Overloaded")
    g.stats.record_failure("simple", "1", 1_000, "InvalidArgument")
    return g


def scrape(gw: FakeGateway) -> tuple[dict[tuple[str, frozenset[tuple[str, str]]], float], dict[str, str], str]:
    text = render_text([GatewayCollector(gw)]).decode()  # type: ignore[arg-type]
    samples, types = {}, {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples, types, text


def key(name: str, **labels: str) -> tuple[str, frozenset[tuple[str, str]]]:
    return (name, frozenset(labels.items()))


def test_triton_families_read_the_live_statistics(gw: FakeGateway) -> None:
    samples, types, text = scrape(gw)
    m = {"model": "simple", "version": "1"}
    assert types["nv_inference_request_success"] == "counter"
    assert "\nnv_inference_request_success{model=\"simple\",version=\"1\"} 2\n" in text
    assert samples[key("nv_inference_request_success_total", **m)] == 2
    assert samples[key("nv_inference_count_total", **m)] == 4
    assert samples[key("nv_inference_exec_count_total", **m)] == 1
    assert samples[key("nv_inference_request_duration_us_total", **m)] == 6000
    assert samples[key("nv_inference_queue_duration_us_total", **m)] == 1000
    assert samples[key("nv_inference_compute_infer_duration_us_total", **m)] == 3000
    assert samples[key("nv_inference_request_failure_total", **m, reason="REJECTED", error="Overloaded")] == 1
    assert samples[key("nv_inference_request_failure_total", **m, reason="OTHER", error="InvalidArgument")] == 1
    # The counters are read at scrape time: a new request shows at the next scrape.
    gw.stats.record_success("simple", "1", 2, 1_000_000, 0)
    assert scrape(gw)[0][key("nv_inference_request_success_total", **m)] == 3


def test_histograms(gw: FakeGateway) -> None:
    samples, types, _ = scrape(gw)
    m = {"model": "simple", "version": "1"}
    assert types["infergate_batch_size"] == "histogram"
    assert samples[key("infergate_batch_size_bucket", **m, le="2.0")] == 0
    assert samples[key("infergate_batch_size_bucket", **m, le="4.0")] == 1
    assert samples[key("infergate_batch_size_count", **m)] == 1
    assert samples[key("infergate_batch_size_sum", **m)] == 4
    assert samples[key("infergate_request_duration_seconds_count", **m)] == 2
    assert samples[key("infergate_request_duration_seconds_bucket", **m, le="0.002")] == 1
    assert samples[key("infergate_request_duration_seconds_bucket", **m, le="0.003")] == 1
    assert samples[key("infergate_request_duration_seconds_bucket", **m, le="0.005")] == 2
    assert samples[key("infergate_request_duration_seconds_sum", **m)] == pytest.approx(0.006)


def test_queue_worker_and_cluster_families(gw: FakeGateway) -> None:
    samples, _, _ = scrape(gw)
    m = {"model": "simple", "version": "1"}
    assert samples[key("nv_inference_pending_request_count", **m)] == 3
    assert samples[key("infergate_queue_depth", **m)] == 3
    assert samples[key("infergate_queue_capacity", **m)] == 64
    assert samples[key("infergate_batches_inflight", **m)] == 1
    assert samples[key("infergate_rejected_requests_total", **m, reason="queue_full")] == 4
    assert samples[key("infergate_rejected_requests_total", **m, reason="deadline")] == 2
    assert samples[key("infergate_rejected_requests_total", **m, reason="displaced")] == 0
    assert samples[key("infergate_worker_state", worker="10.0.0.1:8001", state="READY")] == 1
    assert samples[key("infergate_worker_state", worker="10.0.0.2:8001", state="DOWN")] == 1
    assert samples[key("infergate_worker_state", worker="10.0.0.2:8001", state="READY")] == 0
    assert samples[key("infergate_worker_inflight_batches", worker="10.0.0.1:8001")] == 2
    assert samples[key("infergate_worker_batches_total", worker="10.0.0.1:8001")] == 10
    assert samples[key("infergate_worker_failures_total", worker="10.0.0.1:8001")] == 1
    assert samples[key("infergate_worker_retries_total", worker="10.0.0.1:8001")] == 1
    assert samples[key("infergate_worker_models", worker="10.0.0.2:8001")] == 2
    assert samples[key("infergate_model_replicas", model="mlp")] == 1  # the DOWN worker does not count
    assert key("infergate_model_replicas", model="lonely") not in samples
    assert samples[key("infergate_placement_moves_total")] == 0
    gw.placement = SimpleNamespace(moves=5)  # type: ignore[attr-defined]
    assert scrape(gw)[0][key("infergate_placement_moves_total")] == 5


def test_latency_histogram_buckets() -> None:
    h = LatencyHistograms()
    h.observe("m", "1", LATENCY_BUCKETS_S[0])  # on a bound: that bucket (le)
    h.observe("m", "1", 0.0)
    h.observe("m", "1", LATENCY_BUCKETS_S[-1] * 2)  # beyond the last bound: +Inf
    got = h.get("m", "1")
    assert got is not None
    assert got.counts[0] == 2 and got.counts[-1] == 1 and got.count == 3
    assert len(got.counts) == len(LATENCY_BUCKETS_S) + 1
    assert h.get("m", "2") is None
    assert list(LATENCY_BUCKETS_S) == sorted(LATENCY_BUCKETS_S)


def test_batch_size_folding_and_failure_reasons() -> None:
    counts = batch_size_counts({1: 2, 3: 1, 4: 5, 2000: 1})
    assert counts[BATCH_SIZE_BUCKETS.index(1)] == 2
    assert counts[BATCH_SIZE_BUCKETS.index(4)] == 6
    assert counts[-1] == 1
    assert triton_failure_reason("Overloaded") == "REJECTED"
    assert triton_failure_reason("Cancelled") == "CANCELED"
    assert triton_failure_reason("Unavailable") == "BACKEND"
    assert triton_failure_reason("PayloadTooLarge") == "OTHER"


def test_cluster_view_and_stats(gw: FakeGateway) -> None:
    monitor = DeviceMonitor()
    monitor._devices["10.0.0.1:8001"] = [{"kind": "cpu", "name": "host", "memory_total_bytes": 8, "memory_used_bytes": 2}]
    view = cluster_view(gw, monitor)  # type: ignore[arg-type]
    workers = {w["address"]: w for w in view["workers"]}
    assert workers["10.0.0.1:8001"]["state"] == "ready"
    assert workers["10.0.0.1:8001"]["models"] == ["mlp", "simple"]
    assert workers["10.0.0.1:8001"]["load"] == {"inflight_batches": 2, "batches_sent": 10, "failures": 1, "retries": 1}
    assert workers["10.0.0.1:8001"]["devices"][0]["memory_total_bytes"] == 8
    assert workers["10.0.0.2:8001"]["state"] == "down"
    assert workers["10.0.0.2:8001"]["devices"] == []
    assert workers["10.0.0.2:8001"]["last_error"] == "connection refused"
    models = {m["name"]: m for m in view["models"]}
    assert models["simple"]["state"] == "ready" and models["simple"]["queue_depth"] == 3
    assert models["simple"]["replicas"] == ["10.0.0.1:8001"]
    assert models["lonely"]["state"] == "unavailable" and models["lonely"]["replicas"] == []
    assert models["mlp"]["max_batch_size"] == 64

    stats = cluster_stats(gw)  # type: ignore[arg-type]
    [simple] = stats["models"]
    assert (simple["model"], simple["success"], simple["failure"], simple["inferences"]) == ("simple", 2, 2, 4)
    assert (simple["executions"], simple["batch_rows"], simple["queue_depth"]) == (1, 4, 3)
    assert sum(simple["latency_counts"]) == 2
    assert stats["latency_bounds_s"] == list(LATENCY_BUCKETS_S)
    assert {w["address"]: w["state"] for w in stats["workers"]} == {"10.0.0.1:8001": "ready", "10.0.0.2:8001": "down"}


async def test_device_monitor_refreshes_in_the_background_when_stale(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    async def scrape(self: DeviceMonitor, session: Any, address: str, url: str) -> list[dict[str, Any]]:
        calls.append(address)
        return [{"kind": "cpu", "name": "host", "memory_total_bytes": len(calls), "memory_used_bytes": 0}]

    monkeypatch.setattr(DeviceMonitor, "_scrape", scrape)
    monitor = DeviceMonitor({"w1": "http://w1/metrics"}, max_age_s=3600)
    try:
        await monitor.refresh(["w1", "w2"])  # the first refresh is awaited; w2 has no metrics address
        assert calls == ["w1"]
        assert monitor.devices("w1")[0]["memory_total_bytes"] == 1
        assert monitor.devices("w2") == []
        await monitor.refresh(["w1"])  # fresh: nothing to do
        assert calls == ["w1"]
        monitor._max_age_s = 0
        await monitor.refresh(["w1"])  # stale: refreshed in the background, the caller does not wait
        assert monitor._task is not None
        await monitor._task
        assert calls == ["w1", "w1"] and monitor.devices("w1")[0]["memory_total_bytes"] == 2
        monitor.set_metrics_url("w1", None)
        assert monitor.devices("w1") == []
    finally:
        await monitor.close()


def test_an_ejected_worker_shows_as_ejected_everywhere(gw: FakeGateway) -> None:
    now = [1000.0]
    gw.cluster.workers()[1].state = WorkerStatus.READY  # two workers up: one may be ejected
    gw.router.outliers = OutlierDetector(OutlierSettings(consecutive_failures=2, base_ejection_s=30), clock=lambda: now[0])
    gw.router.outliers.sync((w.address, True) for w in gw.cluster.workers())
    for _ in range(2):
        gw.router.outliers.failed("10.0.0.1:8001", "connection reset")
    now[0] += 10
    before = time.time()
    view = cluster_view(gw, DeviceMonitor())  # type: ignore[arg-type]
    workers = {w["address"]: w for w in view["workers"]}
    ejected = workers["10.0.0.1:8001"]
    assert ejected["state"] == "ejected" and workers["10.0.0.2:8001"]["state"] == "ready"
    assert ejected["ejection"]["circuit"] == "OPEN" and "connection reset" in ejected["ejection"]["reason"]
    assert ejected["ejection"]["since"] <= before - 9 and ejected["ejection"]["until"] >= before + 19
    assert workers["10.0.0.2:8001"]["ejection"] is None
    stats = {w["address"]: w["state"] for w in cluster_stats(gw)["workers"]}  # type: ignore[arg-type]
    assert stats["10.0.0.1:8001"] == "ejected"
    text = render_text([GatewayCollector(gw)]).decode()  # type: ignore[arg-type]
    assert 'infergate_worker_ejections_total{reason="failures",worker="10.0.0.1:8001"} 1' in text
    assert 'infergate_worker_ejected{worker="10.0.0.1:8001"} 1' in text
    assert 'infergate_worker_ejected{worker="10.0.0.2:8001"} 0' in text
    assert 'infergate_worker_ejections_total{reason="latency",worker="10.0.0.1:8001"} 0' in text


def test_parallel_counters_read_the_registry(gw: FakeGateway) -> None:
    samples, types, _ = scrape(gw)
    assert not any(name.startswith("infergate_parallel_") for name, _ in samples)  # no split models: no series
    stats = ParallelStats("encoder_tp2", batches=3, failures=0, retries=0, replaced=0, shard_calls=6, plan_s=0.1,
                          remote_s=0.05, collective_s=0.05, bytes_sent=10, bytes_received=20, peer_bytes=4096, groups_ready=1)
    gw.parallel = SimpleNamespace(stats=lambda: {"encoder_tp2": stats})  # type: ignore[attr-defined]
    samples, types, _ = scrape(gw)
    assert types["infergate_parallel_worker_calls"] == "counter"
    assert samples[key("infergate_parallel_worker_calls_total", model="encoder_tp2")] == 6
    assert samples[key("infergate_parallel_peer_bytes_total", model="encoder_tp2")] == 4096
    assert samples[key("infergate_parallel_batches_total", model="encoder_tp2")] == 3
    assert samples[key("infergate_parallel_groups_ready", model="encoder_tp2")] == 1
