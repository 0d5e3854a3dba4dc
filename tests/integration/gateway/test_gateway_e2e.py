"""The gateway end to end: ``infergate up`` (two workers and a gateway) driven
by the real tritonclient over HTTP (JSON and binary) and gRPC, sync and
asyncio, on every example model, against ONNX Runtime run directly on the
same files. Also metadata, statistics, the repository extension, and batching
and spreading under concurrency. Bad requests at the gateway's edge and the
HTTP extras are in ``test_gateway_e2e_edge.py``.

One cluster serves the whole module; every test leaves it as it found it.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcclient_aio
import tritonclient.http as httpclient
import tritonclient.http.aio as httpclient_aio
from tritonclient.utils import InferenceServerException

from models.build import example_names
from tests.harness import Proc
from tests.integration.gateway.e2e_cluster import (
    MAX_BATCH,
    MODELS,
    OUTPUTS,
    Arrays,
    assert_outputs_equal,
    grpc_inputs,
    grpc_url,
    http_inputs,
    http_url,
    make_inputs,
    onnx_references,
    start_cluster,
    worker_headers,
    worker_urls,
)

pytestmark = pytest.mark.timeout(180)

FLAVORS = ("http-json", "http-binary", "grpc", "http-aio", "grpc-aio")


@pytest.fixture(scope="module")
def cluster(model_repo: Path) -> Iterator[Proc]:
    yield from start_cluster(model_repo)


@pytest.fixture(scope="module")
def references(model_repo: Path) -> dict[str, Callable[[Arrays], Arrays]]:
    return onnx_references(model_repo)


# ---- inference through every client flavor ---------------------------------


async def infer_with(proc: Proc, flavor: str, model: str, inputs: Arrays, request_id: str = "") -> tuple[Arrays, str]:
    """One request through ``flavor``; the outputs and the id the response carries."""
    names = OUTPUTS[model]
    if flavor in ("http-json", "http-binary"):
        binary = flavor == "http-binary"
        client = httpclient.InferenceServerClient(http_url(proc))
        try:
            outs = [httpclient.InferRequestedOutput(n, binary_data=binary) for n in names]
            result = client.infer(model, http_inputs(inputs, binary), outputs=outs, request_id=request_id)
            return {n: result.as_numpy(n) for n in names}, result.get_response().get("id", "")
        finally:
            client.close()
    if flavor == "grpc":
        client = grpcclient.InferenceServerClient(grpc_url(proc))
        try:
            outs = [grpcclient.InferRequestedOutput(n) for n in names]
            result = client.infer(model, grpc_inputs(inputs), outputs=outs, request_id=request_id)
            return {n: result.as_numpy(n) for n in names}, result.get_response().id
        finally:
            client.close()
    if flavor == "http-aio":
        aclient = httpclient_aio.InferenceServerClient(http_url(proc))
        try:
            outs = [httpclient.InferRequestedOutput(n, binary_data=True) for n in names]
            result = await aclient.infer(model, http_inputs(inputs, True), outputs=outs, request_id=request_id)
            return {n: result.as_numpy(n) for n in names}, result.get_response().get("id", "")
        finally:
            await aclient.close()
    assert flavor == "grpc-aio"
    gclient = grpcclient_aio.InferenceServerClient(grpc_url(proc))
    try:
        outs = [grpcclient.InferRequestedOutput(n) for n in names]
        result = await gclient.infer(model, grpc_inputs(inputs), outputs=outs, request_id=request_id)
        return {n: result.as_numpy(n) for n in names}, result.get_response().id
    finally:
        await gclient.close()


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("flavor", FLAVORS)
async def test_infer_matches_onnxruntime(cluster: Proc, references: dict, flavor: str, model: str) -> None:
    rng = np.random.default_rng(zlib.crc32(f"{flavor}/{model}".encode()))
    for rows in (1, 3, MAX_BATCH[model]):
        inputs = make_inputs(model, rows, rng)
        got, response_id = await infer_with(cluster, flavor, model, inputs, request_id=f"{flavor}-{model}-{rows}")
        assert_outputs_equal(got, references[model](inputs))
        assert response_id == f"{flavor}-{model}-{rows}"


# ---- metadata, health, statistics, repository ------------------------------


def test_health_metadata_and_config_through_both(cluster: Proc, references: dict, model_repo: Path) -> None:
    http = httpclient.InferenceServerClient(http_url(cluster))
    grpc_ = grpcclient.InferenceServerClient(grpc_url(cluster))
    worker = grpcclient.InferenceServerClient(worker_urls(cluster)[0])
    try:
        assert http.is_server_live() and http.is_server_ready()
        assert grpc_.is_server_live() and grpc_.is_server_ready()
        assert "model_repository" in http.get_server_metadata()["extensions"]
        assert "model_repository" in list(grpc_.get_server_metadata().extensions)
        assert not http.is_model_ready("no_such_model") and not grpc_.is_model_ready("no_such_model")
        for model in MODELS:
            assert http.is_model_ready(model) and grpc_.is_model_ready(model)
            session = ort.InferenceSession(str(model_repo / model / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
            want_inputs = [(i.name, [-1 if not isinstance(d, int) else d for d in i.shape]) for i in session.get_inputs()]
            want_outputs = [(o.name, [-1 if not isinstance(d, int) else d for d in o.shape]) for o in session.get_outputs()]

            md = http.get_model_metadata(model)
            assert md["name"] == model and md["versions"] == ["1"]
            assert [(t["name"], t["shape"]) for t in md["inputs"]] == want_inputs
            assert [(t["name"], t["shape"]) for t in md["outputs"]] == want_outputs
            gmd = grpc_.get_model_metadata(model)
            assert gmd.name == model and list(gmd.versions) == ["1"]
            assert [(t.name, list(t.shape)) for t in gmd.inputs] == want_inputs
            assert [t.datatype for t in gmd.inputs] == [t["datatype"] for t in md["inputs"]]

            # The gateway serves the workers' config unchanged.
            direct = worker.get_model_config(model, headers=worker_headers(cluster)).config
            assert grpc_.get_model_config(model).config == direct
            hcfg = http.get_model_config(model)
            assert hcfg["name"] == model and hcfg["max_batch_size"] == direct.max_batch_size == MAX_BATCH[model]
            assert [i["name"] for i in hcfg["input"]] == [i.name for i in direct.input]
        with pytest.raises(InferenceServerException) as http_err:
            http.get_model_metadata("no_such_model")
        assert http_err.value.status() == "400"
        with pytest.raises(InferenceServerException) as grpc_err:
            grpc_.get_model_config("no_such_model")
        assert grpc_err.value.status() == "StatusCode.NOT_FOUND"
    finally:
        http.close()
        grpc_.close()
        worker.close()


def test_statistics_and_repository_index_through_both(cluster: Proc) -> None:
    http = httpclient.InferenceServerClient(http_url(cluster))
    grpc_ = grpcclient.InferenceServerClient(grpc_url(cluster))
    try:
        everything = grpc_.get_inference_statistics()
        assert {s.name for s in everything.model_stats} >= set(MODELS)
        before = grpc_.get_inference_statistics("mlp").model_stats[0]
        rng = np.random.default_rng(1)
        # Sequential requests at an idle gateway: each is a batch of its own.
        for rows in (1, 3):
            http.infer("mlp", http_inputs(make_inputs("mlp", rows, rng), True))
        after = grpc_.get_inference_statistics("mlp").model_stats[0]
        assert after.inference_count - before.inference_count == 4
        assert after.execution_count - before.execution_count == 2
        assert after.inference_stats.success.count - before.inference_stats.success.count == 2
        success_ns = after.inference_stats.success.ns - before.inference_stats.success.ns
        assert success_ns > 0
        # Measured in nanoseconds, not whole milliseconds of a coarse loop clock
        # (a chance of about 1 in 5000 that a real sum lands this near a multiple).
        assert 100 < success_ns % 1_000_000 < 1_000_000 - 100, success_ns
        hstats = http.get_inference_statistics("mlp")["model_stats"]
        assert [(s["name"], s["version"]) for s in hstats] == [("mlp", "1")]
        assert hstats[0]["inference_count"] == after.inference_count

        gindex = [(m.name, m.version, m.state) for m in grpc_.get_model_repository_index().models]
        hindex = [(m["name"], m.get("version", ""), m.get("state", "")) for m in http.get_model_repository_index()]
        assert sorted(gindex) == sorted(hindex) == sorted((name, "1", "READY") for name in example_names())
    finally:
        http.close()
        grpc_.close()


def _worker_state(proc: Proc, address: str, model: str) -> set[str]:
    client = grpcclient.InferenceServerClient(address)
    try:
        index = client.get_model_repository_index(headers=worker_headers(proc))
        return {m.state for m in index.models if m.name == model}
    finally:
        client.close()


def test_unload_and_load_reach_the_workers(cluster: Proc, references: dict) -> None:
    http = httpclient.InferenceServerClient(http_url(cluster))
    grpc_ = grpcclient.InferenceServerClient(grpc_url(cluster))
    inputs = make_inputs("encoder", 2, np.random.default_rng(2))
    try:
        http.unload_model("encoder")
        index = {m["name"]: m for m in http.get_model_repository_index()}
        assert index["encoder"]["state"] == "UNAVAILABLE"
        assert index["mlp"]["state"] == "READY"
        for address in worker_urls(cluster):
            assert _worker_state(cluster, address, "encoder") == {"UNAVAILABLE"}
        assert not http.is_model_ready("encoder") and not grpc_.is_model_ready("encoder")

        with pytest.raises(InferenceServerException) as http_err:
            http.infer("encoder", http_inputs(inputs, True))
        assert http_err.value.status() in ("400", "503") and "encoder" in http_err.value.message()
        with pytest.raises(InferenceServerException) as grpc_err:
            grpc_.infer("encoder", grpc_inputs(inputs))
        assert grpc_err.value.status() in ("StatusCode.NOT_FOUND", "StatusCode.UNAVAILABLE")
        assert "encoder" in grpc_err.value.message()
    finally:
        grpc_.load_model("encoder")
    try:
        for address in worker_urls(cluster):
            assert _worker_state(cluster, address, "encoder") == {"READY"}
        assert {m.name: m.state for m in grpc_.get_model_repository_index().models}["encoder"] == "READY"
        assert http.is_model_ready("encoder")
        result = grpc_.infer("encoder", grpc_inputs(inputs))
        assert_outputs_equal({"HIDDEN": result.as_numpy("HIDDEN")}, references["encoder"](inputs))
    finally:
        http.close()
        grpc_.close()


# ---- concurrency: batching and spreading -----------------------------------


async def _model_counts(address: str, model: str, headers: dict[str, str] | None = None) -> tuple[int, int]:
    client = grpcclient_aio.InferenceServerClient(address)
    try:
        stats = (await client.get_inference_statistics(model, headers=headers)).model_stats
        return stats[0].inference_count, stats[0].execution_count
    finally:
        await client.close()


async def _burst_http(proc: Proc, x: np.ndarray) -> list[np.ndarray]:
    client = httpclient_aio.InferenceServerClient(http_url(proc), conn_limit=len(x))
    try:
        async def one(i: int) -> np.ndarray:
            result = await client.infer("mlp", http_inputs({"INPUT": x[i:i + 1]}, True), request_id=str(i))
            assert result.get_response()["id"] == str(i)
            return result.as_numpy("OUTPUT")

        return await asyncio.gather(*(one(i) for i in range(len(x))))
    finally:
        await client.close()


async def _burst_grpc(proc: Proc, x: np.ndarray) -> list[np.ndarray]:
    client = grpcclient_aio.InferenceServerClient(grpc_url(proc))
    try:
        async def one(i: int) -> np.ndarray:
            result = await client.infer("mlp", grpc_inputs({"INPUT": x[i:i + 1]}), request_id=str(i))
            assert result.get_response().id == str(i)
            return result.as_numpy("OUTPUT")

        return await asyncio.gather(*(one(i) for i in range(len(x))))
    finally:
        await client.close()


async def test_concurrent_requests_are_batched_and_spread(cluster: Proc, references: dict) -> None:
    """200 concurrent single-row requests, first over HTTP then over gRPC.

    HTTP requests that arrive together are queued in the same event-loop turn,
    so they must share batches. The gRPC frontend takes in one call per turn
    and the adaptive batcher sends what it has while a replica is free, so its
    batches are smaller and depend on timing: only "some batching" is asserted.
    """
    n = 200
    workers_before = [await _model_counts(a, "mlp", worker_headers(cluster)) for a in worker_urls(cluster)]
    for burst, max_executions in ((_burst_http, n / 2), (_burst_grpc, n)):
        x = np.random.default_rng(3).standard_normal((n, 64), dtype=np.float32)
        want = references["mlp"]({"INPUT": x})["OUTPUT"]
        gateway_before = await _model_counts(grpc_url(cluster), "mlp")
        outputs = await burst(cluster, x)
        np.testing.assert_allclose(np.concatenate(outputs), want, rtol=1e-5, atol=1e-5)
        counts = await _model_counts(grpc_url(cluster), "mlp")
        inferences, executions = counts[0] - gateway_before[0], counts[1] - gateway_before[1]
        assert inferences == n
        assert executions < max_executions, f"{burst.__name__}: {executions} batches for {inferences} rows"

    workers_after = [await _model_counts(a, "mlp", worker_headers(cluster)) for a in worker_urls(cluster)]
    rows_per_worker = [after[0] - before[0] for after, before in zip(workers_after, workers_before)]
    assert all(rows > 0 for rows in rows_per_worker), f"rows per worker: {rows_per_worker}"
    assert sum(rows_per_worker) == 2 * n


async def test_a_row_the_worker_refuses_fails_only_its_own_request(cluster: Proc, references: dict) -> None:
    """encoder token ids past its vocabulary pass validation but fail in the model:
    sent together with good requests (HTTP requests of one turn share a batch),
    only the bad request fails; its batch-mates are answered correctly."""
    rng = np.random.default_rng(11)
    good = [rng.integers(0, 1000, size=(1, 8), dtype=np.int64) for _ in range(7)]
    bad = np.full((1, 8), 5000, dtype=np.int64)
    client = httpclient_aio.InferenceServerClient(http_url(cluster))
    try:
        async def one(tokens: np.ndarray) -> np.ndarray:
            result = await client.infer("encoder", http_inputs({"TOKENS": tokens}, binary=True))
            return result.as_numpy("HIDDEN")

        outcomes = await asyncio.gather(*(one(t) for t in good[:3] + [bad] + good[3:]), return_exceptions=True)
    finally:
        await client.close()
    assert isinstance(outcomes[3], InferenceServerException), outcomes[3]
    for tokens, got in zip(good, outcomes[:3] + outcomes[4:]):
        assert not isinstance(got, BaseException), got
        np.testing.assert_allclose(got, references["encoder"]({"TOKENS": tokens})["HIDDEN"], rtol=1e-5, atol=1e-5)
