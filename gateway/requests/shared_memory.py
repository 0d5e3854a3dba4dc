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

CUDA shared memory: the client registers a CUDA IPC handle of its device
memory (device id, byte size) instead; the registry opens it through
``gateway.requests.cuda_ipc`` and the same parameters, bounds checks and
errors apply: the region's kind is only how its bytes are read (device ->
host) and written (host -> device). Names are unique across both kinds, as
in Triton. A registry built without a ``CudaIpc`` (no GPU, no cuda-python)
refuses CUDA registration with a clear message and lists no CUDA region.

Messages are Triton's (``shared_memory_manager.cc`` and its frontends).
Lifetime: a region unregistered while requests still use it stays open
until the last of them lets go of its :class:`RegionSlice` (a mapping is
closed, a CUDA handle closed, when its last reference goes), as Triton
defers the unmap.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import weakref
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

from gateway.requests.cuda_ipc import IPC_HANDLE_BYTES, CudaIpc, CudaIpcError
from protos.errors import AlreadyExists, Internal, InvalidArgument, NotFound

log = logging.getLogger(__name__)

REGION = "shared_memory_region"
BYTE_SIZE = "shared_memory_byte_size"
OFFSET = "shared_memory_offset"
SHM_KEYS = (REGION, BYTE_SIZE, OFFSET)
# POSIX shared-memory objects live here on Linux (shm_open's namespace).
_SHM_DIR = "/dev/shm"
CUDA_EXTENSION = "cuda_shared_memory"
CUDA_UNAVAILABLE = "CUDA shared memory is not available on this server"
NO_GPU = "it has no GPU"
# Triton's HTTP frontend checks the name before calling its manager; its gRPC frontend does not.
SYSTEM_NAME_NECESSARY = "'region name' is necessary to register system shared memory region"
CUDA_NAME_NECESSARY = "'region name' is necessary to register cuda shared memory region"


@dataclass(frozen=True, slots=True)
class RegionStatus:
    name: str
    key: str
    offset: int
    byte_size: int


@dataclass(frozen=True, slots=True)
class CudaRegionStatus:
    name: str
    device_id: int
    byte_size: int


class _SystemRegion:
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


def _close_handle(ipc: CudaIpc, pointer: int, status: CudaRegionStatus) -> None:
    try:
        ipc.close(pointer, status.device_id)
    except CudaIpcError as exc:  # nothing to answer: the region is gone either way
        log.warning("CUDA shared memory region '%s': %s", status.name, exc)


class _CudaRegion:
    """One registered CUDA IPC handle, open on its device until the region is dropped and unused."""

    __slots__ = ("status", "_ipc", "_pointer", "__weakref__")

    def __init__(self, status: CudaRegionStatus, ipc: CudaIpc, pointer: int) -> None:
        self.status = status
        self._ipc = ipc
        self._pointer = pointer
        # Closed when the last reference goes (the registry's, then in-flight slices'), as a mapping is.
        weakref.finalize(self, _close_handle, ipc, pointer, status)

    def read(self, start: int, size: int) -> bytes | memoryview:
        try:
            return self._ipc.to_host(self._pointer + start, self.status.device_id, size)
        except CudaIpcError as exc:
            raise Internal(f"failed to read CUDA shared memory region '{self.status.name}': {exc}") from None

    def write(self, start: int, data: Any) -> None:
        try:
            self._ipc.from_host(self._pointer + start, self.status.device_id, memoryview(data).cast("B"))
        except CudaIpcError as exc:
            raise Internal(f"failed to write CUDA shared memory region '{self.status.name}': {exc}") from None


_Region = _SystemRegion | _CudaRegion
_KIND_NAMES = {_SystemRegion: "system", _CudaRegion: "CUDA"}


@dataclass(frozen=True, slots=True)
class RegionSlice:
    """``byte_size`` bytes at ``offset`` in a registered region, checked against its bounds."""

    name: str
    offset: int
    byte_size: int
    region: _Region

    def read(self) -> bytes | memoryview:
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
    """The shared-memory regions, system and CUDA, registered with this gateway, by name.

    ``cuda`` is this process's CUDA IPC (``gateway.requests.cuda_ipc.probe_cuda``)
    or None where it has none, ``cuda_unavailable`` then saying why. Called
    from the event loop; the lock only guards against the frontends' threads
    (none today) and costs nothing uncontended.
    """

    def __init__(self, cuda: CudaIpc | None = None, cuda_unavailable: str = NO_GPU) -> None:
        self._regions: dict[str, _Region] = {}
        self._lock = threading.Lock()
        self.use_cuda(cuda, cuda_unavailable)

    def use_cuda(self, cuda: CudaIpc | None, cuda_unavailable: str = NO_GPU) -> None:
        """Serve CUDA regions through ``cuda`` (None: refuse them, saying ``cuda_unavailable``)."""
        self._cuda = cuda
        self._cuda_unavailable = cuda_unavailable

    @property
    def cuda_available(self) -> bool:
        return self._cuda is not None

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        if not name:
            raise InvalidArgument(SYSTEM_NAME_NECESSARY)
        with self._lock:
            if name in self._regions:
                raise AlreadyExists(f"shared memory region '{name}' already in manager")
            mapping = _open_window(name, key, offset, byte_size)
            self._regions[name] = _SystemRegion(RegionStatus(name, key, offset, byte_size), mapping)

    def require_cuda(self, name: str) -> None:
        """Refuse a CUDA registration of ``name`` (Triton's words, then why) where there is no CUDA IPC."""
        if self._cuda is None:
            raise cuda_register_error(name, self._cuda_unavailable)

    def check_cuda_register(self, name: str, raw_handle: bytes) -> None:
        """Refuse a CUDA registration before any handle is opened, as Triton's manager does.

        A ``raw_handle`` that cannot be a handle is Triton's answer to a handle it
        cannot open ("failed to register shared memory region: invalid args"),
        first and GPU or not: Triton's gRPC frontend hands the request straight to
        its manager (its clients, missing arguments included, look for those
        words). The HTTP frontend has checked the region name already.
        """
        if len(raw_handle) != IPC_HANDLE_BYTES:
            raise InvalidArgument(
                f"failed to register shared memory region: invalid args ('raw_handle' must be a cudaIpcMemHandle_t "
                f"of {IPC_HANDLE_BYTES} bytes, got {len(raw_handle)} bytes; "
                "tritonclient.utils.cuda_shared_memory.get_raw_handle gives one)"
            )
        self.require_cuda(name)
        if not name:
            raise InvalidArgument(CUDA_NAME_NECESSARY)

    def register_cuda(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        """Open the client's ``cudaIpcMemHandle_t`` (``raw_handle``) on ``device_id`` as region ``name``."""
        self.check_cuda_register(name, raw_handle)
        assert self._cuda is not None
        with self._lock:
            if name in self._regions:
                raise AlreadyExists(f"shared memory region '{name}' already in manager")
            try:
                pointer, allocation = self._cuda.open(raw_handle, device_id)
            except CudaIpcError as exc:
                why = f"invalid args ({exc})"
                raise InvalidArgument(f"failed to register shared memory region '{name}': {why}") from None
            if byte_size > allocation:
                _close_handle(self._cuda, pointer, CudaRegionStatus(name, device_id, byte_size))
                raise InvalidArgument(
                    f"failed to register shared memory region '{name}': invalid args (byte_size {byte_size} is "
                    f"larger than the {allocation} bytes of device memory behind the handle)"
                )
            status = CudaRegionStatus(name, device_id, byte_size)
            self._regions[name] = _CudaRegion(status, self._cuda, pointer)

    def unregister(self, name: str = "") -> None:
        """Forget system region ``name`` (every one when empty); unknown names are no error, as in Triton."""
        self._unregister(name, _SystemRegion)

    def unregister_cuda(self, name: str = "") -> None:
        """Forget CUDA region ``name`` (every one when empty); its handle closes once no request uses it."""
        self._unregister(name, _CudaRegion)

    def _unregister(self, name: str, kind: type) -> None:
        with self._lock:
            names = [name] if name else list(self._regions)
            dropped = [self._regions.pop(n) for n in names if isinstance(self._regions.get(n), kind)]
        del dropped  # a dropped CUDA region closes its handle here, outside the lock, unless a request holds it

    def status(self, name: str = "") -> list[RegionStatus]:
        return self._status(name, _SystemRegion)

    def cuda_status(self, name: str = "") -> list[CudaRegionStatus]:
        return self._status(name, _CudaRegion)

    def _status(self, name: str, kind: type) -> list[Any]:
        with self._lock:
            if not name:
                return [r.status for r in self._regions.values() if isinstance(r, kind)]
            region = self._regions.get(name)
        wanted = _KIND_NAMES[kind]
        if region is None:
            raise NotFound(f"Unable to find {wanted.lower()} shared memory region: '{name}'")
        if not isinstance(region, kind):
            raise NotFound(f"The region named '{name}' is registered as {_KIND_NAMES[type(region)]} shared memory, "
                           f"not {wanted} shared memory")
        return [region.status]

    # The extension's register and unregister, as both frontends call them: here, this
    # process's registry; a process group's (``gateway.multiproc``) acts on every process.

    async def apply_register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        self.register(name, key, offset, byte_size)

    async def apply_unregister(self, name: str = "") -> None:
        self.unregister(name)

    async def apply_register_cuda(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        self.register_cuda(name, raw_handle, device_id, byte_size)

    async def apply_unregister_cuda(self, name: str = "") -> None:
        self.unregister_cuda(name)

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
        self.unregister_cuda()


def cuda_register_error(name: str, why: str = NO_GPU) -> InvalidArgument:
    """Triton's words for a CUDA registration on a server without GPUs, then why."""
    return InvalidArgument(
        f"failed to register CUDA shared memory region: '{name}', GPUs not supported ({CUDA_UNAVAILABLE}: {why}; "
        "use system shared memory)"
    )


def advertise(metadata: Any, registry: SharedMemoryRegistry) -> Any:
    """Server metadata (``ServerMetadataResponse``) listing ``cuda_shared_memory`` when ``registry`` serves it."""
    if registry.cuda_available and CUDA_EXTENSION not in metadata.extensions:
        metadata.extensions.append(CUDA_EXTENSION)
    return metadata


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
