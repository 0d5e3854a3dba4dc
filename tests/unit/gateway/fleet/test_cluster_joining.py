"""Tests for ``Cluster.joined``: a worker joining now (registered through another gateway
process) is listed before its models are known; a request for one of them waits for its
first probe. Workers are the in-process fakes of test_cluster.py (no sockets).
"""

from __future__ import annotations

import asyncio

import pytest

from gateway.settings import WorkerSpec
from tests.unit.gateway.fleet.test_cluster import FakeFleet, FakeWorker, make_cluster

async def test_joined_waits_for_a_joining_workers_first_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    # A worker another gateway process registered is listed before its models are known:
    # joined() lets a request for one of them wait for the probe instead of "unknown model".
    fleet = FakeFleet({"w2:1": {"late": ["1"]}})
    cluster = make_cluster(fleet, "w1:1")
    await cluster.start()
    try:
        assert await cluster.joined(10.0) is False  # nobody joining: no wait
        gate = asyncio.Event()
        original = FakeWorker.server_ready

        async def gated(self: FakeWorker, timeout_s: float | None = None) -> bool:
            if self.address == "w2:1":
                await gate.wait()
            return await original(self, timeout_s)

        monkeypatch.setattr(FakeWorker, "server_ready", gated)
        joining = asyncio.create_task(cluster.add_worker(WorkerSpec("w2:1")))
        while cluster.worker("w2:1") is None:
            await asyncio.sleep(0)  # one loop turn: add_worker lists the worker before its probe
        assert cluster.model("late") is None
        waiter = asyncio.create_task(cluster.joined(10.0))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not waiter.done()
        gate.set()
        assert await waiter is True
        assert cluster.model("late") is not None
        await joining
        assert await cluster.joined(10.0) is False
    finally:
        await cluster.stop()
