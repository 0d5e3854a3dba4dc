"""Triton's system shared-memory extension through ``infergate up``, driven by
``tritonclient.utils.shared_memory`` unchanged, as Triton's
``simple_http_shm_client.py`` / ``simple_grpc_shm_client.py`` examples use it
(reproduced here: the tritonclient package does not ship its examples), plus
the errors in Triton's words and the CUDA extension's refusal on a server
without GPUs.

Model: ``simple`` (INT32 [16] x2 -> sum and difference, batching) from the
example repository. Region keys carry the test's pid so parallel runs on one
host do not collide.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import urllib.error
import urllib.request
import uuid
import warnings
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcclient_aio
import tritonclient.http as httpclient
from tritonclient import utils
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from tests.harness import Proc, start
from tests.integration.gateway.e2e_cluster import grpc_url, http_url

with warnings.catch_warnings():  # it imports pkg_resources, deprecated by setuptools
    warnings.simplefilter("ignore", UserWarning)
    import tritonclient.utils.shared_memory as shm

pytestmark = pytest.mark.timeout(240)

BYTES = 16 * 4  # one INT32 [1, 16] tensor


@pytest.fixture(scope="module")
def cluster(model_repo: Any) -> Iterator[Proc]:
    proc = start(["up", "--workers", "1", "--model-repository", str(model_repo), "--http-port", "0", "--grpc-port", "0"])
    try:
        yield proc
    finally:
        proc.stop()


def _key(tag: str) -> str:
    return f"/infergate_test_{os.getpid()}_{tag}_{uuid.uuid4().hex[:8]}"


class _Regions:
    """The example's two regions: inputs (INPUT0 then INPUT1) and outputs (OUTPUT0 then OUTPUT1)."""

    def __init__(self) -> None:
        self.input0 = np.arange(16, dtype=np.int32)
        self.input1 = np.ones(16, dtype=np.int32)
        self.in_key, self.out_key = _key("in"), _key("out")
        self.out_handle = shm.create_shared_memory_region("output_data", self.out_key, BYTES * 2)
        self.in_handle = shm.create_shared_memory_region("input_data", self.in_key, BYTES * 2)
        shm.set_shared_memory_region(self.in_handle, [self.input0])
        shm.set_shared_memory_region(self.in_handle, [self.input1], offset=BYTES)

    def outputs(self, output0: dict[str, Any] | Any, output1: dict[str, Any] | Any, grpc_form: bool) -> tuple:
        def read(out: Any, offset: int) -> np.ndarray:
            datatype = out.datatype if grpc_form else out["datatype"]
            shape = list(out.shape) if grpc_form else out["shape"]
            return shm.get_contents_as_numpy(self.out_handle, utils.triton_to_np_dtype(datatype), shape, offset=offset)

        return read(output0, 0), read(output1, BYTES)

    def destroy(self) -> None:
        shm.destroy_shared_memory_region(self.in_handle)
        shm.destroy_shared_memory_region(self.out_handle)


@pytest.fixture
def regions() -> Iterator[_Regions]:
    r = _Regions()
    try:
        yield r
    finally:
        r.destroy()


def test_simple_http_shm_client_flow(cluster: Proc, regions: _Regions) -> None:
    client = httpclient.InferenceServerClient(http_url(cluster))
    try:
        client.unregister_system_shared_memory()
        client.unregister_cuda_shared_memory()
        client.register_system_shared_memory("output_data", regions.out_key, BYTES * 2)
        client.register_system_shared_memory("input_data", regions.in_key, BYTES * 2)

        inputs = [httpclient.InferInput("INPUT0", [1, 16], "INT32"), httpclient.InferInput("INPUT1", [1, 16], "INT32")]
        inputs[0].set_shared_memory("input_data", BYTES)
        inputs[1].set_shared_memory("input_data", BYTES, offset=BYTES)
        outputs = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=True),
                   httpclient.InferRequestedOutput("OUTPUT1", binary_data=True)]
        outputs[0].set_shared_memory("output_data", BYTES)
        outputs[1].set_shared_memory("output_data", BYTES, offset=BYTES)
        results = client.infer("simple", inputs, outputs=outputs)

        out0, out1 = regions.outputs(results.get_output("OUTPUT0"), results.get_output("OUTPUT1"), grpc_form=False)
        assert out0.tolist() == [(regions.input0 + regions.input1).tolist()]
        assert out1.tolist() == [(regions.input0 - regions.input1).tolist()]
        # Nothing in the body: the entry is name, datatype and shape only, as Triton's.
        assert "data" not in results.get_output("OUTPUT0") and "parameters" not in results.get_output("OUTPUT0")

        status = client.get_system_shared_memory_status()
        assert sorted(status, key=lambda r: r["name"]) == [
            {"name": "input_data", "key": regions.in_key, "offset": 0, "byte_size": BYTES * 2},
            {"name": "output_data", "key": regions.out_key, "offset": 0, "byte_size": BYTES * 2},
        ]
        assert client.get_system_shared_memory_status("input_data")[0]["key"] == regions.in_key
        client.unregister_system_shared_memory()
        assert client.get_system_shared_memory_status() == []
    finally:
        client.unregister_system_shared_memory()
        client.close()


def test_simple_grpc_shm_client_flow(cluster: Proc, regions: _Regions) -> None:
    client = grpcclient.InferenceServerClient(grpc_url(cluster))
    try:
        client.unregister_system_shared_memory()
        client.unregister_cuda_shared_memory()
        client.register_system_shared_memory("output_data", regions.out_key, BYTES * 2)
        client.register_system_shared_memory("input_data", regions.in_key, BYTES * 2)

        inputs = [grpcclient.InferInput("INPUT0", [1, 16], "INT32"), grpcclient.InferInput("INPUT1", [1, 16], "INT32")]
        inputs[0].set_shared_memory("input_data", BYTES)
        inputs[1].set_shared_memory("input_data", BYTES, offset=BYTES)
        outputs = [grpcclient.InferRequestedOutput("OUTPUT0"), grpcclient.InferRequestedOutput("OUTPUT1")]
        outputs[0].set_shared_memory("output_data", BYTES)
        outputs[1].set_shared_memory("output_data", BYTES, offset=BYTES)
        results = client.infer("simple", inputs, outputs=outputs)

        out0, out1 = regions.outputs(results.get_output("OUTPUT0"), results.get_output("OUTPUT1"), grpc_form=True)
        assert out0.tolist() == [(regions.input0 + regions.input1).tolist()]
        assert out1.tolist() == [(regions.input0 - regions.input1).tolist()]

        status = client.get_system_shared_memory_status().regions
        assert set(status) == {"input_data", "output_data"}
        assert (status["output_data"].key, status["output_data"].byte_size) == (regions.out_key, BYTES * 2)
        client.unregister_system_shared_memory("input_data")
        assert set(client.get_system_shared_memory_status().regions) == {"output_data"}
    finally:
        client.unregister_system_shared_memory()
        client.close()


async def test_aio_grpc_input_in_region_output_in_body(cluster: Proc, regions: _Regions) -> None:
    """One input from a region, one in the body, outputs back in the response: the forms mix."""
    client = grpcclient_aio.InferenceServerClient(grpc_url(cluster))
    try:
        await client.register_system_shared_memory("in_aio", regions.in_key, BYTES * 2)
        inputs = [grpcclient_aio.InferInput("INPUT0", [1, 16], "INT32"),
                  grpcclient_aio.InferInput("INPUT1", [1, 16], "INT32")]
        inputs[0].set_data_from_numpy(np.full((1, 16), 5, dtype=np.int32))
        inputs[1].set_shared_memory("in_aio", BYTES, offset=BYTES)
        result = await client.infer("simple", inputs)
        assert result.as_numpy("OUTPUT0").tolist() == [[6] * 16]
    finally:
        await client.unregister_system_shared_memory()
        await client.close()


# ---- errors, in Triton's words ----------------------------------------------------


def _http_error(call: Any) -> str:
    with pytest.raises(InferenceServerException) as info:
        call()
    return str(info.value)


def test_http_errors_use_tritons_words(cluster: Proc, regions: _Regions) -> None:
    client = httpclient.InferenceServerClient(http_url(cluster))
    try:
        client.register_system_shared_memory("in_err", regions.in_key, BYTES * 2)
        again = _http_error(lambda: client.register_system_shared_memory("in_err", regions.in_key, BYTES))
        assert "shared memory region 'in_err' already in manager" in again
        missing = _http_error(lambda: client.register_system_shared_memory("nokey", _key("none"), BYTES))
        assert "Unable to open shared memory region" in missing
        too_big = _http_error(lambda: client.register_system_shared_memory("big", regions.in_key, BYTES * 3))
        assert "failed to register shared memory region 'big': invalid args" in too_big
        assert "Unable to find system shared memory region: 'nope'" in _http_error(
            lambda: client.get_system_shared_memory_status("nope"))

        def infer(region: str, size: int, offset: int, out_size: int = BYTES) -> None:
            inputs = [httpclient.InferInput("INPUT0", [1, 16], "INT32"),
                      httpclient.InferInput("INPUT1", [1, 16], "INT32")]
            inputs[0].set_shared_memory(region, size, offset=offset)
            inputs[1].set_shared_memory("in_err", BYTES, offset=BYTES)
            out = httpclient.InferRequestedOutput("OUTPUT0")
            out.set_shared_memory("in_err", out_size)
            client.infer("simple", inputs, outputs=[out])

        assert "Unable to find shared memory region: 'ghost'" in _http_error(lambda: infer("ghost", BYTES, 0))
        assert "Invalid offset + byte size for shared memory region: 'in_err'" in _http_error(
            lambda: infer("in_err", BYTES, BYTES + 4))
        assert "Invalid offset for shared memory region: 'in_err'" in _http_error(
            lambda: infer("in_err", BYTES, BYTES * 2))
        assert "input byte size mismatch for input 'INPUT0'" in _http_error(lambda: infer("in_err", BYTES - 4, 0))
        small = _http_error(lambda: infer("in_err", BYTES, 0, out_size=8))
        assert "shared memory size specified with the request for output 'OUTPUT0' (8 bytes) should be at least " \
               "64 bytes to hold the results" in small
    finally:
        client.unregister_system_shared_memory()
        client.close()


def test_grpc_errors_carry_tritons_codes(cluster: Proc, regions: _Regions) -> None:
    client = grpcclient.InferenceServerClient(grpc_url(cluster))
    try:
        client.register_system_shared_memory("g_err", regions.in_key, BYTES * 2)
        with pytest.raises(InferenceServerException) as info:
            client.register_system_shared_memory("g_err", regions.in_key, BYTES)
        assert info.value.status() == str(grpc.StatusCode.ALREADY_EXISTS)
        inputs = [grpcclient.InferInput("INPUT0", [1, 16], "INT32"), grpcclient.InferInput("INPUT1", [1, 16], "INT32")]
        inputs[0].set_shared_memory("ghost", BYTES)
        inputs[1].set_shared_memory("g_err", BYTES)
        with pytest.raises(InferenceServerException) as info:
            client.infer("simple", inputs)
        assert info.value.status() == str(grpc.StatusCode.NOT_FOUND)
        assert "Unable to find shared memory region: 'ghost'" in info.value.message()
    finally:
        client.unregister_system_shared_memory()
        client.close()


def test_cuda_shared_memory_is_refused_clearly(cluster: Proc) -> None:
    http = httpclient.InferenceServerClient(http_url(cluster))
    grpc_client = grpcclient.InferenceServerClient(grpc_url(cluster))
    try:
        message = _http_error(lambda: http.register_cuda_shared_memory("gpu0", b"\0" * 64, 0, BYTES))
        assert "failed to register CUDA shared memory region: 'gpu0', GPUs not supported" in message
        assert "CUDA shared memory is not available on this server" in message
        assert http.get_cuda_shared_memory_status() == []
        http.unregister_cuda_shared_memory()
        with pytest.raises(InferenceServerException) as info:
            grpc_client.register_cuda_shared_memory("gpu0", b"\0" * 64, 0, BYTES)
        assert info.value.status() == str(grpc.StatusCode.INVALID_ARGUMENT)
        assert len(grpc_client.get_cuda_shared_memory_status().regions) == 0
        extensions = http.get_server_metadata()["extensions"]
        assert "system_shared_memory" in extensions and "cuda_shared_memory" not in extensions
    finally:
        http.close()
        grpc_client.close()


def test_cuda_register_without_arguments_in_each_frontends_words(cluster: Proc) -> None:
    """Triton checks the region name over HTTP only; its gRPC path opens the handle at once, so there
    missing arguments are "invalid args" (python_grpc_aio_test's test_register_cuda_shared_memory)."""
    invalid_args = "failed to register shared memory region.*invalid args"
    grpc_client = grpcclient.InferenceServerClient(grpc_url(cluster))
    try:
        with pytest.raises(InferenceServerException, match=invalid_args) as info:
            grpc_client.register_cuda_shared_memory("", b"", 0, 0)
        assert info.value.status() == str(grpc.StatusCode.INVALID_ARGUMENT)
    finally:
        grpc_client.close()

    async def aio() -> None:
        async with grpcclient_aio.InferenceServerClient(grpc_url(cluster)) as client:
            with pytest.raises(InferenceServerException, match=invalid_args):
                await client.register_cuda_shared_memory("", b"", 0, 0)

    asyncio.run(aio())
    body = json.dumps({"raw_handle": {"b64": ""}, "device_id": 0, "byte_size": 0}).encode()
    for kind in ("cuda", "system"):
        status, doc = _post(f"http://{http_url(cluster)}/v2/{kind}sharedmemory/register", body)
        assert (status, doc["error"]) == (400, f"'region name' is necessary to register {kind} shared memory region")


def _post(url: str, body: bytes) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, {}
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def test_triton_shaped_cuda_requests_without_a_gpu(cluster: Proc) -> None:
    """Register requests as Triton's clients build them, sent as they are: refused first, whatever the body."""
    base = f"http://{http_url(cluster)}/v2/cudasharedmemory"
    handle = base64.b64encode(b"\1" * 64).decode()
    for body in (
        {"raw_handle": {"b64": handle}, "device_id": 0, "byte_size": BYTES},
        {"raw_handle": {"b64": "not base64"}, "device_id": 0},  # malformed: the missing GPU is still the answer
    ):
        status, doc = _post(f"{base}/region/gpu1/register", json.dumps(body).encode())
        assert status == 400
        assert "failed to register CUDA shared memory region: 'gpu1', GPUs not supported" in doc["error"]
        assert "use system shared memory" in doc["error"]
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(f"{base}/region/gpu1/status", timeout=30)
    assert info.value.code == 404
    assert json.loads(info.value.read())["error"] == "Unable to find cuda shared memory region: 'gpu1'"
    assert _post(f"{base}/region/gpu1/unregister", b"") == (200, {})
    with grpc.insecure_channel(grpc_url(cluster)) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as rpc:
            stub.CudaSharedMemoryRegister(service_pb2.CudaSharedMemoryRegisterRequest(
                name="gpu1", raw_handle=b"\1" * 64, device_id=0, byte_size=BYTES), timeout=30)
        assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "'gpu1', GPUs not supported (CUDA shared memory is not available" in rpc.value.details()
        with pytest.raises(grpc.RpcError) as rpc:
            stub.CudaSharedMemoryStatus(service_pb2.CudaSharedMemoryStatusRequest(name="gpu1"), timeout=30)
        assert rpc.value.code() == grpc.StatusCode.NOT_FOUND
        assert not stub.CudaSharedMemoryStatus(service_pb2.CudaSharedMemoryStatusRequest(), timeout=30).regions
        metadata = stub.ServerMetadata(service_pb2.ServerMetadataRequest(), timeout=30)
        assert "system_shared_memory" in metadata.extensions and "cuda_shared_memory" not in metadata.extensions
