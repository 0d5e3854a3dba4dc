"""``infergate bench`` against real servers: a worker over gRPC, and a local
cluster (``infergate up``) over HTTP (JSON and binary) and gRPC.

Runs use ``--request-count`` so each level sends an exact number of requests;
the bench's counts are checked against the server's own statistics, read
independently with tritonclient before and after.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from loadtest.config import BenchConfig
from loadtest.runner import run_bench
from tests.harness import ROOT, Proc, start, start_worker, worker_url

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def worker(model_repo: Path) -> Iterator[Proc]:
    proc = start_worker(model_repo)
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def cluster(model_repo: Path) -> Iterator[Proc]:
    proc = start(["up", "--workers", "1", "--model-repository", str(model_repo),
                  "--http-port", "0", "--grpc-port", "0"])
    try:
        yield proc
    finally:
        proc.stop()


def grpc_success(url: str, model: str) -> tuple[int, int]:
    """(successful requests, inferences) of a model, from the server's statistics."""
    with grpcclient.InferenceServerClient(url) as client:
        stats = client.get_inference_statistics(model, as_json=True)["model_stats"]
    return (sum(int(s["inference_stats"]["success"].get("count", 0)) for s in stats),
            sum(int(s.get("inference_count", 0)) for s in stats))


def http_success(url: str, model: str) -> tuple[int, int]:
    client = httpclient.InferenceServerClient(url)
    try:
        stats = client.get_inference_statistics(model)["model_stats"]
    finally:
        client.close()
    return (sum(int(s["inference_stats"]["success"]["count"]) for s in stats),
            sum(int(s["inference_count"]) for s in stats))


def test_cli_closed_loop_on_a_worker(worker: Proc, tmp_path: Path) -> None:
    url = worker_url(worker)
    before = grpc_success(url, "simple")
    out_json, out_csv = tmp_path / "r.json", tmp_path / "r.csv"
    cmd = [sys.executable, "-m", "infergate", "bench", "-m", "simple", "-i", "grpc", "-u", url,
           "--concurrency-range", "1:4:x2", "--request-count", "60", "--warmup", "10", "-b", "2",
           "--json", str(out_json), "--csv", str(out_csv)]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr
    assert "Concurrency" in done.stdout and "p99 ms" in done.stdout
    doc = json.loads(out_json.read_text())
    assert [lv["level"] for lv in doc["levels"]] == [1.0, 2.0, 4.0]
    for lv in doc["levels"]:
        assert lv["requests"] == 60 and lv["error_count"] == 0
        assert lv["server"]["requests"] == 60 and lv["server"]["inferences"] == 120
        assert lv["latency"]["p50_us"] > 0 and lv["throughput_rps"] > 0
    after = grpc_success(url, "simple")
    assert (after[0] - before[0], after[1] - before[1]) == (3 * 60 + 10, 2 * (3 * 60 + 10))
    rows = list(csv.DictReader(out_csv.open()))
    assert [r["level"] for r in rows] == ["1", "2", "4"] and all(r["requests"] == "60" for r in rows)


def test_api_two_processes_on_a_worker(worker: Proc) -> None:
    url = worker_url(worker)
    before = grpc_success(url, "mlp")
    result = run_bench(BenchConfig(model="mlp", url=url, protocol="grpc", batch_size=4, concurrency=(3,),
                                   request_count=90, processes=2))
    (lv,) = result.levels
    assert lv.requests == 90 and lv.error_count == 0
    assert len(lv.client_cpu) == 2 and all(0 < c < 2 for c in lv.client_cpu)
    assert lv.server is not None and lv.server.requests == 90 and lv.server.inferences == 360
    after = grpc_success(url, "mlp")
    assert after[0] - before[0] == 90


def test_open_loop_far_above_capacity(worker: Proc) -> None:
    # cnn, 8 images per request: the server's work per request dwarfs the client's.
    target = {"model": "cnn", "url": worker_url(worker), "protocol": "grpc", "batch_size": 8}
    base = run_bench(BenchConfig(**target, concurrency=(1,), request_count=5)).levels[0]
    # All requests due within a few milliseconds: latency from the scheduled
    # send time shows the queue they wait in.
    backlog = run_bench(BenchConfig(**target, request_rate=(10_000.0,), request_count=30)).levels[0]
    assert backlog.requests == 30 and backlog.error_count == 0
    assert backlog.latency.p50_us > 2 * base.latency.p50_us
    assert backlog.latency.max_us > 5 * base.latency.p50_us
    # With a client timeout of a few service times, most of the queue times out:
    # counted by kind, and the run goes on.
    timeout_ms = max(20, int(3 * base.latency.p50_us / 1000))
    short = run_bench(BenchConfig(**target, request_rate=(10_000.0,), request_count=40, timeout_ms=timeout_ms))
    (lv,) = short.levels
    assert lv.requests + lv.error_count == 40
    assert lv.error_count > 0 and sum(lv.errors.values()) == lv.error_count


@pytest.mark.parametrize(("protocol", "binary"), [("http", False), ("http", True), ("grpc", False)],
                         ids=["http-json", "http-binary", "grpc"])
def test_gateway_closed_loop(cluster: Proc, protocol: str, binary: bool) -> None:
    http_url = f"127.0.0.1:{cluster.ready['http_port']}"
    url = http_url if protocol == "http" else f"127.0.0.1:{cluster.ready['grpc_port']}"
    before = http_success(http_url, "mlp")
    result = run_bench(BenchConfig(model="mlp", url=url, protocol=protocol, http_binary=binary, batch_size=2,
                                   concurrency=(2, 8), request_count=80))
    for lv in result.levels:
        assert lv.requests == 80 and lv.error_count == 0
        assert lv.server is not None and lv.server.requests == 80 and lv.server.inferences == 160
        assert lv.server.executions >= 1 and lv.server.avg_batch >= 2
    after = http_success(http_url, "mlp")
    assert (after[0] - before[0], after[1] - before[1]) == (160, 320)


def test_gateway_open_loop(cluster: Proc) -> None:
    http_url = f"127.0.0.1:{cluster.ready['http_port']}"
    before = http_success(http_url, "simple")
    result = run_bench(BenchConfig(model="simple", url=http_url, protocol="http", request_rate=(100.0, 200.0),
                                   distribution="poisson", request_count=60, seed=3))
    assert [lv.level for lv in result.levels] == [100.0, 200.0]
    for lv in result.levels:
        assert lv.requests == 60 and lv.error_count == 0
        assert lv.server is not None and lv.server.requests == 60
        assert lv.throughput_rps > 0 and lv.latency.p99_us >= lv.latency.p50_us
    after = http_success(http_url, "simple")
    assert after[0] - before[0] == 120
