"""Triton's wire semantics at the gateway's edge, through ``infergate up``:
raw binary HTTP requests (``Inference-Header-Content-Length: 0``), JSON
tensors nested up to depth 100, duplicate requested outputs refused over
HTTP and gRPC, ``binary_data`` precedence, Triton's error words, and the
extensions the server advertises.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcclient_aio
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from tests.harness import Proc, start
from tests.integration.gateway.e2e_cluster import grpc_url, http_url

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def cluster(model_repo: Path) -> Iterator[Proc]:
    proc = start(["up", "--workers", "1", "--model-repository", str(model_repo), "--http-port", "0", "--grpc-port", "0"])
    try:
        yield proc
    finally:
        proc.stop()


def post(proc: Proc, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, bytes, dict[str, str]]:
    conn = http.client.HTTPConnection("127.0.0.1", proc.ready["http_port"], timeout=60)
    try:
        conn.request("POST", path, body=body, headers=headers or {})
        response = conn.getresponse()
        return response.status, response.read(), {k.lower(): v for k, v in response.getheaders()}
    finally:
        conn.close()


def error_of(body: bytes) -> str:
    return json.loads(body)["error"]


def binary_outputs(body: bytes, headers: dict[str, str]) -> tuple[dict[str, Any], bytes]:
    length = int(headers["inference-header-content-length"])
    return json.loads(body[:length]), body[length:]


RAW = {"Inference-Header-Content-Length": "0", "Content-Type": "application/octet-stream"}


# ---- raw binary requests --------------------------------------------------------


def test_raw_binary_fixed_shape_matches_a_json_request(cluster: Proc) -> None:
    x = np.linspace(-1, 1, 64, dtype=np.float32)
    status, body, headers = post(cluster, "/v2/models/mlp/infer", x.tobytes(), RAW)
    assert status == 200, body
    header, raw = binary_outputs(body, headers)
    (out,) = header["outputs"]
    assert (out["name"], out["datatype"], out["shape"]) == ("OUTPUT", "FP32", [1, 10])
    client = httpclient.InferenceServerClient(http_url(cluster))
    try:
        tensor = httpclient.InferInput("INPUT", [1, 64], "FP32")
        tensor.set_data_from_numpy(x.reshape(1, 64))
        want = client.infer("mlp", [tensor]).as_numpy("OUTPUT")
    finally:
        client.close()
    np.testing.assert_array_equal(np.frombuffer(raw, dtype=np.float32).reshape(1, 10), want)


def test_raw_binary_deduces_the_one_variable_dim(cluster: Proc) -> None:
    tokens = np.array([5, 6, 7], dtype=np.int64)
    status, body, headers = post(cluster, "/v2/models/encoder/infer", tokens.tobytes(), RAW)
    assert status == 200, body
    header, _ = binary_outputs(body, headers)
    assert header["outputs"][0]["shape"] == [1, 3, 64]


def test_raw_binary_bytes_input_is_one_element(cluster: Proc) -> None:
    status, body, headers = post(cluster, "/v2/models/string_to_int/infer", b"1234", RAW)
    assert status == 200, body
    _, raw = binary_outputs(body, headers)
    assert np.frombuffer(raw, dtype=np.int64).tolist() == [1234]


@pytest.mark.parametrize(
    ("model", "body", "message"),
    [
        ("simple", bytes(128),
         "Raw request must only have 1 input (found 1) to be deduced but got 2 inputs in 'simple' model configuration"),
        ("identity_string", b"abc", "For BYTE datatype raw input 'INPUT0', the model must have input shape [1]"),
        ("mlp", bytes(12), "input byte size mismatch for input 'INPUT' for model 'mlp'. Expected 256, got 12"),
    ],
    ids=["two-inputs", "bytes-not-one-element", "wrong-size"],
)
def test_raw_binary_refusals_in_tritons_words(cluster: Proc, model: str, body: bytes, message: str) -> None:
    status, answer, _ = post(cluster, f"/v2/models/{model}/infer", body, RAW)
    assert status == 400
    assert message in error_of(answer)


# ---- JSON nesting ----------------------------------------------------------------


def nested(depth: int, values: list[Any]) -> list[Any]:
    data: list[Any] = values
    for _ in range(depth - 1):
        data = [data]
    return data


@pytest.mark.parametrize("depth", [1, 33, 100, 101])
def test_json_nesting_to_depth_100(cluster: Proc, depth: int) -> None:
    numeric = {"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [1, 64], "data": nested(depth, [0.5] * 64)}]}
    text = {"inputs": [{"name": "INPUT0", "datatype": "BYTES", "shape": [1, 1], "data": nested(depth, ["7"])}]}
    for model, doc in (("mlp", numeric), ("string_to_int", text)):
        status, body, _ = post(cluster, f"/v2/models/{model}/infer", json.dumps(doc).encode())
        if depth <= 100:
            assert status == 200, (model, body)
        else:
            assert status == 400
            assert "JSON nesting depth exceeds maximum allowed limit (100)" in error_of(body)


# ---- requested outputs -----------------------------------------------------------


def test_duplicate_outputs_refused_over_http_and_grpc(cluster: Proc) -> None:
    x = np.zeros((1, 64), dtype=np.float32)
    message = "output 'OUTPUT' already exists in request"
    client = httpclient.InferenceServerClient(http_url(cluster))
    try:
        tensor = httpclient.InferInput("INPUT", [1, 64], "FP32")
        tensor.set_data_from_numpy(x)
        outs = [httpclient.InferRequestedOutput("OUTPUT"), httpclient.InferRequestedOutput("OUTPUT")]
        with pytest.raises(InferenceServerException, match=message):
            client.infer("mlp", [tensor], outputs=outs)
    finally:
        client.close()
    gclient = grpcclient.InferenceServerClient(grpc_url(cluster))
    try:
        gtensor = grpcclient.InferInput("INPUT", [1, 64], "FP32")
        gtensor.set_data_from_numpy(x)
        gouts = [grpcclient.InferRequestedOutput("OUTPUT"), grpcclient.InferRequestedOutput("OUTPUT")]
        with pytest.raises(InferenceServerException, match=message) as error:
            gclient.infer("mlp", [gtensor], outputs=gouts)
        assert error.value.status() == "StatusCode.INVALID_ARGUMENT"
    finally:
        gclient.close()


async def test_duplicate_outputs_refused_over_grpc_aio(cluster: Proc) -> None:
    client = grpcclient_aio.InferenceServerClient(grpc_url(cluster))
    try:
        tensor = grpcclient.InferInput("INPUT", [1, 64], "FP32")
        tensor.set_data_from_numpy(np.zeros((1, 64), dtype=np.float32))
        outs = [grpcclient.InferRequestedOutput("OUTPUT"), grpcclient.InferRequestedOutput("OUTPUT")]
        with pytest.raises(InferenceServerException, match="output 'OUTPUT' already exists in request"):
            await client.infer("mlp", [tensor], outputs=outs)
    finally:
        await client.close()


def test_an_output_listed_without_binary_data_is_json(cluster: Proc) -> None:
    doc = {
        "inputs": [
            {"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "data": list(range(16))},
            {"name": "INPUT1", "datatype": "INT32", "shape": [1, 16], "data": [1] * 16},
        ],
        "parameters": {"binary_data_output": True},
        "outputs": [{"name": "OUTPUT0"}, {"name": "OUTPUT1", "parameters": {"binary_data": True}}],
    }
    status, body, headers = post(cluster, "/v2/models/simple/infer", json.dumps(doc).encode())
    assert status == 200, body
    header, raw = binary_outputs(body, headers)
    first, second = header["outputs"]
    assert first["data"] == [i + 1 for i in range(16)]
    assert second["parameters"]["binary_data_size"] == 64 and "data" not in second
    assert np.frombuffer(raw, dtype=np.int32).tolist() == [i - 1 for i in range(16)]


# ---- error words -----------------------------------------------------------------


def test_contents_beside_raw_input_contents_in_tritons_words(cluster: Proc) -> None:
    request = service_pb2.ModelInferRequest(model_name="simple")
    for name in ("INPUT0", "INPUT1"):
        request.inputs.add(name=name, datatype="INT32", shape=[1, 16])
        request.raw_input_contents.append(np.zeros(16, dtype=np.int32).tobytes())
    request.inputs[0].contents.int_contents.extend([0] * 16)
    with grpc.insecure_channel(grpc_url(cluster)) as channel:
        with pytest.raises(grpc.RpcError) as error:
            service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=30)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details().startswith(
        "contents field must not be specified when using raw_input_contents for 'INPUT0' for model 'simple'"
    )


def test_json_element_count_mismatch_in_tritons_words(cluster: Proc) -> None:
    # Triton's L0_http cases: too few and too many elements get the same words, whole.
    for count in (15, 18):
        doc = {"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [1, 64], "data": [0.0] * count}]}
        status, body, _ = post(cluster, "/v2/models/mlp/infer", json.dumps(doc).encode())
        assert status == 400
        assert body == b"{\"error\":\"Unable to parse 'data': Shape does not match true shape of 'data' field\"}", body


@pytest.mark.parametrize(
    ("shape", "words"),
    [([2**4, 2**60 + 2], "causes total element count to exceed maximum size of"),
     ([2**2, 2**60 + 2], "byte size overflow for input")],
    ids=["element-count", "byte-size"],
)
def test_shape_overflows_answered_before_the_data_count(cluster: Proc, shape: list[int], words: str) -> None:
    # Triton's test_buffer_size_overflow: one value for a shape past int64.
    doc = {"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": shape, "data": [1.0]}]}
    status, body, _ = post(cluster, "/v2/models/mlp/infer", json.dumps(doc).encode(), {"Content-Type": "application/json"})
    assert status == 400
    assert words in error_of(body), body


def test_byte_size_overflow_is_refused(cluster: Proc) -> None:
    doc = {"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [2**60 + 2, 4], "parameters": {"binary_data_size": 0}}]}
    head = json.dumps(doc).encode()
    status, body, _ = post(cluster, "/v2/models/mlp/infer", head, {"Inference-Header-Content-Length": str(len(head))})
    assert status == 400
    assert "byte size overflow" in error_of(body)


def test_unreadable_version_is_invalid_argument_in_tritons_words(cluster: Proc) -> None:
    words = "failed to get model version from specified version string"
    # HTTP's route takes digits only, as Triton's; a number past int64 is what std::stol refuses.
    http_client = httpclient.InferenceServerClient(http_url(cluster))
    try:
        with pytest.raises(InferenceServerException) as info:
            http_client.get_model_metadata("simple", "99999999999999999999")
        assert info.value.status() == "400" and info.value.message().startswith(words), info.value.message()
    finally:
        http_client.close()
    client = grpcclient.InferenceServerClient(grpc_url(cluster))
    try:
        for version in ("abc", "99999999999999999999"):
            with pytest.raises(InferenceServerException) as info:
                client.get_model_metadata("simple", version)
            assert info.value.status() == str(grpc.StatusCode.INVALID_ARGUMENT)
            assert info.value.message() == (
                f"{words} '{version}' (details: stol), version should be an integral value > 0"
            )
        assert client.get_model_metadata("simple", "01").name == "simple"  # std::stol reads "01" as 1
    finally:
        client.close()


def test_advertised_extensions_are_standard(cluster: Proc) -> None:
    client = httpclient.InferenceServerClient(http_url(cluster))
    try:
        extensions = client.get_server_metadata()["extensions"]
    finally:
        client.close()
    assert "classification_unsupported" not in extensions
    assert "binary_tensor_data" in extensions
