"""A host-memory stand-in for a CUDA device, for tests of the shared-memory
registry's bookkeeping only: the gateway's one ``CudaIpc`` is cuda-python's."""

from __future__ import annotations

import uuid

from gateway.requests.cuda_ipc import IPC_HANDLE_BYTES, CudaIpcError

_SPACING = 1 << 32  # fake device addresses: one allocation per 4 GiB


class HostIpc:
    """A host-memory stand-in for the device: handles name bytearrays, pointers are offsets into them."""

    def __init__(self) -> None:
        self._by_handle: dict[bytes, tuple[int, bytearray]] = {}
        self.open_pointers: list[int] = []
        self.closed: list[int] = []
        self.fail_reads = False

    def allocate(self, size: int, fill: bytes = b"") -> bytes:
        handle = uuid.uuid4().bytes * (IPC_HANDLE_BYTES // 16)
        memory = bytearray(size)
        memory[: len(fill)] = fill
        self._by_handle[handle] = ((len(self._by_handle) + 1) * _SPACING, memory)
        return handle

    def memory(self, handle: bytes) -> bytearray:
        return self._by_handle[handle][1]

    def _locate(self, pointer: int) -> tuple[bytearray, int]:
        for base, memory in self._by_handle.values():
            if base <= pointer < base + _SPACING:
                return memory, pointer - base
        raise CudaIpcError("invalid argument")

    def open(self, raw_handle: bytes, device_id: int) -> tuple[int, int]:
        if device_id != 0:
            raise CudaIpcError(f"cudaSetDevice({device_id}): invalid device ordinal")
        if raw_handle not in self._by_handle:
            raise CudaIpcError("failed to open CUDA IPC handle: invalid argument")
        base, memory = self._by_handle[raw_handle]
        self.open_pointers.append(base)
        return base, len(memory)

    def close(self, pointer: int, device_id: int) -> None:
        self.open_pointers.remove(pointer)
        self.closed.append(pointer)

    def to_host(self, pointer: int, device_id: int, size: int) -> bytes:
        if self.fail_reads:
            raise CudaIpcError("cudaMemcpy device to host: an illegal memory access was encountered")
        memory, start = self._locate(pointer)
        return bytes(memory[start:start + size])

    def from_host(self, pointer: int, device_id: int, data: memoryview) -> None:
        memory, start = self._locate(pointer)
        memory[start:start + data.nbytes] = data
