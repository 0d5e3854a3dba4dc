"""The gateway end to end: ``infergate up`` (two workers and a gateway) driven
by the real tritonclient over HTTP (JSON and binary) and gRPC, sync and
asyncio, on every example model, against ONNX Runtime run directly on the
same files. Also metadata, statistics, the repository extension, batching and
spreading under concurrency, and bad requests at the gateway's edge.

One cluster serves the whole module; every test leaves it as it found it.
"""

from __future__ import annotations

import asyncio
import gzip
import http.client
import json
import os
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcclient_aio
import tritonclient.http as httpclient
import tritonclient.http.aio as httpclient_aio
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from tests.harness import Proc, start

pytestmark = pytest.mark.timeout(180)

MODELS = ("simple", "mlp", "cnn", "encoder")
FLAVORS = ("http-json", "http-binary", "grpc", "http-aio", "grpc-aio")
OUTPUTS = {"simple": ("OUTPUT0", "OUTPUT1"), "mlp": ("OUTPUT",), "cnn": ("PROBS",), "encoder": ("HIDDEN",)}
MAX_BATCH = {"simple": 8, "mlp": 64, "cnn": 32, "encoder": 16}
Arrays = dict[str, np.ndarray]


# ---- fixtures -------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(model_repo: Path) -> Iterator[Proc]:
    proc = start(["up", "--workers", "2", "--model-repository", str(model_repo), "--http-port", "0", "--grpc-port", "0"])
    try:
        assert len(proc.ready["workers"]) == 2
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def references(model_repo: Path) -> dict[str, Callable[[Arrays], Arrays]]:
    def reference(model: str) -> Callable[[Arrays], Arrays]:
        session = ort.InferenceSession(str(model_repo / model / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
        return lambda inputs: dict(zip(OUTPUTS[model], session.run(list(OUTPUTS[model]), inputs)))

    return {model: reference(model) for model in MODELS}


def http_url(proc: Proc) -> str:
    return f"127.0.0.1:{proc.ready['http_port']}"


def grpc_url(proc: Proc) -> str:
    return f"127.0.0.1:{proc.ready['grpc_port']}"


def worker_urls(proc: Proc) -> list[str]:
    return [w["address"] for w in proc.ready["workers"]]


def worker_headers(proc: Proc) -> dict[str, str]:
    """gRPC metadata that lets a test call the cluster's workers directly (their shared token)."""
    token_file = proc.ready.get("worker_token_file")
    if not token_file:
        return {}
    return {"authorization": f"Bearer {Path(token_file).read_text().strip()}"}


def make_inputs(model: str, rows: int, rng: np.random.Generator) -> Arrays:
    if model == "simple":
        return {
            "INPUT0": rng.integers(-1000, 1000, (rows, 16), dtype=np.int32),
            "INPUT1": rng.integers(-1000, 1000, (rows, 16), dtype=np.int32),
        }
    if model == "mlp":
        return {"INPUT": rng.standard_normal((rows, 64), dtype=np.float32)}
    if model == "cnn":
        return {"IMAGE": rng.standard_normal((rows, 3, 32, 32), dtype=np.float32)}
    return {"TOKENS": rng.integers(0, 1000, (rows, 7), dtype=np.int64)}


def assert_outputs_equal(got: Arrays, want: Arrays) -> None:
    assert set(got) == set(want)
    for name, expected in want.items():
        actual = got[name]
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, (name, actual.dtype, actual.shape)
        if expected.dtype == np.float32:
            np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5, err_msg=name)
        else:
            np.testing.assert_array_equal(actual, expected, err_msg=name)


# ---- inference through every client flavor ---------------------------------


def _triton_dtype(array: np.ndarray) -> str:
    return {np.dtype(np.int32): "INT32", np.dtype(np.int64): "INT64", np.dtype(np.float32): "FP32"}[array.dtype]


def _http_inputs(inputs: Arrays, binary: bool) -> list[httpclient.InferInput]:
    result = []
    for name, array in inputs.items():
        tensor = httpclient.InferInput(name, list(array.shape), _triton_dtype(array))
        tensor.set_data_from_numpy(array, binary_data=binary)
        result.append(tensor)
    return result


def _grpc_inputs(inputs: Arrays) -> list[grpcclient.InferInput]:
    result = []
    for name, array in inputs.items():
        tensor = grpcclient.InferInput(name, list(array.shape), _triton_dtype(array))
        tensor.set_data_from_numpy(array)
        result.append(tensor)
    return result


async def infer_with(proc: Proc, flavor: str, model: str, inputs: Arrays, request_id: str = "") -> tuple[Arrays, str]:
    """One request through ``flavor``; the outputs and the id the response carries."""
    names = OUTPUTS[model]
    if flavor in ("http-json", "http-binary"):
        binary = flavor == "http-binary"
        client = httpclient.InferenceServerClient(http_url(proc))
        try:
            outs = [httpclient.InferRequestedOutput(n, binary_data=binary) for n in names]
            result = client.infer(model, _http_inputs(inputs, binary), outputs=outs, request_id=request_id)
            return {n: result.as_numpy(n) for n in names}, result.get_response().get("id", "")
        finally:
            client.close()
    if flavor == "grpc":
        client = grpcclient.InferenceServerClient(grpc_url(proc))
        try:
            outs = [grpcclient.InferRequestedOutput(n) for n in names]
            result = client.infer(model, _grpc_inputs(inputs), outputs=outs, request_id=request_id)
            return {n: result.as_numpy(n) for n in names}, result.get_response().id
        finally:
            client.close()
    if flavor == "http-aio":
        aclient = httpclient_aio.InferenceServerClient(http_url(proc))
        try:
            outs = [httpclient.InferRequestedOutput(n, binary_data=True) for n in names]
            result = await aclient.infer(model, _http_inputs(inputs, True), outputs=outs, request_id=request_id)
            return {n: result.as_numpy(n) for n in names}, result.get_response().get("id", "")
        finally:
            await aclient.close()
    assert flavor == "grpc-aio"
    gclient = grpcclient_aio.InferenceServerClient(grpc_url(proc))
    try:
        outs = [grpcclient.InferRequestedOutput(n) for n in names]
        result = await gclient.infer(model, _grpc_inputs(inputs), outputs=outs, request_id=request_id)
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
            http.infer("mlp", _http_inputs(make_inputs("mlp", rows, rng), True))
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
        assert sorted(gindex) == sorted(hindex) == sorted((m, "1", "READY") for m in MODELS)
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
            http.infer("encoder", _http_inputs(inputs, True))
        assert http_err.value.status() in ("400", "503") and "encoder" in http_err.value.message()
        with pytest.raises(InferenceServerException) as grpc_err:
            grpc_.infer("encoder", _grpc_inputs(inputs))
        assert grpc_err.value.status() in ("StatusCode.NOT_FOUND", "StatusCode.UNAVAILABLE")
        assert "encoder" in grpc_err.value.message()
    finally:
        grpc_.load_model("encoder")
    try:
        for address in worker_urls(cluster):
            assert _worker_state(cluster, address, "encoder") == {"READY"}
        assert {m.name: m.state for m in grpc_.get_model_repository_index().models}["encoder"] == "READY"
        assert http.is_model_ready("encoder")
        result = grpc_.infer("encoder", _grpc_inputs(inputs))
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
            result = await client.infer("mlp", _http_inputs({"INPUT": x[i:i + 1]}, True), request_id=str(i))
            assert result.get_response()["id"] == str(i)
            return result.as_numpy("OUTPUT")

        return await asyncio.gather(*(one(i) for i in range(len(x))))
    finally:
        await client.close()


async def _burst_grpc(proc: Proc, x: np.ndarray) -> list[np.ndarray]:
    client = grpcclient_aio.InferenceServerClient(grpc_url(proc))
    try:
        async def one(i: int) -> np.ndarray:
            result = await client.infer("mlp", _grpc_inputs({"INPUT": x[i:i + 1]}), request_id=str(i))
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
            result = await client.infer("encoder", _http_inputs({"TOKENS": tokens}, binary=True))
            return result.as_numpy("HIDDEN")

        outcomes = await asyncio.gather(*(one(t) for t in good[:3] + [bad] + good[3:]), return_exceptions=True)
    finally:
        await client.close()
    assert isinstance(outcomes[3], InferenceServerException), outcomes[3]
    for tokens, got in zip(good, outcomes[:3] + outcomes[4:]):
        assert not isinstance(got, BaseException), got
        np.testing.assert_allclose(got, references["encoder"]({"TOKENS": tokens})["HIDDEN"], rtol=1e-5, atol=1e-5)


# ---- bad requests at the edge -----------------------------------------------


def http_post(proc: Proc, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, Any, dict[str, str]]:
    conn = http.client.HTTPConnection("127.0.0.1", proc.ready["http_port"], timeout=30)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        data = response.read()
        headers_out = {k.lower(): v for k, v in response.getheaders()}
        try:
            doc = json.loads(data) if data else None
        except ValueError:
            doc = data
        return response.status, doc, headers_out
    finally:
        conn.close()


def _mlp_json(rows: int = 1, **extra: Any) -> dict[str, Any]:
    return {"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [rows, 64], "data": [0.5] * (64 * rows)}], **extra}


def _binary_body(header: dict[str, Any], raw: bytes) -> tuple[bytes, int]:
    head = json.dumps(header).encode()
    return head + raw, len(head)


def _binary_mlp_header(size: int) -> dict[str, Any]:
    return {"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [1, 64], "parameters": {"binary_data_size": size}}]}


def _bad_http_requests() -> list[tuple[str, str, bytes, dict[str, str]]]:
    raw = np.ones((1, 64), np.float32).tobytes()
    good_binary, good_len = _binary_body(_binary_mlp_header(len(raw)), raw)
    short_binary, short_len = _binary_body(_binary_mlp_header(len(raw)), raw[:100])
    lying_size, lying_len = _binary_body(_binary_mlp_header(100), raw[:100])
    return [
        ("malformed-json", "mlp", b'{"inputs": [', {}),
        ("not-an-object", "mlp", b"[1, 2, 3]", {}),
        ("wrong-datatype", "mlp", json.dumps({"inputs": [{"name": "INPUT", "datatype": "INT32", "shape": [1, 64], "data": [1] * 64}]}).encode(), {}),
        ("wrong-shape", "mlp", json.dumps({"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [1, 63], "data": [0.5] * 63}]}).encode(), {}),
        ("too-few-elements", "mlp", json.dumps({"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [1, 64], "data": [0.5] * 10}]}).encode(), {}),
        ("wrong-input-name", "mlp", json.dumps({"inputs": [{"name": "NOPE", "datatype": "FP32", "shape": [1, 64], "data": [0.5] * 64}]}).encode(), {}),
        ("oversize-batch", "mlp", json.dumps(_mlp_json(65)).encode(), {}),
        ("unknown-model", "no_such_model", json.dumps(_mlp_json()).encode(), {}),
        ("header-length-too-big", "mlp", good_binary, {"Inference-Header-Content-Length": str(len(good_binary) + 10)}),
        ("header-length-too-small", "mlp", good_binary, {"Inference-Header-Content-Length": str(good_len - 5)}),
        ("header-length-not-a-number", "mlp", good_binary, {"Inference-Header-Content-Length": "twelve"}),
        ("truncated-binary-tensor", "mlp", short_binary, {"Inference-Header-Content-Length": str(short_len)}),
        ("binary-size-disagrees-with-shape", "mlp", lying_size, {"Inference-Header-Content-Length": str(lying_len)}),
        ("truncated-gzip", "mlp", gzip.compress(json.dumps(_mlp_json()).encode())[:-12], {"Content-Encoding": "gzip"}),
        ("triton-parameter", "mlp", json.dumps(_mlp_json(parameters={"triton_enable_empty_final_response": True})).encode(), {}),
    ]


BAD_HTTP = _bad_http_requests()


@pytest.mark.parametrize("case", BAD_HTTP, ids=[c[0] for c in BAD_HTTP])
def test_bad_http_request_is_a_clear_400(cluster: Proc, case: tuple[str, str, bytes, dict[str, str]]) -> None:
    _, model, body, headers = case
    status, doc, _ = http_post(cluster, f"/v2/models/{model}/infer", body, headers)
    assert status == 400, (status, doc)
    assert isinstance(doc, dict) and isinstance(doc.get("error"), str) and doc["error"], doc
    if model == "no_such_model":
        assert "no_such_model" in doc["error"]
    # The gateway is still up and serving.
    status, doc, _ = http_post(cluster, "/v2/models/mlp/infer", json.dumps(_mlp_json()).encode())
    assert status == 200, doc
    assert doc["outputs"][0]["shape"] == [1, 10]
    assert os.path.exists(f"/proc/{cluster.ready['gateway_pid']}") and cluster.popen.poll() is None


def _grpc_mlp_request(model: str = "mlp", *, datatype: str = "FP32", shape: tuple[int, ...] = (1, 64),
                      raw: bytes | None = None, extra_raw: int = 0) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name=model, id="bad")
    request.inputs.add(name="INPUT", datatype=datatype, shape=list(shape))
    count = int(np.prod(shape))
    request.raw_input_contents.append(raw if raw is not None else np.zeros(count, np.float32).tobytes())
    for _ in range(extra_raw):
        request.raw_input_contents.append(b"\0" * 4)
    return request


BAD_GRPC: list[tuple[str, service_pb2.ModelInferRequest, grpc.StatusCode]] = [
    ("unknown-model", _grpc_mlp_request("no_such_model"), grpc.StatusCode.NOT_FOUND),
    ("wrong-datatype", _grpc_mlp_request(datatype="INT32", raw=np.zeros(64, np.int32).tobytes()), grpc.StatusCode.INVALID_ARGUMENT),
    ("wrong-shape", _grpc_mlp_request(shape=(1, 63)), grpc.StatusCode.INVALID_ARGUMENT),
    ("oversize-batch", _grpc_mlp_request(shape=(65, 64)), grpc.StatusCode.INVALID_ARGUMENT),
    ("truncated-raw", _grpc_mlp_request(raw=b"\0" * 100), grpc.StatusCode.INVALID_ARGUMENT),
    ("extra-raw-contents", _grpc_mlp_request(extra_raw=1), grpc.StatusCode.INVALID_ARGUMENT),
]


def _triton_param_request() -> service_pb2.ModelInferRequest:
    request = _grpc_mlp_request()
    request.parameters["triton_enable_empty_final_response"].bool_param = True
    return request


BAD_GRPC.append(("triton-parameter", _triton_param_request(), grpc.StatusCode.INVALID_ARGUMENT))


@pytest.mark.parametrize("case", BAD_GRPC, ids=[c[0] for c in BAD_GRPC])
def test_bad_grpc_request_is_a_clear_error(cluster: Proc, case: tuple[str, service_pb2.ModelInferRequest, grpc.StatusCode]) -> None:
    _, request, code = case
    with grpc.insecure_channel(grpc_url(cluster)) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.ModelInfer(request, timeout=30)
        assert err.value.code() == code, err.value.details()
        assert err.value.details()
        good = stub.ModelInfer(_grpc_mlp_request(), timeout=30)
        assert list(good.outputs[0].shape) == [1, 10] and len(good.raw_output_contents[0]) == 40


# ---- HTTP extras: compression, request ids ----------------------------------


def test_gzip_request_and_response_bodies(cluster: Proc, references: dict) -> None:
    x = np.random.default_rng(4).standard_normal((2, 64), dtype=np.float32)
    want = references["mlp"]({"INPUT": x})["OUTPUT"]
    client = httpclient.InferenceServerClient(http_url(cluster))
    try:
        for algorithm in ("gzip", "deflate"):
            result = client.infer("mlp", _http_inputs({"INPUT": x}, True), request_id=f"z-{algorithm}",
                                  request_compression_algorithm=algorithm, response_compression_algorithm=algorithm)
            np.testing.assert_allclose(result.as_numpy("OUTPUT"), want, rtol=1e-5, atol=1e-5)
            assert result.get_response()["id"] == f"z-{algorithm}"
    finally:
        client.close()
    # And a hand-made gzip JSON body, the way curl --data-binary @body.gz would send it.
    body = {"id": "gz-json", "inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [2, 64], "data": x.flatten().tolist()}]}
    status, doc, _ = http_post(cluster, "/v2/models/mlp/infer", gzip.compress(json.dumps(body).encode()), {"Content-Encoding": "gzip"})
    assert status == 200, doc
    assert doc["id"] == "gz-json"
    np.testing.assert_allclose(np.array(doc["outputs"][0]["data"], np.float32).reshape(2, 10), want, rtol=1e-5, atol=1e-5)


def test_binary_output_over_raw_http(cluster: Proc, references: dict) -> None:
    """The binary extension byte for byte: header length, binary_data_size, then the raw tensor."""
    x = np.random.default_rng(5).standard_normal((1, 64), dtype=np.float32)
    body, header_len = _binary_body(
        {"id": "raw-1", "inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [1, 64], "parameters": {"binary_data_size": 256}}],
         "outputs": [{"name": "OUTPUT", "parameters": {"binary_data": True}}]},
        x.tobytes(),
    )
    conn = http.client.HTTPConnection("127.0.0.1", cluster.ready["http_port"], timeout=30)
    try:
        conn.request("POST", "/v2/models/mlp/infer", body=body,
                     headers={"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(header_len)})
        response = conn.getresponse()
        data = response.read()
        assert response.status == 200, data[:200]
        json_len = int(response.getheader("Inference-Header-Content-Length"))
    finally:
        conn.close()
    doc = json.loads(data[:json_len])
    assert doc["id"] == "raw-1"
    (out,) = doc["outputs"]
    assert out["parameters"]["binary_data_size"] == 40 == len(data) - json_len
    got = np.frombuffer(data[json_len:], np.float32).reshape(1, 10)
    np.testing.assert_allclose(got, references["mlp"]({"INPUT": x})["OUTPUT"], rtol=1e-5, atol=1e-5)
