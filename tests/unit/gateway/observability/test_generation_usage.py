"""Tests for the generation figures of each worker (protos/generation_usage.py,
gateway/observability/generation_usage.py): the worker's statistics answer
carries them in ``memory_usage`` and stays a valid Triton answer; the gateway
reads the up workers' decoupled models, keeps what answered, adds its own
split decoders under ``gateway``, and exports gauges and the cluster API's
per-worker table."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from google.protobuf import json_format
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.grpc import model_config_pb2, service_pb2

from gateway.fleet.view import WorkerModel, WorkerState, WorkerStatus
from gateway.observability.cluster_api import DeviceMonitor, cluster_view
from gateway.observability.generation_usage import GATEWAY_WORKER, GenerationUsagePoller
from gateway.observability.metrics import GatewayCollector
from gateway.settings import WorkerSpec
from protos.errors import ModelNotFound
from protos.generation_usage import GenerationUsage, add_usage, instances_usage, read_usage
from serverkit.prometheus import render_text
from tests.unit.gateway.observability.test_metrics_gateway import FakeCluster, FakeGateway


@dataclass(frozen=True)
class Sample:
    running: int
    waiting: int
    cache_bytes: int
    reserved_cache_bytes: int
    tokens_generated: int = 0
    steps: int = 0


class GenInstance:
    def __init__(self, sample: Sample) -> None:
        self.sample = sample

    def generation_stats(self) -> Sample:
        return self.sample


def test_the_statistics_answer_carries_the_figures_and_stays_a_triton_answer() -> None:
    usage = instances_usage([GenInstance(Sample(2, 1, 4096, 12288)), GenInstance(Sample(1, 0, 1024, 2048)), object()])
    assert usage == GenerationUsage(3, 1, 5120, 14336)
    assert instances_usage([object()]) is None
    stats = service_pb2.ModelStatistics(name="tiny_lm", version="1", inference_count=4)
    add_usage(stats, usage)
    wire = service_pb2.ModelStatisticsResponse(model_stats=[stats]).SerializeToString()
    parsed = service_pb2.ModelStatisticsResponse.FromString(wire)
    assert read_usage(parsed.model_stats[0]) == usage
    # What tritonclient's get_model_statistics(as_json=True) does with it.
    doc = json_format.MessageToDict(parsed, preserving_proto_field_name=True)
    assert {m["type"] for m in doc["model_stats"][0]["memory_usage"]} == {"KV_CACHE", "KV_CACHE_RESERVED"}
    assert read_usage(service_pb2.ModelStatistics(name="simple")) is None
    gpu = service_pb2.ModelStatistics(name="onnx")
    gpu.memory_usage.add(type="GPU", id=0, byte_size=1 << 20)  # a Triton model's weights: not ours
    assert read_usage(gpu) is None


def test_the_worker_answers_with_its_generation_models_figures() -> None:
    from execution.manager import ModelManager

    class Loaded:
        name, version, version_str = "tiny_lm", 1, "1"

        def __init__(self) -> None:
            from execution.stats import ModelStats
            self.stats = ModelStats()
            self.instances = [GenInstance(Sample(2, 3, 100, 500))]

    manager = ModelManager.__new__(ModelManager)
    manager.loaded = lambda: [Loaded()]  # type: ignore[method-assign]
    (answer,) = manager.statistics()
    assert read_usage(answer) == GenerationUsage(2, 3, 100, 500)


class StatsClient:
    def __init__(self, answers: dict[str, GenerationUsage | Exception]) -> None:
        self.answers = answers
        self.asked: list[str] = []

    async def model_statistics(self, name: str = "", version: str = "",
                               timeout_s: float | None = None) -> service_pb2.ModelStatisticsResponse:  # fmt: skip
        self.asked.append(name)
        answer = self.answers[name]
        if isinstance(answer, Exception):
            raise answer
        stats = service_pb2.ModelStatistics(name=name, version="1")
        add_usage(stats, answer)
        return service_pb2.ModelStatisticsResponse(model_stats=[stats])


def generative(name: str) -> WorkerModel:
    config = model_config_pb2.ModelConfig(name=name, backend="generate")
    config.model_transaction_policy.decoupled = True
    return WorkerModel(name, ("1",), config, service_pb2.ModelMetadataResponse(name=name))


def plain(name: str) -> WorkerModel:
    return WorkerModel(name, ("1",), model_config_pb2.ModelConfig(name=name), service_pb2.ModelMetadataResponse(name=name))


class Decoders:
    def generation_stats(self) -> dict[str, Sample]:
        return {"split_lm": Sample(1, 2, 64, 256)}


def fleet() -> tuple[FakeGateway, StatsClient, StatsClient]:
    gw = FakeGateway()
    a = StatsClient({"tiny_lm": GenerationUsage(2, 1, 4096, 8192), "gone": ModelNotFound("not available")})
    b = StatsClient({"tiny_lm": GenerationUsage(0, 0, 0, 0)})
    up = WorkerState(WorkerSpec("10.0.0.1:8001"), client=a, state=WorkerStatus.READY)  # type: ignore[arg-type]
    up.models = {"tiny_lm": generative("tiny_lm"), "gone": generative("gone"), "simple": plain("simple")}
    down = WorkerState(WorkerSpec("10.0.0.2:8001"), client=b, state=WorkerStatus.DOWN)  # type: ignore[arg-type]
    down.models = {"tiny_lm": generative("tiny_lm")}
    triton = WorkerState(WorkerSpec("10.0.0.3:8001", kind="triton"), client=b,  # type: ignore[arg-type]
                         state=WorkerStatus.READY)
    triton.models = {"tiny_lm": generative("tiny_lm")}
    gw.cluster = FakeCluster([up, down, triton])
    gw.decoders = Decoders()  # type: ignore[attr-defined]
    return gw, a, b


def test_the_poller_reads_up_workers_decoupled_models_and_adds_the_gateways_own() -> None:
    gw, a, b = fleet()
    poller = GenerationUsagePoller(gw)
    asyncio.run(poller.poll())
    assert sorted(a.asked) == ["gone", "tiny_lm"] and b.asked == []  # no plain model, no down or Triton worker
    assert poller.table() == {("10.0.0.1:8001", "tiny_lm"): GenerationUsage(2, 1, 4096, 8192),
                              (GATEWAY_WORKER, "split_lm"): GenerationUsage(1, 2, 64, 256)}
    gw.cluster.workers()[0].state = WorkerStatus.DOWN
    asyncio.run(poller.poll())
    assert list(poller.table()) == [(GATEWAY_WORKER, "split_lm")]  # a worker gone down leaves the table


def test_gauges_per_worker_and_model_and_the_cluster_view() -> None:
    gw, _, _ = fleet()
    poller = GenerationUsagePoller(gw)
    asyncio.run(poller.poll())
    text = render_text([GatewayCollector(gw, poller)]).decode()  # type: ignore[arg-type]
    samples = {(s.name, s.labels["worker"], s.labels["model"]): s.value
               for f in text_string_to_metric_families(text) if f.name.startswith("infergate_generation_worker_")
               for s in f.samples}
    assert samples == {
        ("infergate_generation_worker_sequences_running", "10.0.0.1:8001", "tiny_lm"): 2,
        ("infergate_generation_worker_sequences_waiting", "10.0.0.1:8001", "tiny_lm"): 1,
        ("infergate_generation_worker_cache_bytes", "10.0.0.1:8001", "tiny_lm"): 4096,
        ("infergate_generation_worker_cache_reserved_bytes", "10.0.0.1:8001", "tiny_lm"): 8192,
        ("infergate_generation_worker_sequences_running", "gateway", "split_lm"): 1,
        ("infergate_generation_worker_sequences_waiting", "gateway", "split_lm"): 2,
        ("infergate_generation_worker_cache_bytes", "gateway", "split_lm"): 64,
        ("infergate_generation_worker_cache_reserved_bytes", "gateway", "split_lm"): 256,
    }
    view = cluster_view(gw, DeviceMonitor(), poller)  # type: ignore[arg-type]
    by_address = {w["address"]: w["generation"] for w in view["workers"]}
    assert by_address == {"10.0.0.1:8001": {"tiny_lm": {"running": 2, "waiting": 1, "cache_bytes": 4096,
                                                        "cache_reserved_bytes": 8192}},
                          "10.0.0.2:8001": {}, "10.0.0.3:8001": {}}
    assert view["gateway_generation"] == {"split_lm": {"running": 1, "waiting": 2, "cache_bytes": 64,
                                                       "cache_reserved_bytes": 256}}


def test_no_generation_models_no_gauges() -> None:
    gw = FakeGateway()
    poller = GenerationUsagePoller(gw)
    asyncio.run(poller.poll())
    text = render_text([GatewayCollector(gw, poller)]).decode()  # type: ignore[arg-type]
    assert "infergate_generation_worker_" not in text
    assert cluster_view(gw, DeviceMonitor(), poller)["gateway_generation"] == {}  # type: ignore[arg-type]
