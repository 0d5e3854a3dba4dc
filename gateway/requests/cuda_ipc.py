"""The gateway's access to client GPU memory: CUDA IPC through cuda-python.

A client of Triton's CUDA shared-memory extension allocates device memory,
exports it with ``cudaIpcGetMemHandle`` and sends the 64-byte handle. The
gateway opens the handle (``cudaIpcOpenMemHandle``), copies input bytes
device -> host and output bytes host -> device (``cudaMemcpy``), and closes
it on unregister (``cudaIpcCloseMemHandle``); the tensors then travel to the
workers as ordinary bytes, as they do from system shared memory.

The seam is :class:`CudaIpc`; :class:`CudaPythonIpc` is its one production
implementation. cuda-python is an optional dependency (``infergate[cuda]``),
imported only by :func:`probe_cuda`, which decides once, at start, whether
this process can serve the extension by asking the CUDA runtime how many
devices it sees.

Device calls are synchronous and short (tensor-sized copies); they run on the
caller's thread, like the system extension's reads and writes of a mapping.
Every call first selects the region's device, since the runtime's current
device is per thread.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any, Protocol

log = logging.getLogger(__name__)

# sizeof(cudaIpcMemHandle_t): CUDA_IPC_HANDLE_SIZE.
IPC_HANDLE_BYTES = 64
INSTALL_HINT = "pip install 'infergate[cuda]'"


class CudaIpcError(Exception):
    """A CUDA runtime or driver call failed; the message is the runtime's own (cudaGetErrorString)."""


class CudaIpc(Protocol):
    """Open, copy through and close CUDA IPC memory handles of other processes."""

    def open(self, raw_handle: bytes, device_id: int) -> tuple[int, int]:
        """Open the handle on ``device_id``: (device pointer, bytes of the allocation behind it)."""
        ...

    def close(self, pointer: int, device_id: int) -> None: ...

    def to_host(self, pointer: int, device_id: int, size: int) -> bytes | memoryview: ...

    def from_host(self, pointer: int, device_id: int, data: memoryview) -> None: ...


def _runtime_and_driver() -> tuple[Any, Any]:
    """cuda-python's runtime and driver modules: ``cuda.bindings`` (12.6 on), else the older ``cuda`` names."""
    try:
        from cuda.bindings import driver, runtime
    except ImportError:
        from cuda import cuda as driver  # type: ignore[no-redef]
        from cuda import cudart as runtime  # type: ignore[no-redef]
    return runtime, driver


class CudaPythonIpc:
    """:class:`CudaIpc` over cuda-python's runtime API (and one driver call, for the allocation's size)."""

    def __init__(self, runtime: Any, driver: Any) -> None:
        self._rt = runtime
        self._drv = driver

    def _check(self, result: Any, what: str) -> Any:
        err = result[0]
        if err != self._rt.cudaError_t.cudaSuccess:
            _, text = self._rt.cudaGetErrorString(err)
            raise CudaIpcError(f"{what}: {text.decode(errors='replace') if isinstance(text, bytes) else text}")
        return result[1:]

    def _check_driver(self, result: Any, what: str) -> Any:
        err = result[0]
        if err != self._drv.CUresult.CUDA_SUCCESS:
            _, text = self._drv.cuGetErrorString(err)
            raise CudaIpcError(f"{what}: {text.decode(errors='replace') if isinstance(text, bytes) else text}")
        return result[1:]

    def device_count(self) -> int:
        (count,) = self._check(self._rt.cudaGetDeviceCount(), "cudaGetDeviceCount")
        return int(count)

    def _use(self, device_id: int) -> None:
        self._check(self._rt.cudaSetDevice(device_id), f"cudaSetDevice({device_id})")

    def open(self, raw_handle: bytes, device_id: int) -> tuple[int, int]:
        self._use(device_id)
        handle = self._rt.cudaIpcMemHandle_t()
        # The handle's 64 opaque bytes go in as the client exported them. cuda-python 12 shows them as
        # ``reserved``, 13 no longer does; getPtr() (the struct's address) serves both.
        ctypes.memmove(handle.getPtr(), raw_handle, IPC_HANDLE_BYTES)
        (pointer,) = self._check(
            self._rt.cudaIpcOpenMemHandle(handle, self._rt.cudaIpcMemLazyEnablePeerAccess),
            "failed to open CUDA IPC handle",
        )
        pointer = int(pointer)
        try:
            # As Triton: the registered byte_size must fit the allocation the handle exports.
            _, size = self._check_driver(
                self._drv.cuMemGetAddressRange(self._drv.CUdeviceptr(pointer)), "failed to get CUDA address range"
            )
        except CudaIpcError:
            self.close(pointer, device_id)
            raise
        return pointer, int(size)

    def close(self, pointer: int, device_id: int) -> None:
        self._use(device_id)
        self._check(self._rt.cudaIpcCloseMemHandle(pointer), "failed to close CUDA IPC handle")

    def to_host(self, pointer: int, device_id: int, size: int) -> memoryview:
        out = bytearray(size)
        if size:
            self._use(device_id)
            kind = self._rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
            self._check(self._rt.cudaMemcpy(out, pointer, size, kind), "cudaMemcpy device to host")
        return memoryview(out)

    def from_host(self, pointer: int, device_id: int, data: memoryview) -> None:
        if not data.nbytes:
            return
        self._use(device_id)
        kind = self._rt.cudaMemcpyKind.cudaMemcpyHostToDevice
        self._check(self._rt.cudaMemcpy(pointer, data, data.nbytes, kind), "cudaMemcpy host to device")


def probe_cuda() -> tuple[CudaIpc | None, str]:
    """This process's CUDA IPC, or None and why not (cuda-python missing, no driver, no device).

    Asks the runtime for real (``cudaGetDeviceCount``), once: call it at start.
    """
    try:
        runtime, driver = _runtime_and_driver()
    except ImportError:
        return None, f"cuda-python is not installed ({INSTALL_HINT})"
    ipc = CudaPythonIpc(runtime, driver)
    try:
        count = ipc.device_count()
    except CudaIpcError as exc:  # no driver, or a driver too old for the runtime
        return None, f"the CUDA runtime reports no usable device ({exc})"
    except Exception as exc:  # a broken install: the extension stays off, the gateway still serves
        log.warning("CUDA shared memory off: cuda-python failed to answer cudaGetDeviceCount: %r", exc)
        return None, f"cuda-python failed to start ({exc})"
    if count < 1:
        return None, "the CUDA runtime reports no GPU"
    return ipc, ""
