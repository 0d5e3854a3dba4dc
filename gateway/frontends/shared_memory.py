"""Triton's shared-memory extensions at the gateway: the region registry and
the reads and writes of tensors in client regions.

System shared memory: a client creates a POSIX shared-memory object (e.g.
with ``tritonclient.utils.shared_memory``), registers a window of it (key,
offset, byte size) under a region name, then names the region in an input's
or a requested output's parameters (``shared_memory_region``,
``shared_memory_byte_size``, ``shared_memory_offset``). The gateway maps the
window, reads input bytes out of it when it decodes a request and writes
output bytes into it when the answer comes back, so the workers, local or
remote, only ever see ordinary tensors. One registry serves both frontends,
as Triton's one shared-memory manager does.

CUDA shared memory needs a GPU in the gateway's own process; this server has
none to offer, so registration is refused with a clear message and the status
lists nothing (see :data:`CUDA_UNAVAILABLE`).

Messages are Triton's (``shared_memory_manager.cc`` and its frontends).
Lifetime: a region unregistered while requests still use it stays mapped
until the last of them lets go of its :class:`RegionSlice` (the mapping is
closed when its last reference goes), as Triton defers the unmap.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

from protos.errors import AlreadyExists, InvalidArgument, NotFound

REGION = "shared_memory_region"
BYTE_SIZE = "shared_memory_byte_size"
OFFSET = "shared_memory_offset"
SHM_KEYS = (REGION, BYTE_SIZE, OFFSET)
# POSIX shared-memory objects live here on Linux (shm_open's namespace).
_SHM_DIR = "/dev/shm"
CUDA_UNAVAILABLE = "CUDA shared memory is not available on this server (it has no GPU)"
# TODO(cuda): with cuda-python importable and a device present, register would
# open the client's IPC handle (cudaIpcOpenMemHandle) and copy device <-> host
# here, so the bytes still travel to the workers as ordinary tensors.


@dataclass(frozen=True, slots=True)
class RegionStatus:
    name: str
    key: str
    offset: int
    byte_size: int


class _Region:
    """One registered window: the mapping of ``[0, offset + byte_size)`` of the object."""

    __slots__ = ("status", "_map")

    def __init__(self, status: RegionStatus, mapping: mmap.mmap) -> None:
        self.status = status
        self._map = mapping

    def read(self, start: int, size: int) -> bytes:
        base = self.status.offset + start
        return self._map[base:base + size]

    def write(self, start: int, data: Any) -> None:
        base = self.status.offset + start
        view = memoryview(data).cast("B")
        self._map[base:base + view.nbytes] = view


@dataclass(frozen=True, slots=True)
class RegionSlice:
    """``byte_size`` bytes at ``offset`` in a registered region, checked against its bounds."""

    name: str
    offset: int
    byte_size: int
    region: _Region

    def read(self) -> bytes:
        return self.region.read(self.offset, self.byte_size)

    def write(self, data: Any) -> None:
        self.region.write(self.offset, data)


def _open_window(name: str, key: str, offset: int, byte_size: int) -> mmap.mmap:
    # shm_open names are "/name": one leading slash, none after it.
    bare = key[1:] if key.startswith("/") else key
    if not bare or "/" in bare or bare in (".", ".."):
        raise InvalidArgument(f"Unable to open shared memory region: '{key}'")
    try:
        fd = os.open(os.path.join(_SHM_DIR, bare), os.O_RDWR)
    except OSError:
        raise InvalidArgument(f"Unable to open shared memory region: '{key}'") from None
    try:
        size = os.fstat(fd).st_size
        if offset + byte_size > size or byte_size == 0:
            raise InvalidArgument(f"failed to register shared memory region '{name}': invalid args")
        # The whole prefix is mapped, so an offset need not be page-aligned.
        return mmap.mmap(fd, offset + byte_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as exc:
        raise InvalidArgument(f"failed to register shared memory region '{name}': {exc.strerror}") from None
    finally:
        os.close(fd)


class SharedMemoryRegistry:
    """The system shared-memory regions registered with this gateway, by name.

    Called from the event loop; the lock only guards against the frontends'
    threads (none today) and costs nothing uncontended.
    """

    def __init__(self) -> None:
        self._regions: dict[str, _Region] = {}
        self._lock = threading.Lock()

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        if not name:
            raise InvalidArgument("'region name' is necessary to register system shared memory region")
        with self._lock:
            if name in self._regions:
                raise AlreadyExists(f"shared memory region '{name}' already in manager")
            mapping = _open_window(name, key, offset, byte_size)
            self._regions[name] = _Region(RegionStatus(name, key, offset, byte_size), mapping)

    def unregister(self, name: str = "") -> None:
        """Forget ``name`` (every region when empty); unknown names are no error, as in Triton."""
        with self._lock:
            if name:
                self._regions.pop(name, None)
            else:
                self._regions.clear()

    def status(self, name: str = "") -> list[RegionStatus]:
        with self._lock:
            if not name:
                return [r.status for r in self._regions.values()]
            region = self._regions.get(name)
        if region is None:
            raise NotFound(f"Unable to find system shared memory region: '{name}'")
        return [region.status]

    # The extension's register and unregister, as both frontends call them: here, this
    # process's registry; a process group's (``gateway.multiproc``) acts on every process.

    async def apply_register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        self.register(name, key, offset, byte_size)

    async def apply_unregister(self, name: str = "") -> None:
        self.unregister(name)

    def slice(self, name: str, offset: int, byte_size: int) -> RegionSlice:
        """The checked window ``[offset, offset + byte_size)`` of region ``name`` (Triton's GetMemoryInfo)."""
        with self._lock:
            region = self._regions.get(name)
        if region is None:
            raise NotFound(f"Unable to find shared memory region: '{name}'")
        size = region.status.byte_size
        if offset >= size:
            raise InvalidArgument(f"Invalid offset for shared memory region: '{name}'")
        if offset + byte_size > size:
            raise InvalidArgument(f"Invalid offset + byte size for shared memory region: '{name}'")
        return RegionSlice(name, offset, byte_size, region)

    def close(self) -> None:
        self.unregister()


def cuda_register_error(name: str) -> InvalidArgument:
    """Triton's words for a CUDA registration on a server without GPUs, then why."""
    if not name:
        return InvalidArgument("'region name' is necessary to register cuda shared memory region")
    return InvalidArgument(
        f"failed to register CUDA shared memory region: '{name}', GPUs not supported ({CUDA_UNAVAILABLE}; "
        "use system shared memory)"
    )


def cuda_status_error(name: str) -> NotFound:
    return NotFound(f"Unable to find cuda shared memory region: '{name}'")


# ---- tensor parameters ---------------------------------------------------------


def _int_param(value: Any, key: str, tensor: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgument(f"invalid value type for '{key}' parameter for tensor '{tensor}', expected int64_param.")
    return value


def take_slice(params: MutableMapping[str, Any], tensor: str, registry: SharedMemoryRegistry) -> RegionSlice | None:
    """Pop a tensor's shared-memory parameters and resolve them; None when it names no region.

    The parameters go: workers see ordinary tensors, never the client's regions.
    """
    if not any(key in params for key in SHM_KEYS):
        return None
    region = params.pop(REGION, None)
    offset = params.pop(OFFSET, None)
    byte_size = params.pop(BYTE_SIZE, None)
    if region is None:
        key = OFFSET if offset is not None else BYTE_SIZE
        raise InvalidArgument(f"'{key}' can not be specified without '{REGION}' parameter for tensor '{tensor}'")
    if not isinstance(region, str):
        raise InvalidArgument(f"invalid value type for '{REGION}' parameter for tensor '{tensor}', expected string_param.")
    if byte_size is None:
        raise InvalidArgument(f"'{BYTE_SIZE}' must be specified along with '{REGION}' parameter for tensor '{tensor}'")
    size = _int_param(byte_size, BYTE_SIZE, tensor)
    start = 0 if offset is None else _int_param(offset, OFFSET, tensor)
    return registry.slice(region, start, size)


def write_output(window: RegionSlice, name: str, data: Any) -> None:
    """Write an output's bytes into its region, refusing (in Triton's words) one that does not fit."""
    nbytes = memoryview(data).nbytes
    if nbytes > window.byte_size:
        raise InvalidArgument(
            f"shared memory size specified with the request for output '{name}' ({window.byte_size} bytes) "
            f"should be at least {nbytes} bytes to hold the results"
        )
    window.write(data)
