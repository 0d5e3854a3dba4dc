"""The gateway end to end at its edge: bad HTTP and gRPC requests to ``infergate
up`` (two workers and a gateway) are clear client errors that leave it
serving; compressed bodies and the binary extension byte for byte. Inference
through every client flavor, metadata, statistics, the repository extension
and batching are in ``test_gateway_e2e.py``.

One cluster serves the whole module; every test leaves it as it found it.
"""

from __future__ import annotations

import gzip
import http.client
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2, service_pb2_grpc

from tests.harness import Proc
from tests.integration.gateway.e2e_cluster import (
    Arrays,
    grpc_url,
    http_inputs,
    http_url,
    onnx_references,
    start_cluster,
)

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def cluster(model_repo: Path) -> Iterator[Proc]:
    yield from start_cluster(model_repo)


@pytest.fixture(scope="module")
def references(model_repo: Path) -> dict[str, Callable[[Arrays], Arrays]]:
    return onnx_references(model_repo)


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
            result = client.infer("mlp", http_inputs({"INPUT": x}, True), request_id=f"z-{algorithm}",
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
