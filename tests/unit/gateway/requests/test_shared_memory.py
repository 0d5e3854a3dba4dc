"""The shared-memory region registry and the tensor-parameter rules, on real
POSIX shared-memory objects (files under /dev/shm), in Triton's words."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from gateway.requests.shared_memory import SharedMemoryRegistry, take_slice, write_output
from protos.errors import AlreadyExists, InvalidArgument, NotFound

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs POSIX shared memory at /dev/shm")


@pytest.fixture
def key() -> Iterator[str]:
    name = f"infergate_unit_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    path = f"/dev/shm/{name}"
    with open(path, "wb") as f:
        f.write(bytes(range(64)))
    try:
        yield "/" + name
    finally:
        os.unlink(path)


def test_register_read_write_status_unregister(key: str) -> None:
    reg = SharedMemoryRegistry()
    reg.register("r", key, 16, 32)  # a window not on a page boundary
    assert [(s.name, s.key, s.offset, s.byte_size) for s in reg.status()] == [("r", key, 16, 32)]
    window = reg.slice("r", 4, 8)
    assert window.read() == bytes(range(20, 28))
    write_output(window, "OUT", b"\xff" * 8)
    with open("/dev/shm" + key, "rb") as f:
        assert f.read()[20:28] == b"\xff" * 8
    reg.unregister("r")
    reg.unregister("r")  # unknown names are no error
    assert reg.status() == []
    # A window taken before the unregister still works: the mapping lives while it is used.
    assert window.read() == b"\xff" * 8


def test_registration_errors(key: str) -> None:
    reg = SharedMemoryRegistry()
    reg.register("r", key, 0, 64)
    with pytest.raises(AlreadyExists, match="shared memory region 'r' already in manager"):
        reg.register("r", key, 0, 8)
    with pytest.raises(InvalidArgument, match="failed to register shared memory region 'big': invalid args"):
        reg.register("big", key, 8, 64)
    with pytest.raises(InvalidArgument, match="Unable to open shared memory region: '/a/b'"):
        reg.register("nested", "/a/b", 0, 8)
    with pytest.raises(InvalidArgument, match="'region name' is necessary"):
        reg.register("", key, 0, 8)
    with pytest.raises(NotFound, match="Unable to find system shared memory region: 'x'"):
        reg.status("x")


def test_slice_bounds_and_parameters(key: str) -> None:
    reg = SharedMemoryRegistry()
    reg.register("r", key, 0, 64)
    with pytest.raises(NotFound, match="Unable to find shared memory region: 'x'"):
        reg.slice("x", 0, 4)
    with pytest.raises(InvalidArgument, match="Invalid offset for shared memory region: 'r'"):
        reg.slice("r", 64, 1)
    with pytest.raises(InvalidArgument, match="Invalid offset \\+ byte size for shared memory region: 'r'"):
        reg.slice("r", 60, 8)
    params = {"shared_memory_region": "r", "shared_memory_byte_size": 4, "shared_memory_offset": 8, "x": 1}
    window = take_slice(params, "IN", reg)
    assert window is not None and window.read() == bytes(range(8, 12))
    assert params == {"x": 1}  # the region's parameters never reach a worker
    assert take_slice({"x": 1}, "IN", reg) is None
    with pytest.raises(InvalidArgument, match="'shared_memory_byte_size' must be specified along with"):
        take_slice({"shared_memory_region": "r"}, "IN", reg)
    with pytest.raises(InvalidArgument, match="'shared_memory_offset' can not be specified without"):
        take_slice({"shared_memory_offset": 4}, "IN", reg)
    with pytest.raises(InvalidArgument, match="expected int64_param"):
        take_slice({"shared_memory_region": "r", "shared_memory_byte_size": "4"}, "IN", reg)
    with pytest.raises(InvalidArgument, match="\\(4 bytes\\) should be at least 8 bytes to hold the results"):
        write_output(reg.slice("r", 0, 4), "OUT", b"\0" * 8)
