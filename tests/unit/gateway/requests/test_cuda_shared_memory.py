"""The CUDA side of the shared-memory registry: bookkeeping, parameters,
offsets and errors in Triton's words, without a device.

Device access is the registry's ``CudaIpc`` seam; here a host-memory stand-in
(:class:`HostIpc`) plays the device so the bookkeeping can be checked. It is
a test fixture only: the gateway's one implementation is cuda-python's
(``gateway.requests.cuda_ipc.CudaPythonIpc``), exercised by tests/gpu on a
GPU host. Without a GPU the registry must refuse, list nothing, and not
advertise the extension: checked here and, over the wire, in
tests/integration/gateway/test_triton_shared_memory.py.
"""

from __future__ import annotations

import base64
import importlib.util
import os
import uuid
from collections.abc import Iterator

import pytest
from tritonclient.grpc import service_pb2

from gateway.frontends.http_extensions import parse_cuda_register
from gateway.requests.cuda_ipc import IPC_HANDLE_BYTES, CudaIpcError, probe_cuda
from gateway.requests.shared_memory import (
    CUDA_EXTENSION, SharedMemoryRegistry, advertise, take_slice, write_output,
)
from protos.errors import AlreadyExists, Internal, InvalidArgument, NotFound
from tests.unit.gateway.requests.host_ipc import HostIpc

@pytest.fixture
def ipc() -> HostIpc:
    return HostIpc()


@pytest.fixture
def registry(ipc: HostIpc) -> Iterator[SharedMemoryRegistry]:
    reg = SharedMemoryRegistry(ipc)
    yield reg
    reg.close()


def _metadata() -> service_pb2.ServerMetadataResponse:
    return service_pb2.ServerMetadataResponse(name="infergate", extensions=["system_shared_memory"])


def test_without_a_gpu_register_is_refused_and_status_lists_nothing() -> None:
    reg = SharedMemoryRegistry(None, "cuda-python is not installed")
    with pytest.raises(InvalidArgument) as info:
        reg.register_cuda("gpu0", b"\0" * IPC_HANDLE_BYTES, 0, 64)
    assert "failed to register CUDA shared memory region: 'gpu0', GPUs not supported" in str(info.value)
    assert "cuda-python is not installed" in str(info.value)
    # What a Triton without GPUs answers its gRPC clients, name or none.
    with pytest.raises(InvalidArgument, match="^failed to register CUDA shared memory region: '', GPUs not supported"):
        reg.register_cuda("", b"\0" * IPC_HANDLE_BYTES, 0, 64)
    assert reg.cuda_status() == []
    with pytest.raises(NotFound, match="Unable to find cuda shared memory region: 'gpu0'"):
        reg.cuda_status("gpu0")
    reg.unregister_cuda("gpu0")  # unknown names are no error, as in Triton
    assert not reg.cuda_available
    assert CUDA_EXTENSION not in advertise(_metadata(), reg).extensions


def test_register_status_advertise_unregister(registry: SharedMemoryRegistry, ipc: HostIpc) -> None:
    handle = ipc.allocate(128)
    registry.register_cuda("g", handle, 0, 96)
    opened = list(ipc.open_pointers)
    assert [(s.name, s.device_id, s.byte_size) for s in registry.cuda_status()] == [("g", 0, 96)]
    assert registry.cuda_status("g")[0].byte_size == 96
    assert registry.status() == []  # not a system region
    with pytest.raises(NotFound, match="The region named 'g' is registered as CUDA shared memory, not system"):
        registry.status("g")
    extensions = advertise(advertise(_metadata(), registry), registry).extensions
    assert list(extensions) == ["system_shared_memory", CUDA_EXTENSION]
    registry.unregister("g")  # a system unregister leaves a CUDA region alone, as Triton's
    assert len(registry.cuda_status()) == 1 and ipc.closed == []
    registry.unregister_cuda("g")
    assert registry.cuda_status() == [] and ipc.closed == opened and ipc.open_pointers == []


@pytest.mark.parametrize("gpu", [True, False], ids=["gpu", "no-gpu"])
def test_missing_arguments_are_tritons_invalid_args_first(gpu: bool, ipc: HostIpc) -> None:
    # Triton's python_grpc_aio_test test_register_cuda_shared_memory: register_cuda_shared_memory("", b"", 0, 0)
    # must match "failed to register shared memory region.*invalid args" (its gRPC path opens the handle at once).
    reg = SharedMemoryRegistry(ipc if gpu else None)
    with pytest.raises(InvalidArgument) as info:
        reg.register_cuda("", b"", 0, 0)
    assert info.value.message.startswith(
        "failed to register shared memory region: invalid args ('raw_handle' must be a cudaIpcMemHandle_t of 64 "
        "bytes, got 0 bytes"), info.value.message
    assert reg.cuda_status() == [] and ipc.open_pointers == []


def test_registration_errors(registry: SharedMemoryRegistry, ipc: HostIpc) -> None:
    handle = ipc.allocate(64)
    with pytest.raises(InvalidArgument, match=r"^failed to register shared memory region: invalid args \('raw_handle' "
                                              "must be a cudaIpcMemHandle_t of 64 bytes, got 8"):
        registry.register_cuda("g", b"\0" * 8, 0, 64)
    with pytest.raises(InvalidArgument, match="'region name' is necessary to register cuda shared memory region"):
        registry.register_cuda("", handle, 0, 64)
    with pytest.raises(InvalidArgument, match="failed to register shared memory region 'g': invalid args .*invalid"):
        registry.register_cuda("g", b"\1" * IPC_HANDLE_BYTES, 0, 64)
    with pytest.raises(InvalidArgument, match="invalid device ordinal"):
        registry.register_cuda("g", handle, 3, 64)
    # More than the allocation behind the handle: refused, and the handle closed again.
    with pytest.raises(InvalidArgument, match="byte_size 65 is larger than the 64 bytes of device memory"):
        registry.register_cuda("g", handle, 0, 65)
    assert ipc.open_pointers == [] and len(ipc.closed) == 1
    registry.register_cuda("g", handle, 0, 64)
    with pytest.raises(AlreadyExists, match="shared memory region 'g' already in manager"):
        registry.register_cuda("g", ipc.allocate(64), 0, 64)
    assert len(ipc.open_pointers) == 1  # the refused one was never opened


def test_names_are_unique_across_kinds(registry: SharedMemoryRegistry, ipc: HostIpc) -> None:
    if not os.path.isdir("/dev/shm"):
        pytest.skip("needs POSIX shared memory at /dev/shm")
    name = f"infergate_unit_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    with open(f"/dev/shm/{name}", "wb") as f:
        f.write(bytes(64))
    try:
        registry.register("r", "/" + name, 0, 64)
        with pytest.raises(AlreadyExists, match="shared memory region 'r' already in manager"):
            registry.register_cuda("r", ipc.allocate(64), 0, 64)
        with pytest.raises(NotFound, match="The region named 'r' is registered as system shared memory, not CUDA"):
            registry.cuda_status("r")
        registry.unregister_cuda()  # every CUDA region: the system one stays
        assert [s.name for s in registry.status()] == ["r"]
    finally:
        registry.unregister()
        os.unlink(f"/dev/shm/{name}")


def test_tensor_parameters_read_and_write_device_bytes(registry: SharedMemoryRegistry, ipc: HostIpc) -> None:
    handle = ipc.allocate(64, fill=bytes(range(64)))
    registry.register_cuda("g", handle, 0, 64)
    params = {"shared_memory_region": "g", "shared_memory_byte_size": 8, "shared_memory_offset": 16, "other": 1}
    window = take_slice(params, "INPUT0", registry)
    assert params == {"other": 1}  # the region's parameters never reach a worker
    assert window is not None and bytes(window.read()) == bytes(range(16, 24))
    write_output(window, "OUTPUT0", b"\xee" * 8)
    assert ipc.memory(handle)[16:24] == b"\xee" * 8 and ipc.memory(handle)[24] == 24
    with pytest.raises(InvalidArgument, match="should be at least 12 bytes to hold the results"):
        write_output(window, "OUTPUT0", b"\0" * 12)
    for offset, size, message in (
        (64, 1, "Invalid offset for shared memory region: 'g'"),
        (60, 8, "Invalid offset \\+ byte size for shared memory region: 'g'"),
    ):
        with pytest.raises(InvalidArgument, match=message):
            take_slice({"shared_memory_region": "g", "shared_memory_byte_size": size,
                        "shared_memory_offset": offset}, "INPUT0", registry)
    with pytest.raises(InvalidArgument, match="'shared_memory_byte_size' must be specified along with"):
        take_slice({"shared_memory_region": "g"}, "INPUT0", registry)
    ipc.fail_reads = True
    with pytest.raises(Internal, match="failed to read CUDA shared memory region 'g': .*illegal memory access"):
        window.read()


def test_unregister_waits_for_requests_in_flight(registry: SharedMemoryRegistry, ipc: HostIpc) -> None:
    handle = ipc.allocate(32, fill=b"\x07" * 32)
    registry.register_cuda("g", handle, 0, 32)
    window = registry.slice("g", 0, 4)
    registry.unregister_cuda("g")
    assert registry.cuda_status() == []
    with pytest.raises(NotFound, match="Unable to find shared memory region: 'g'"):
        registry.slice("g", 0, 4)
    assert ipc.closed == [] and bytes(window.read()) == b"\x07" * 4  # still open for the request holding it
    del window
    assert len(ipc.closed) == 1 and ipc.open_pointers == []


def test_close_closes_every_handle(ipc: HostIpc) -> None:
    reg = SharedMemoryRegistry(ipc)
    reg.register_cuda("a", ipc.allocate(16), 0, 16)
    reg.register_cuda("b", ipc.allocate(16), 0, 8)
    reg.close()
    assert ipc.open_pointers == [] and len(ipc.closed) == 2


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def test_http_register_body_in_tritons_shape() -> None:
    raw = bytes(range(IPC_HANDLE_BYTES))
    doc = {"raw_handle": {"b64": _b64(raw)}, "device_id": 1, "byte_size": 256}
    assert parse_cuda_register(doc) == (raw, 1, 256)
    for bad in ({"b64": _b64(b"A" * 48)}, {"b64": "not base64!"}):
        with pytest.raises(InvalidArgument, match="'raw_handle' must be a valid base64 encoded cudaIpcMemHandle_t"):
            parse_cuda_register({**doc, "raw_handle": bad})
    with pytest.raises(InvalidArgument, match="needs 'raw_handle'"):
        parse_cuda_register({"device_id": 0, "byte_size": 64})
    with pytest.raises(InvalidArgument, match="'device_id' must be a non-negative integer"):
        parse_cuda_register({**doc, "device_id": -1})
    with pytest.raises(InvalidArgument, match="has no 'byte_size' field"):
        parse_cuda_register({"raw_handle": doc["raw_handle"], "device_id": 0})


def test_probe_asks_the_cuda_runtime_and_says_why_not() -> None:
    ipc, why = probe_cuda()
    if ipc is not None:
        pytest.skip("this host has a usable GPU: tests/gpu covers it")
    if importlib.util.find_spec("cuda") is None:
        assert why == "cuda-python is not installed (pip install 'infergate[cuda]')"
    else:  # cuda-python present (tritonclient[all] brings it), no driver or no device: the runtime said so
        assert why.startswith(("the CUDA runtime reports", "cuda-python failed to start")), why


def test_cuda_python_errors_come_back_in_the_runtimes_words() -> None:
    """The production implementation against the real cuda-python, on a host where the runtime finds no device."""
    if importlib.util.find_spec("cuda") is None or probe_cuda()[0] is not None:
        pytest.skip("needs cuda-python installed and no usable GPU")
    from gateway.requests.cuda_ipc import CudaPythonIpc, _runtime_and_driver

    ipc = CudaPythonIpc(*_runtime_and_driver())
    with pytest.raises(CudaIpcError, match=r"^cudaSetDevice\(0\): .+"):
        ipc.open(b"\1" * IPC_HANDLE_BYTES, 0)
    with pytest.raises(CudaIpcError, match=r"^cudaSetDevice\(0\): "):
        ipc.to_host(1 << 32, 0, 8)
    assert bytes(ipc.to_host(1 << 32, 0, 0)) == b""  # nothing to copy: no device call at all
    reg = SharedMemoryRegistry(ipc)  # as if the probe had said yes: registration still fails cleanly
    with pytest.raises(InvalidArgument, match=r"failed to register shared memory region 'g': invalid args \(cuda"):
        reg.register_cuda("g", b"\1" * IPC_HANDLE_BYTES, 0, 64)
    assert reg.cuda_status() == []
