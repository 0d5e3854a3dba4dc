"""The extension state of several processes kept alike (``gateway.multiproc.replicated``):
three processes' replicas in one event loop, each peer call going straight to
the other's replicator and its errors through the peer endpoint's error body,
on real POSIX shared-memory objects (files under /dev/shm)."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import orjson
import pytest

from gateway.multiproc.peers import error_body, error_from_peer
from gateway.multiproc.replicated import GroupLogSettings, GroupRegions, GroupTraceSettings, Replicator
from protos.errors import AlreadyExists, InferGateError, InvalidArgument, Unavailable
from serverkit.tracing import TraceConfig
from tests.unit.gateway.requests.host_ipc import HostIpc

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs POSIX shared memory at /dev/shm")


class LoopbackGroup:
    """One process's ``ProcessGroup`` among ``size``, whose calls reach the others' replicators directly."""

    def __init__(self, index: int, size: int, everyone: dict[int, Replicator], down: set[int]) -> None:
        self.index, self.size = index, size
        self._everyone = everyone
        self._down = down
        self.calls: list[tuple[int, str]] = []

    @property
    def is_leader(self) -> bool:
        return self.index == 0

    def others(self) -> list[int]:
        return [i for i in range(self.size) if i != self.index]

    async def call(self, index: int, method: str, path: str, *, params: Mapping[str, str] | None = None,
                   body: bytes = b"", timeout_s: float = 30.0) -> bytes:
        self.calls.append((index, path))
        if index in self._down:
            raise Unavailable(f"gateway process {index} did not answer")
        replicator, kind = self._everyone[index], (params or {})["kind"]
        try:
            if path == "change":
                await replicator.change(kind, orjson.loads(body))
            else:
                replicator.apply_local(kind, orjson.loads(body))
        except InferGateError as e:  # as the peer endpoint answers it, and the caller reads it
            raise error_from_peer(e.http_status, error_body(e)) from None
        return b"{}"


class Processes:
    def __init__(self, size: int = 3) -> None:
        self.down: set[int] = set()
        replicators: dict[int, Replicator] = {}
        self.groups = [LoopbackGroup(i, size, replicators, self.down) for i in range(size)]
        for i, group in enumerate(self.groups):
            replicators[i] = Replicator(group)  # type: ignore[arg-type]
        self.regions = [GroupRegions(replicators[i]) for i in range(size)]
        self.logs = [GroupLogSettings(replicators[i]) for i in range(size)]
        self.traces = [GroupTraceSettings(TraceConfig(), lambda name: name == "simple", replicators[i])
                       for i in range(size)]

    def listed(self) -> list[list[tuple[str, str]]]:
        return [sorted((s.name, s.key) for s in r.status()) for r in self.regions]


@pytest.fixture
def key() -> Iterator[str]:
    name = f"infergate_unit_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    with open(f"/dev/shm/{name}", "wb") as f:
        f.write(bytes(64))
    try:
        yield "/" + name
    finally:
        os.unlink(f"/dev/shm/{name}")


def _raises(cls: type[Exception], match: str) -> Any:
    return pytest.raises(cls, match=match)


async def test_a_registration_through_a_follower_holds_in_every_process(key: str) -> None:
    p = Processes()
    await p.regions[2].apply_register("r", key, 0, 64)
    assert p.listed() == [[("r", key)]] * 3
    p.regions[1].slice("r", 0, 64).write(b"\x07" * 64)  # each process maps the region itself
    assert p.regions[0].slice("r", 0, 8).read() == b"\x07" * 8
    # Through the leader, in its order: the follower asked the leader, which told everyone.
    assert p.groups[2].calls[0] == (0, "change")
    assert sorted(p.groups[0].calls) == [(1, "change_local"), (2, "change_local")]

    with _raises(AlreadyExists, "shared memory region 'r' already in manager"):
        await p.regions[1].apply_register("r", key, 0, 8)
    with _raises(InvalidArgument, "Unable to open shared memory region: '/infergate_unit_none'"):
        await p.regions[2].apply_register("other", "/infergate_unit_none", 0, 8)
    assert p.listed() == [[("r", key)]] * 3  # refused by the leader: nothing changed anywhere

    await p.regions[1].apply_unregister("r")
    assert p.listed() == [[]] * 3


async def test_a_registration_a_follower_refuses_is_rolled_back_everywhere(key: str) -> None:
    p = Processes()
    p.regions[2].register("r", key, 0, 8)  # only there: process 2 will refuse the group's "r"
    with _raises(AlreadyExists, "'r' already in manager"):
        await p.regions[1].apply_register("r", key, 0, 64)
    assert p.listed() == [[], [], [("r", key)]]
    assert p.regions[2].status()[0].byte_size == 8  # its own region, untouched by the roll-back

    p.down.add(1)
    with _raises(Unavailable, "gateway process 1 did not answer"):
        await p.regions[0].apply_register("s", key, 0, 64)
    assert p.listed() == [[], [], [("r", key)]]


async def test_concurrent_log_updates_through_two_processes_end_alike() -> None:
    p = Processes()
    try:
        await asyncio.gather(*(p.logs[i].apply({"log_verbose_level": i, "log_info": i != 1})
                                         for i in (1, 2, 1, 2)))
        assert len({orjson.dumps(s.current()) for s in p.logs}) == 1
        with _raises(InvalidArgument, "invalid argument for --log_format, got: XML"):
            await p.logs[2].apply({"log_format": "XML", "log_verbose_level": 3})
        assert len({orjson.dumps(s.current()) for s in p.logs}) == 1
    finally:
        for s in p.logs:
            s.update({"log_verbose_level": 0, "log_info": True})
            s.close()


async def test_trace_settings_through_any_process_hold_in_every_process() -> None:
    p = Processes()
    answer = await p.traces[1].apply("", {"trace_rate": ["5"]})
    assert answer["trace_rate"] == "5"
    assert await p.traces[2].apply("simple", {"trace_level": ["TIMESTAMPS"]}) == p.traces[0].current("simple")
    assert {t.current("simple")["trace_level"][0] for t in p.traces} == {"TIMESTAMPS"}
    assert all(t.active for t in p.traces)
    with _raises(InvalidArgument, "Request for unknown model : nosuch"):
        await p.traces[1].apply("nosuch", {"trace_rate": ["2"]})
    await p.traces[2].apply("simple", {"trace_level": None})
    assert not any(t.active for t in p.traces)


async def test_a_cuda_region_is_opened_in_every_process_and_closed_in_every_one() -> None:
    p, device = Processes(), HostIpc()  # one host-memory stand-in for the device all processes share
    for regions in p.regions:
        regions.use_cuda(device)
    handle = device.allocate(64)
    await p.regions[2].apply_register_cuda("c", handle, 0, 64)
    assert [[r.name for r in regions.cuda_status()] for regions in p.regions] == [["c"]] * 3
    assert len(device.open_pointers) == 3  # each process opened the handle itself
    with _raises(InvalidArgument, "failed to register shared memory region 'd': invalid args"):
        await p.regions[1].apply_register_cuda("d", bytes(64), 0, 8)
    assert len(device.open_pointers) == 3 and p.listed() == [[]] * 3  # refused by the leader, once
    await p.regions[1].apply_unregister_cuda("c")
    assert device.open_pointers == [] and len(device.closed) == 3
    assert [regions.cuda_status() for regions in p.regions] == [[]] * 3
