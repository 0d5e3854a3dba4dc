"""The response cache through real processes: a worker serving ``cached`` (the
example ``simple`` with ``response_cache { enable: true }``) and ``simple``
(without), and a gateway started with ``--cache-size``; and the ``classify``
ensemble with the cache enabled, cached as a whole.

A hit must never reach the worker: the worker's own statistics (read from it
directly) keep their execution count while the gateway's cache-hit counters
rise, in the statistics API and on ``/metrics``.
"""

from __future__ import annotations

import asyncio
import shutil
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aiogrpc
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families

from tests.harness import Proc, start, start_worker, worker_url
from tests.integration.gateway.test_ensembles import by_hand

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def repo(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cache-repo")
    shutil.copytree(model_repo / "simple", root / "simple")
    shutil.copytree(model_repo / "simple", root / "cached")
    config = (model_repo / "simple" / "config.pbtxt").read_text().replace('name: "simple"', 'name: "cached"')
    (root / "cached" / "config.pbtxt").write_text(config + "response_cache { enable: true }\n")
    return root


@pytest.fixture(scope="module")
def cluster(repo: Path) -> Iterator[tuple[Proc, Proc]]:
    worker = start_worker(repo)
    gateway = None
    try:
        gateway = start(["gateway", "--worker", worker_url(worker), "--http-port", "0", "--grpc-port", "0",
                         "--cache-size", str(1 << 20)])
        yield gateway, worker
    finally:
        if gateway is not None:
            gateway.stop()
        worker.stop()


def _inputs(module, values: np.ndarray) -> list:
    inputs = [module.InferInput("INPUT0", list(values.shape), "INT32"), module.InferInput("INPUT1", list(values.shape), "INT32")]
    inputs[0].set_data_from_numpy(values)
    inputs[1].set_data_from_numpy(np.ones_like(values))
    return inputs


def _worker_counts(worker: Proc, model: str) -> tuple[int, int]:
    """(execution_count, inference_count) as the worker itself reports them."""
    with grpcclient.InferenceServerClient(worker_url(worker)) as client:
        s = client.get_inference_statistics(model).model_stats[0]
    return s.execution_count, s.inference_count


def _gateway_cache(gateway: Proc, model: str) -> tuple[int, int]:
    with grpcclient.InferenceServerClient(f"127.0.0.1:{gateway.ready['grpc_port']}") as client:
        st = client.get_inference_statistics(model).model_stats[0].inference_stats
    return st.cache_hit.count, st.cache_miss.count


def _metric(gateway: Proc, name: str, model: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{gateway.ready['http_port']}/metrics", timeout=30) as r:
        text = r.read().decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:  # the parser reads Triton's bare counter names as `<name>_total`
            if family.name == name and s.labels.get("model") == model:
                return s.value
    return 0.0


def test_repeated_requests_hit_and_never_reach_the_worker(cluster: tuple[Proc, Proc]) -> None:
    gateway, worker = cluster
    values = np.arange(16, dtype=np.int32).reshape(1, 16) + 100
    http = httpclient.InferenceServerClient(f"127.0.0.1:{gateway.ready['http_port']}")
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{gateway.ready['grpc_port']}")
    try:
        first = http.infer("cached", _inputs(httpclient, values))
        executions, _ = _worker_counts(worker, "cached")
        hits, misses = _gateway_cache(gateway, "cached")
        for _ in range(3):  # the same request, over both protocols and both encodings
            np.testing.assert_array_equal(http.infer("cached", _inputs(httpclient, values)).as_numpy("OUTPUT0"), values + 1)
            np.testing.assert_array_equal(grpc.infer("cached", _inputs(grpcclient, values)).as_numpy("OUTPUT1"), values - 1)
        assert _worker_counts(worker, "cached")[0] == executions
        assert _gateway_cache(gateway, "cached") == (hits + 6, misses)
        # Requested outputs are part of what decides a response: a miss, sent to the worker.
        json_result = http.infer("cached", _inputs(httpclient, values), outputs=[
            httpclient.InferRequestedOutput("OUTPUT0", binary_data=False), httpclient.InferRequestedOutput("OUTPUT1")])
        np.testing.assert_array_equal(json_result.as_numpy("OUTPUT0"), first.as_numpy("OUTPUT0"))
        assert _worker_counts(worker, "cached")[0] == executions + 1
        assert _gateway_cache(gateway, "cached") == (hits + 6, misses + 1)

        # A different input misses, runs on the worker, and is kept.
        grpc.infer("cached", _inputs(grpcclient, values + 1))
        assert _worker_counts(worker, "cached")[0] == executions + 2
        assert _gateway_cache(gateway, "cached") == (hits + 6, misses + 2)
        assert _metric(gateway, "nv_cache_num_hits_per_model", "cached") == hits + 6
        assert _metric(gateway, "nv_cache_num_misses_per_model", "cached") == misses + 2
        assert _metric(gateway, "nv_cache_hit_duration_per_model", "cached") >= 0
    finally:
        http.close()
        grpc.close()


def test_rows_of_a_batch_that_hit_are_not_sent(cluster: tuple[Proc, Proc]) -> None:
    gateway, worker = cluster
    seen = [np.full((1, 16), 1000 + i, dtype=np.int32) for i in range(3)]
    new = [np.full((1, 16), 2000 + i, dtype=np.int32) for i in range(5)]

    async def run() -> None:
        async with aiogrpc.InferenceServerClient(f"127.0.0.1:{gateway.ready['grpc_port']}") as client:
            for v in seen:
                await client.infer("cached", _inputs(aiogrpc, v))
            _, rows_before = _worker_counts(worker, "cached")
            mixed = seen + new
            results = await asyncio.gather(*(client.infer("cached", _inputs(aiogrpc, v)) for v in mixed))
            for v, r in zip(mixed, results):
                np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), v + 1)
            # Only the five new requests' rows reached the worker, however they were batched.
            assert _worker_counts(worker, "cached")[1] == rows_before + len(new)

    asyncio.run(run())


def test_a_model_without_response_cache_is_not_cached(cluster: tuple[Proc, Proc]) -> None:
    gateway, worker = cluster
    values = np.arange(16, dtype=np.int32).reshape(1, 16)
    with grpcclient.InferenceServerClient(f"127.0.0.1:{gateway.ready['grpc_port']}") as client:
        client.infer("simple", _inputs(grpcclient, values))
        executions, _ = _worker_counts(worker, "simple")
        client.infer("simple", _inputs(grpcclient, values))
    assert _worker_counts(worker, "simple")[0] == executions + 1
    assert _gateway_cache(gateway, "simple") == (0, 0)


def test_an_ensemble_with_the_cache_enabled_is_answered_from_it(model_repo: Path, tmp_path: Path) -> None:
    """`classify` with ``response_cache { enable: true }``: a repeated request is answered by the gateway's
    cache as a whole (no step runs again), over gRPC and HTTP, and equals the steps run by hand."""
    for name in ("preprocess", "cnn", "postprocess", "classify"):
        shutil.copytree(model_repo / name, tmp_path / name)
    with open(tmp_path / "classify" / "config.pbtxt", "a") as config:
        config.write("response_cache { enable: true }\n")
    worker = start_worker(tmp_path)
    gateway = None
    try:
        gateway = start(["gateway", "--worker", worker_url(worker), "--http-port", "0", "--grpc-port", "0",
                         "--cache-size", str(1 << 20)])
        images = np.random.default_rng(7).integers(0, 256, (2, 32, 32, 3), dtype=np.uint8)
        want_scores, want_classes = by_hand(model_repo, images)
        for module, port in ((grpcclient, "grpc_port"), (httpclient, "http_port")):
            client = module.InferenceServerClient(f"127.0.0.1:{gateway.ready[port]}")
            try:
                for _ in range(2):
                    image = module.InferInput("IMAGE", list(images.shape), "UINT8")
                    image.set_data_from_numpy(images)
                    result = client.infer("classify", [image])
                    np.testing.assert_allclose(result.as_numpy("SCORES"), want_scores, rtol=1e-5, atol=1e-6)
                    np.testing.assert_array_equal(result.as_numpy("CLASSES"), want_classes)
            finally:
                client.close()
        # One miss ran the steps; the three later requests were hits that reached no worker.
        assert _gateway_cache(gateway, "classify") == (3, 1)
        assert _worker_counts(worker, "cnn") == (1, 2)
        with grpcclient.InferenceServerClient(f"127.0.0.1:{gateway.ready['grpc_port']}") as client:
            stats = client.get_inference_statistics("classify").model_stats
        assert (stats[0].inference_count, stats[0].execution_count, stats[0].inference_stats.success.count) == (2, 1, 4)
        assert [(s.name, s.inference_count) for s in stats[1:]] == [("preprocess", 2), ("cnn", 2), ("postprocess", 2)]
    finally:
        if gateway is not None:
            gateway.stop()
        worker.stop()
