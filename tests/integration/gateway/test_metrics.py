"""Prometheus metrics of a real ``infergate up`` (gateway and two workers),
read with prometheus-client's own parser while requests flow, and checked
against the KServe statistics the same processes report; and the cluster
API's JSON.

One cluster serves the module; the tests run in order and each one reads
counters before and after its own requests.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from models.build import example_names
from tests.harness import Proc, start

pytestmark = pytest.mark.timeout(120)

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture(scope="module")
def cluster(model_repo: Path) -> Iterator[Proc]:
    proc = start(["up", "--workers", "2", "--model-repository", str(model_repo), "--http-port", "0", "--grpc-port", "0"])
    try:
        yield proc
    finally:
        proc.stop()


def get(url: str) -> tuple[str, bytes]:
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.headers.get("Content-Type", ""), response.read()


def scrape(url: str) -> tuple[Samples, dict[str, str]]:
    """Every sample of ``url`` by (name, labels), and each family's type."""
    content_type, body = get(url)
    assert content_type.startswith("text/plain; version=0.0.4")
    samples: Samples = {}
    types: dict[str, str] = {}
    for family in text_string_to_metric_families(body.decode()):
        types[family.name] = family.type
        for s in family.samples:
            key = (s.name, frozenset(s.labels.items()))
            assert key not in samples, f"duplicate sample {key}"
            samples[key] = s.value
    return samples, types


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of ``name`` over the samples that carry ``labels`` (and any others)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def simple_request(client: httpclient.InferenceServerClient, rows: int) -> None:
    a = np.arange(16 * rows, dtype=np.int32).reshape(rows, 16)
    inputs = [httpclient.InferInput("INPUT0", [rows, 16], "INT32"), httpclient.InferInput("INPUT1", [rows, 16], "INT32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(a)
    result = client.infer("simple", inputs)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + a)


def model_stats(base: str, model: str) -> dict[str, Any]:
    _, body = get(f"{base}/v2/models/{model}/stats")
    return json.loads(body)["model_stats"][0]


def test_gateway_metrics_follow_requests_and_match_statistics(cluster: Proc) -> None:
    base = f"http://127.0.0.1:{cluster.ready['http_port']}"
    before, types = scrape(f"{base}/metrics")
    assert types["nv_inference_request_success"] == "counter"
    assert types["infergate_batch_size"] == "histogram"
    assert types["infergate_request_duration_seconds"] == "histogram"
    # Triton's names, unchanged: counters without a _total suffix in the text.
    _, raw = get(f"{base}/metrics")
    assert b"# TYPE nv_inference_request_success counter\n" in raw

    rows = [1, 3, 2, 1, 4, 1]
    client = httpclient.InferenceServerClient(f"127.0.0.1:{cluster.ready['http_port']}")
    try:
        for n in rows:
            simple_request(client, n)
        bad = [httpclient.InferInput(name, [1, 8], "INT32") for name in ("INPUT0", "INPUT1")]
        for tensor in bad:  # the wrong shape: refused by the gateway's validation
            tensor.set_data_from_numpy(np.zeros((1, 8), dtype=np.int32))
        with pytest.raises(InferenceServerException, match="unexpected shape"):
            client.infer("simple", bad)
    finally:
        client.close()

    after, _ = scrape(f"{base}/metrics")
    m = {"model": "simple", "version": "1"}
    assert value(after, "nv_inference_request_success_total", **m) - value(before, "nv_inference_request_success_total", **m) == len(rows)
    assert value(after, "nv_inference_count_total", **m) - value(before, "nv_inference_count_total", **m) == sum(rows)
    execs = value(after, "nv_inference_exec_count_total", **m) - value(before, "nv_inference_exec_count_total", **m)
    assert 1 <= execs <= len(rows)
    failed = {**m, "reason": "OTHER", "error": "InvalidArgument"}
    assert value(after, "nv_inference_request_failure_total", **failed) - value(before, "nv_inference_request_failure_total", **failed) == 1

    # The same numbers as the KServe statistics of the same gateway.
    stats = model_stats(base, "simple")
    inference = stats["inference_stats"]
    assert value(after, "nv_inference_request_success_total", **m) == inference["success"]["count"]
    assert total(after, "nv_inference_request_failure_total", **m) == inference["fail"]["count"]
    assert value(after, "nv_inference_count_total", **m) == stats["inference_count"]
    assert value(after, "nv_inference_exec_count_total", **m) == stats["execution_count"]
    assert value(after, "nv_inference_request_duration_us_total", **m) == inference["success"]["ns"] // 1000
    assert value(after, "nv_inference_queue_duration_us_total", **m) == inference["queue"]["ns"] // 1000
    assert value(after, "nv_inference_compute_infer_duration_us_total", **m) == inference["compute_infer"]["ns"] // 1000

    # Histograms: one latency observation per successful request, one batch-size observation per batch.
    assert value(after, "infergate_request_duration_seconds_count", **m) == inference["success"]["count"]
    assert 0 < value(after, "infergate_request_duration_seconds_sum", **m) <= inference["success"]["ns"] / 1e9 + 1e-6
    assert value(after, "infergate_batch_size_count", **m) == stats["execution_count"]
    batch_rows = sum(b["batch_size"] * b["compute_infer"]["count"] for b in stats["batch_stats"])
    assert value(after, "infergate_batch_size_sum", **m) == batch_rows
    assert value(after, "infergate_batch_size_bucket", **m, le="+Inf") == stats["execution_count"]

    # Queues are empty now; both workers are READY and took the batches.
    assert value(after, "nv_inference_pending_request_count", **m) == 0
    assert value(after, "infergate_queue_depth", **m) == 0
    assert value(after, "infergate_queue_capacity", **m) > 0
    addresses = [w["address"] for w in cluster.ready["workers"]]
    for address in addresses:
        assert value(after, "infergate_worker_state", worker=address, state="READY") == 1
        assert value(after, "infergate_worker_state", worker=address, state="DOWN") == 0
        assert value(after, "infergate_worker_inflight_batches", worker=address) == 0
        assert value(after, "infergate_worker_models", worker=address) == len(example_names())
    sent = total(after, "infergate_worker_batches_total") - total(before, "infergate_worker_batches_total")
    assert sent == execs  # no retries: each batch went to one worker once
    assert total(after, "infergate_worker_retries_total") == 0
    assert value(after, "infergate_model_replicas", model="simple") == 2
    assert ("infergate_placement_moves_total", frozenset()) in after
    assert total(after, "infergate_rejected_requests_total", **m) == 0


def test_worker_metrics_add_up_to_the_gateway_batches(cluster: Proc) -> None:
    base = f"http://127.0.0.1:{cluster.ready['http_port']}"
    urls = [f"http://127.0.0.1:{w['metrics_port']}/metrics" for w in cluster.ready["workers"]]
    before = [scrape(u)[0] for u in urls]
    gw_before, _ = scrape(f"{base}/metrics")
    client = httpclient.InferenceServerClient(f"127.0.0.1:{cluster.ready['http_port']}")
    try:
        for n in (2, 1, 5):
            simple_request(client, n)
    finally:
        client.close()
    after = [scrape(u)[0] for u in urls]
    gw_after, _ = scrape(f"{base}/metrics")
    m = {"model": "simple", "version": "1"}

    def moved(name: str) -> float:
        return sum(value(a, name, **m) - value(b, name, **m) for a, b in zip(after, before))

    def gw_moved(name: str) -> float:
        return value(gw_after, name, **m) - value(gw_before, name, **m)

    # Every gateway batch is one request to one worker, with all its rows.
    assert moved("nv_inference_request_success_total") == gw_moved("nv_inference_exec_count_total") >= 1
    assert moved("nv_inference_exec_count_total") == gw_moved("nv_inference_exec_count_total")
    assert moved("nv_inference_count_total") == gw_moved("nv_inference_count_total") == 8
    for a in after:
        for name in ("nv_inference_queue_duration_us_total", "nv_inference_compute_input_duration_us_total",
                     "nv_inference_compute_infer_duration_us_total", "nv_inference_compute_output_duration_us_total"):
            assert (name, frozenset(m.items())) in a
        assert value(a, "nv_inference_pending_request_count", **m) == 0
        assert value(a, "nv_inference_request_failure_total", **m, reason="OTHER") == 0
        assert value(a, "infergate_worker_models_loaded") == len(example_names())
        assert value(a, "nv_cpu_memory_total_bytes") >= value(a, "nv_cpu_memory_used_bytes") > 0
        gpus = [k for k in a if k[0].startswith("nv_gpu_memory_total_bytes")]
        for key in gpus:
            assert a[key] > 0


def test_cluster_api(cluster: Proc) -> None:
    base = f"http://127.0.0.1:{cluster.ready['http_port']}"
    content_type, body = get(f"{base}/v2/cluster")
    assert content_type.startswith("application/json")
    view = json.loads(body)
    addresses = sorted(w["address"] for w in cluster.ready["workers"])
    assert sorted(w["address"] for w in view["workers"]) == addresses
    every = sorted(example_names())
    for w in view["workers"]:
        assert w["state"] == "ready"
        assert w["models"] == every
        assert set(w["load"]) == {"inflight_batches", "batches_sent", "failures", "retries"}
        # Read from the worker's metrics: at least the host, and GPUs where there are some.
        assert w["devices"] and w["devices"][-1]["kind"] == "cpu"
        assert w["devices"][-1]["memory_total_bytes"] >= w["devices"][-1]["memory_used_bytes"] > 0
    models = {m["name"]: m for m in view["models"]}
    assert sorted(models) == every
    assert sorted(models["simple"]["replicas"]) == addresses
    assert models["simple"]["state"] == "ready" and models["simple"]["max_batch_size"] == 8

    stats = json.loads(get(f"{base}/v2/cluster/stats")[1])
    simple = next(m for m in stats["models"] if m["model"] == "simple")
    kserve = model_stats(base, "simple")
    assert simple["success"] == kserve["inference_stats"]["success"]["count"] > 0
    assert simple["executions"] == kserve["execution_count"]
    assert sum(simple["latency_counts"]) == simple["success"]
    assert len(simple["latency_counts"]) == len(stats["latency_bounds_s"]) + 1
    assert sorted(w["address"] for w in stats["workers"]) == addresses

    with pytest.raises(urllib.error.HTTPError) as missing:
        get(f"{base}/dashboard/nothing.js")
    assert missing.value.code == 404
