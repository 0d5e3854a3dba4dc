"""Triton's CUDA shared-memory extension through ``infergate up``, on a GPU.

Driven by ``tritonclient.utils.cuda_shared_memory`` unchanged, as Triton's
``simple_http_cudashm_client.py`` / ``simple_grpc_cudashm_client.py``
examples use it: device regions are allocated in this process and exported
as CUDA IPC handles, registered with the gateway (another process, as CUDA
IPC requires), inputs are read from and outputs written to device memory,
results read back from the device, regions unregistered.

Skipped unless cuda-python reports a device and tritonclient's CUDA
utilities import (they need cuda-python 12: ``tests/gpu/run.sh`` installs
what they need and refuses to run where no GPU is found).

Model: ``simple`` (INT32 [16] x2 -> sum and difference) from the example
repository.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient import utils
from tritonclient.utils import InferenceServerException

from gateway.requests.cuda_ipc import probe_cuda
from tests.harness import Proc, start
from tests.integration.gateway.e2e_cluster import grpc_url, http_url


def _unavailable() -> str | None:
    ipc, why = probe_cuda()
    if ipc is None:
        return why
    try:
        with warnings.catch_warnings():  # it imports pkg_resources, deprecated by setuptools
            warnings.simplefilter("ignore")
            import tritonclient.utils.cuda_shared_memory  # noqa: F401
    except Exception as exc:  # tritonclient's utilities import cuda.cudart: cuda-python 12
        return f"tritonclient.utils.cuda_shared_memory does not import ({exc}); run tests/gpu/run.sh"
    return None


_WHY_NOT = _unavailable()
pytestmark = [pytest.mark.skipif(_WHY_NOT is not None, reason=f"no usable GPU: {_WHY_NOT}"), pytest.mark.timeout(240)]

if _WHY_NOT is None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import tritonclient.utils.cuda_shared_memory as cudashm

BYTES = 16 * 4  # one INT32 [1, 16] tensor
DEVICE = 0


@pytest.fixture(scope="module")
def cluster(model_repo: Any) -> Iterator[Proc]:
    proc = start(["up", "--workers", "1", "--model-repository", str(model_repo), "--http-port", "0", "--grpc-port", "0"])
    try:
        yield proc
    finally:
        proc.stop()


class _DeviceRegions:
    """Both inputs in one device region (INPUT1 at an offset), each output in its own."""

    def __init__(self) -> None:
        self.input0 = np.arange(16, dtype=np.int32)
        self.input1 = np.full(16, 3, dtype=np.int32)
        self.inputs = cudashm.create_shared_memory_region("in", 2 * BYTES, DEVICE)
        self.out0 = cudashm.create_shared_memory_region("out0", BYTES, DEVICE)
        self.out1 = cudashm.create_shared_memory_region("out1", BYTES, DEVICE)
        cudashm.set_shared_memory_region(self.inputs, [self.input0, self.input1])

    def register(self, client: Any) -> None:
        client.unregister_cuda_shared_memory()
        client.register_cuda_shared_memory("in", cudashm.get_raw_handle(self.inputs), DEVICE, 2 * BYTES)
        client.register_cuda_shared_memory("out0", cudashm.get_raw_handle(self.out0), DEVICE, BYTES)
        client.register_cuda_shared_memory("out1", cudashm.get_raw_handle(self.out1), DEVICE, BYTES)

    def request(self, module: Any) -> tuple[list[Any], list[Any]]:
        inputs = [module.InferInput("INPUT0", [1, 16], "INT32"), module.InferInput("INPUT1", [1, 16], "INT32")]
        inputs[0].set_shared_memory("in", BYTES)
        inputs[1].set_shared_memory("in", BYTES, offset=BYTES)
        outputs = [module.InferRequestedOutput("OUTPUT0"), module.InferRequestedOutput("OUTPUT1")]
        outputs[0].set_shared_memory("out0", BYTES)
        outputs[1].set_shared_memory("out1", BYTES)
        return inputs, outputs

    def check_outputs(self, datatype: str, shape: list[int]) -> None:
        dtype = utils.triton_to_np_dtype(datatype)
        out0 = cudashm.get_contents_as_numpy(self.out0, dtype, shape)
        out1 = cudashm.get_contents_as_numpy(self.out1, dtype, shape)
        np.testing.assert_array_equal(out0.reshape(-1), self.input0 + self.input1)
        np.testing.assert_array_equal(out1.reshape(-1), self.input0 - self.input1)

    def destroy(self) -> None:
        for handle in (self.inputs, self.out0, self.out1):
            cudashm.destroy_shared_memory_region(handle)


@pytest.fixture
def regions() -> Iterator[_DeviceRegions]:
    made = _DeviceRegions()
    try:
        yield made
    finally:
        made.destroy()


def test_simple_http_cudashm_client_flow(cluster: Proc, regions: _DeviceRegions) -> None:
    client = httpclient.InferenceServerClient(http_url(cluster))
    try:
        assert "cuda_shared_memory" in client.get_server_metadata()["extensions"]
        regions.register(client)
        status = {r["name"]: r for r in client.get_cuda_shared_memory_status()}
        assert status["in"] == {"name": "in", "device_id": DEVICE, "byte_size": 2 * BYTES}
        assert client.get_system_shared_memory_status() == []
        inputs, outputs = regions.request(httpclient)
        result = client.infer("simple", inputs, outputs=outputs)
        out0 = result.get_output("OUTPUT0")
        assert "data" not in out0 and result.as_numpy("OUTPUT0") is None  # the answer is on the device
        regions.check_outputs(out0["datatype"], out0["shape"])
        client.unregister_cuda_shared_memory("out1")
        assert sorted(r["name"] for r in client.get_cuda_shared_memory_status()) == ["in", "out0"]
    finally:
        client.unregister_cuda_shared_memory()
        assert client.get_cuda_shared_memory_status() == []
        client.close()


def test_simple_grpc_cudashm_client_flow(cluster: Proc, regions: _DeviceRegions) -> None:
    client = grpcclient.InferenceServerClient(grpc_url(cluster))
    try:
        assert "cuda_shared_memory" in client.get_server_metadata().extensions
        regions.register(client)
        status = client.get_cuda_shared_memory_status().regions
        assert (status["out0"].device_id, status["out0"].byte_size) == (DEVICE, BYTES)
        inputs, outputs = regions.request(grpcclient)
        result = client.infer("simple", inputs, outputs=outputs)
        out0 = result.get_output("OUTPUT0")
        regions.check_outputs(out0.datatype, list(out0.shape))
    finally:
        client.unregister_cuda_shared_memory()
        assert len(client.get_cuda_shared_memory_status().regions) == 0
        client.close()


def test_device_regions_are_bounds_checked_in_tritons_words(cluster: Proc, regions: _DeviceRegions) -> None:
    client = httpclient.InferenceServerClient(http_url(cluster))
    try:
        client.unregister_cuda_shared_memory()
        raw = cudashm.get_raw_handle(regions.out0)
        with pytest.raises(InferenceServerException, match="failed to register shared memory region 'big': invalid"):
            client.register_cuda_shared_memory("big", raw, DEVICE, 1 << 30)  # more than the allocation
        regions.register(client)
        with pytest.raises(InferenceServerException, match="shared memory region 'in' already in manager"):
            client.register_cuda_shared_memory("in", raw, DEVICE, BYTES)
        inputs, outputs = regions.request(httpclient)
        inputs[1].set_shared_memory("in", BYTES, offset=BYTES + 4)
        with pytest.raises(InferenceServerException, match="Invalid offset \\+ byte size for shared memory region"):
            client.infer("simple", inputs, outputs=outputs)
    finally:
        client.unregister_cuda_shared_memory()
        client.close()
