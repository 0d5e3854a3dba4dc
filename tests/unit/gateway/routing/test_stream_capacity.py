"""A generation backend's in-stream refusal when its capacity is full ("... is
at capacity (N sequences); retry later"): the worker is busy, not broken; the
stream is retried on another replica before its first response, and with no
other replica the refusal reaches the caller as an overload (a retry hint),
the worker still READY. Fakes as in test_streams.py."""

from __future__ import annotations

import pytest

from gateway.fleet.cluster import WorkerStatus
from gateway.replicas.errors import WorkerBusy
from gateway.routing.router import Router
from gateway.routing.streams import StreamRouting
from tests.unit.gateway.routing.test_router import started
from tests.unit.gateway.routing.test_streams import FakeCall, collect, reply, streaming

FULL = "model 'm' is at capacity (32 sequences); retry later"


async def test_a_full_worker_sends_the_stream_to_another_replica() -> None:
    cluster, fleet = await started("a:1", "b:1")
    streaming(fleet["a:1"], [FakeCall([reply(-1, error=FULL)])])
    streaming(fleet["b:1"], [FakeCall([reply(4), reply(-1, final=True)])])
    a, b = cluster.workers()
    a.inflight = 0
    b.inflight = 1  # the chooser tries the least loaded first: a
    routing = StreamRouting(Router(cluster, max_inflight_per_replica=4))
    try:
        assert await collect(routing) == [4, -1]
        assert a.retries == 1 and a.failures == 0  # busy is no fault of the worker's
        assert all(w.state is WorkerStatus.READY for w in cluster.workers())
    finally:
        await cluster.stop()


async def test_with_no_other_replica_the_refusal_is_an_overload_with_its_words() -> None:
    cluster, fleet = await started("a:1")
    streaming(fleet["a:1"], [FakeCall([reply(-1, error=FULL)])])
    routing = StreamRouting(Router(cluster))
    try:
        with pytest.raises(WorkerBusy) as info:
            await collect(routing)
        assert info.value.message == FULL and info.value.http_status == 503 and info.value.retry_after_s > 0
        (worker,) = cluster.workers()
        assert worker.state is WorkerStatus.READY and worker.inflight == 0
    finally:
        await cluster.stop()
