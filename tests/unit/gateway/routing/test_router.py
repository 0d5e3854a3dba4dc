"""Tests for gateway/routing/router.py: replica choice, in-flight bounds and capacity,
retries, deadlines. The cluster is real; its workers are in-process fakes.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest
from tritonclient.grpc import service_pb2

from gateway.batching.seams import NotSent
from gateway.fleet.cluster import Cluster, WorkerStatus
from gateway.replicas.errors import WorkerBusy, WorkerUnreachable
from gateway.routing.outlier import CircuitState, OutlierDetector
from gateway.routing.router import Router
from gateway.settings import OutlierSettings
from protos.errors import DeadlineExceeded, InvalidArgument, Unavailable
from tests.unit.gateway.fleet.test_cluster import FakeFleet, make_cluster


def request() -> service_pb2.ModelInferRequest:
    return service_pb2.ModelInferRequest(model_name="m")


async def started(*addresses: str, **kwargs: object) -> tuple[Cluster, FakeFleet]:
    fleet = FakeFleet()
    cluster = make_cluster(fleet, *addresses, **kwargs)
    await cluster.start()
    return cluster, fleet


async def until(condition, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    """Yield to the loop until ``condition()`` holds (fakes make progress only when scheduled)."""

    async def loop() -> None:
        while not condition():
            await asyncio.sleep(0)

    await asyncio.wait_for(loop(), timeout_s)


async def test_least_outstanding_spreads_concurrent_batches() -> None:
    cluster, fleet = await started("a:1", "b:1", "c:1")
    router = Router(cluster, max_inflight_per_replica=4)
    hold = asyncio.Event()
    for fake in fleet.by_address.values():
        fake.hold = hold
    try:
        tasks = []
        for n in range(1, 4):
            tasks.append(asyncio.create_task(router.infer("m", "", request(), None)))
            await until(lambda n=n: sum(len(f.infer_calls) for f in fleet.by_address.values()) == n)
        # Each new batch went to an idle replica while there was one.
        assert sorted(len(f.infer_calls) for f in fleet.by_address.values()) == [1, 1, 1]
        assert all(w.inflight == 1 for w in cluster.workers())
        hold.set()
        answers = await asyncio.gather(*tasks)
        assert sorted(r.id for r in answers) == ["a:1", "b:1", "c:1"]
        assert all(w.inflight == 0 and w.sent == 1 for w in cluster.workers())
    finally:
        await cluster.stop()


async def test_least_outstanding_prefers_the_least_loaded() -> None:
    cluster, fleet = await started("a:1", "b:1", "c:1")
    router = Router(cluster, max_inflight_per_replica=4, rng=random.Random(1))
    a, b, c = cluster.workers()
    try:
        # Pretend other batches are in flight (the router only reads the counters).
        a.inflight, b.inflight, c.inflight = 2, 3, 1
        for _ in range(10):
            response = await router.infer("m", "", request(), None)
            assert response.id == "c:1"
    finally:
        await cluster.stop()


async def test_power_of_two_choices_never_picks_the_busiest() -> None:
    addresses = [f"w{i}:1" for i in range(8)]
    cluster, fleet = await started(*addresses)
    router = Router(cluster, max_inflight_per_replica=10, rng=random.Random(7))
    workers = cluster.workers()
    try:
        workers[0].inflight = 5  # strictly the busiest: it loses every comparison
        hits = Counter()
        for _ in range(200):
            hits[(await router.infer("m", "", request(), None)).id] += 1
        assert hits["w0:1"] == 0
        assert len(hits) == 7  # load still spreads over all the others
    finally:
        await cluster.stop()


async def test_inflight_bound_and_capacity() -> None:
    cluster, fleet = await started("a:1")
    router = Router(cluster, max_inflight_per_replica=2)
    capacity = router.capacity("m")
    assert router.capacity("m") is capacity
    fake = fleet["a:1"]
    fake.hold = asyncio.Event()
    try:
        assert capacity.has_capacity()
        first = [asyncio.create_task(router.infer("m", "", request(), None)) for _ in range(2)]
        await until(lambda: len(fake.infer_calls) == 2)
        assert not capacity.has_capacity()
        waiter = asyncio.create_task(capacity.wait())
        third = asyncio.create_task(router.infer("m", "", request(), None))
        for _ in range(20):
            await asyncio.sleep(0)
        # The third batch waits for a slot instead of exceeding the bound.
        assert len(fake.infer_calls) == 2 and not waiter.done() and not third.done()
        assert cluster.workers()[0].inflight == 2

        fake.hold.set()
        await asyncio.wait_for(waiter, 10)
        await asyncio.wait_for(asyncio.gather(*first, third), 10)
        assert len(fake.infer_calls) == 3
        assert capacity.has_capacity()
        await asyncio.wait_for(capacity.wait(), 10)  # resolves at once while there is capacity
    finally:
        await cluster.stop()


async def test_idle_means_below_the_busy_bound_and_room_below_the_inflight_bound() -> None:
    cluster, fleet = await started("a:1", "b:1")
    router = Router(cluster, max_inflight_per_replica=2, busy_inflight_per_replica=1)
    capacity = router.capacity("m")
    a, b = cluster.workers()
    try:
        assert capacity.has_capacity() and capacity.has_room()
        a.inflight = 1  # b is still idle
        assert capacity.has_capacity() and capacity.has_room()
        b.inflight = 1  # both busy, both with room for one more
        assert not capacity.has_capacity() and capacity.has_room()
        a.inflight = b.inflight = 2
        assert not capacity.has_capacity() and not capacity.has_room()
        b.inflight = 0
        assert capacity.has_capacity() and capacity.has_room()
    finally:
        await cluster.stop()


async def test_busy_bound_is_capped_by_the_inflight_bound() -> None:
    cluster, _ = await started("a:1")
    router = Router(cluster, max_inflight_per_replica=2, busy_inflight_per_replica=5)
    try:
        assert router.bounds.busy_inflight_per_replica == 2
        cluster.workers()[0].inflight = 1
        assert router.capacity("m").has_capacity()  # busy only at 2: the old "free slot" meaning
        cluster.workers()[0].inflight = 2
        assert not router.capacity("m").has_capacity()
    finally:
        await cluster.stop()
    with pytest.raises(ValueError):
        Router(cluster, busy_inflight_per_replica=-1)


async def test_a_call_not_yet_on_a_replica_counts_against_capacity() -> None:
    # A call waiting for a slot takes the next one that frees: the batcher must not
    # see that slot as free and send another batch after it.
    cluster, _ = await started("a:1")
    router = Router(cluster, max_inflight_per_replica=1)
    capacity = router.capacity("m")
    worker = cluster.workers()[0]
    try:
        worker.inflight = 1  # a batch of another caller holds the only slot
        waiting = asyncio.create_task(router.infer("m", "", request(), None))
        for _ in range(10):
            await asyncio.sleep(0)
        assert not waiting.done() and capacity.starting == 1
        worker.inflight = 0  # that batch ended; the waiting call has not been woken yet
        assert not capacity.has_capacity() and not capacity.has_room()
        router._slot_freed(worker)
        assert (await asyncio.wait_for(waiting, 10)).id == "a:1"
        assert capacity.starting == 0 and capacity.has_capacity()
        # A call that ends before any attempt ran (no replica at all) gives its count back too.
        cluster.mark_down(worker, "test")
        with pytest.raises(Unavailable):
            await router.infer("m", "", request(), None)
        assert capacity.starting == 0
    finally:
        await cluster.stop()


async def test_retry_unavailable_on_another_replica() -> None:
    cluster, fleet = await started("a:1", "b:1")
    router = Router(cluster, retry_backoff_s=0.0)
    a, b = cluster.workers()
    fleet["a:1"].infer_results = [Unavailable("model not ready")]
    try:
        b.inflight = 1  # makes `a` the first choice
        response = await router.infer("m", "", request(), None)
        b.inflight = 0
        assert response.id == "b:1"
        assert len(fleet["a:1"].infer_calls) == 1 and len(fleet["b:1"].infer_calls) == 1
        assert (a.failures, a.retries, a.sent) == (1, 1, 1)
        assert (b.failures, b.retries, b.sent) == (0, 0, 1)
        # The worker answered, so its connection is fine: it stays in rotation.
        assert a.state is WorkerStatus.READY
        stats = {s.address: s for s in router.worker_stats()}
        assert stats["a:1"].failures == 1 and stats["b:1"].sent == 1
    finally:
        await cluster.stop()


async def test_a_busy_replica_is_retried_elsewhere_and_not_charged() -> None:
    cluster, fleet = await started("a:1", "b:1")
    outliers = OutlierDetector(OutlierSettings(max_ejection_percent=100.0))
    router = Router(cluster, retry_backoff_s=0.0, outliers=outliers)
    a, b = cluster.workers()
    fleet["a:1"].infer_results = [WorkerBusy("Exceeds maximum queue size for model 'm' (8 waiting)")] * 20
    try:
        b.inflight = 1  # makes `a` the first choice
        for _ in range(10):  # more than enough consecutive failures to eject a sick worker
            assert (await router.infer("m", "", request(), None)).id == "b:1"
        b.inflight = 0
        assert len(fleet["a:1"].infer_calls) == 10
        # A full queue is load, not a fault: a keeps a clean record and stays in rotation.
        assert a.failures == 0 and a.state is WorkerStatus.READY
        assert outliers.state("a:1") is CircuitState.CLOSED
    finally:
        await cluster.stop()


async def test_connection_failure_marks_replica_down_and_retries() -> None:
    cluster, fleet = await started("a:1", "b:1", failures_to_down=5)
    router = Router(cluster, retry_backoff_s=0.0)
    a, b = cluster.workers()
    fleet["a:1"].infer_results = [WorkerUnreachable("connection reset")]
    try:
        b.inflight = 1
        response = await router.infer("m", "", request(), None)
        b.inflight = 0
        assert response.id == "b:1"
        assert a.state is WorkerStatus.DOWN
        assert list(cluster.healthy("m")) == [b]
        await cluster.refresh()  # the probe brings it back
        assert a.state is WorkerStatus.READY
    finally:
        await cluster.stop()


async def test_non_retryable_error_passes_through() -> None:
    cluster, fleet = await started("a:1", "b:1")
    router = Router(cluster, retry_backoff_s=0.0)
    a, b = cluster.workers()
    fleet["a:1"].infer_results = [InvalidArgument("unexpected shape for input 'X'")]
    try:
        b.inflight = 1
        with pytest.raises(InvalidArgument, match="unexpected shape"):
            await router.infer("m", "", request(), None)
        assert len(fleet["b:1"].infer_calls) == 0
        assert a.failures == 0 and a.retries == 0 and a.state is WorkerStatus.READY  # the request's fault
        assert a.inflight == 0
    finally:
        await cluster.stop()


async def test_gives_up_after_retry_limit() -> None:
    cluster, fleet = await started("a:1", "b:1")
    router = Router(cluster, retry_limit=3, retry_backoff_s=0.0)
    for fake in fleet.by_address.values():
        fake.infer_results = [Unavailable("busy")] * 10
    try:
        with pytest.raises(Unavailable, match=r"could serve the request \(4 attempts\)") as info:
            await router.infer("m", "", request(), None)
        assert "a:1" not in str(info.value) and "b:1" not in str(info.value)  # no internal addresses
        calls = [len(f.infer_calls) for f in fleet.by_address.values()]
        assert sum(calls) == 4  # one try and three retries
        assert min(calls) >= 1  # the first retry went to the other replica
    finally:
        await cluster.stop()


async def test_deadline_bounds_retries() -> None:
    cluster, fleet = await started("a:1")
    router = Router(cluster, retry_limit=10_000, retry_backoff_s=0.01, retry_backoff_max_s=0.01)
    fleet["a:1"].infer_results = [Unavailable("busy")] * 20_000
    loop = asyncio.get_running_loop()
    try:
        with pytest.raises(DeadlineExceeded, match="failed attempts"):
            await router.infer("m", "", request(), loop.time() + 0.2)
        assert 1 <= len(fleet["a:1"].infer_calls) < 10_000
    finally:
        await cluster.stop()


async def test_worker_call_gets_the_remaining_time() -> None:
    cluster, fleet = await started("a:1")
    router = Router(cluster)
    loop = asyncio.get_running_loop()
    try:
        await router.infer("m", "", request(), None)
        before = loop.time()
        await router.infer("m", "", request(), before + 30.0)
        (_, no_timeout), (_, timeout_s) = fleet["a:1"].infer_calls
        assert no_timeout is None
        assert timeout_s is not None and 0 < timeout_s <= 30.0
    finally:
        await cluster.stop()


async def test_deadline_while_waiting_for_a_slot() -> None:
    cluster, fleet = await started("a:1")
    router = Router(cluster, max_inflight_per_replica=1)
    fake = fleet["a:1"]
    fake.hold = asyncio.Event()
    loop = asyncio.get_running_loop()
    try:
        busy = asyncio.create_task(router.infer("m", "", request(), None))
        await until(lambda: len(fake.infer_calls) == 1)
        with pytest.raises(DeadlineExceeded, match="free replica"):
            await router.infer("m", "", request(), loop.time() + 0.05)
        assert len(fake.infer_calls) == 1  # never sent
        with pytest.raises(DeadlineExceeded):
            await router.infer("m", "", request(), loop.time() - 1.0)
        fake.hold.set()
        await busy
    finally:
        await cluster.stop()


async def test_all_replicas_down_is_unavailable() -> None:
    cluster, fleet = await started("a:1", "b:1")
    router = Router(cluster)
    try:
        for w in cluster.workers():
            cluster.mark_down(w, "test")
        with pytest.raises(Unavailable, match="no healthy replica of model 'm'"):
            await router.infer("m", "", request(), None)
        with pytest.raises(Unavailable, match="no healthy replica"):
            await router.infer("unknown", "", request(), None)
        # No replica: the batcher should dispatch (and fail fast), not hold requests.
        assert router.capacity("m").has_capacity()
        assert all(len(f.infer_calls) == 0 for f in fleet.by_address.values())
    finally:
        await cluster.stop()


async def test_waiting_call_fails_when_replicas_go_down() -> None:
    cluster, fleet = await started("a:1")
    router = Router(cluster, max_inflight_per_replica=1)
    fake = fleet["a:1"]
    fake.hold = asyncio.Event()
    try:
        busy = asyncio.create_task(router.infer("m", "", request(), None))
        await until(lambda: len(fake.infer_calls) == 1)
        waiting = asyncio.create_task(router.infer("m", "", request(), None))
        for _ in range(10):
            await asyncio.sleep(0)
        assert not waiting.done()
        cluster.mark_down(cluster.workers()[0], "test")
        with pytest.raises(Unavailable):
            await asyncio.wait_for(waiting, 10)
        fake.hold.set()
        await busy
    finally:
        await cluster.stop()


async def test_version_routing() -> None:
    fleet = FakeFleet({"a:1": {"m": ["1"]}, "b:1": {"m": ["1", "2"]}})
    cluster = make_cluster(fleet, "a:1", "b:1")
    await cluster.start()
    router = Router(cluster)
    try:
        for _ in range(5):
            assert (await router.infer("m", "2", request(), None)).id == "b:1"
        with pytest.raises(Unavailable, match="version 3"):
            await router.infer("m", "3", request(), None)
    finally:
        await cluster.stop()


async def test_cancelled_call_releases_its_slot() -> None:
    cluster, fleet = await started("a:1")
    router = Router(cluster, max_inflight_per_replica=1)
    fake = fleet["a:1"]
    fake.hold = asyncio.Event()
    try:
        task = asyncio.create_task(router.infer("m", "", request(), None))
        await until(lambda: len(fake.infer_calls) == 1)
        assert not router.capacity("m").has_capacity()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert cluster.workers()[0].inflight == 0
        assert router.capacity("m").has_capacity()
    finally:
        await cluster.stop()


# ---- the worker client's error mapping, which the retry policy relies on ----
# (A channel that never makes a call opens no socket.)




async def test_expired_deadline_is_not_sent() -> None:
    cluster, fleet = await started("a:1")
    router = Router(cluster)
    loop = asyncio.get_running_loop()
    try:
        with pytest.raises(DeadlineExceeded, match="before model 'm' was sent"):
            await router.infer("m", "", request(), loop.time() - 0.001)
        worker = cluster.workers()[0]
        assert fleet["a:1"].infer_calls == [] and (worker.sent, worker.failures, worker.inflight) == (0, 0, 0)
    finally:
        await cluster.stop()


async def test_a_call_that_may_not_wait_goes_only_to_an_idle_replica() -> None:
    """``wait_for_slot=False`` (a model under a queue timeout): a replica that is busy but has room
    does not take the batch -- ``NotSent``, nothing sent, no slot held -- an idle one does."""
    cluster, fleet = await started("a:1", "b:1")
    router = Router(cluster, max_inflight_per_replica=2, busy_inflight_per_replica=1)
    a, b = cluster.workers()
    try:
        a.inflight = b.inflight = 1
        with pytest.raises(NotSent):
            await router.infer("m", "", request(), None, wait_for_slot=False)
        assert router.capacity("m").starting == 0
        assert sum(len(f.infer_calls) for f in fleet.by_address.values()) == 0
        b.inflight = 0
        assert (await router.infer("m", "", request(), None, wait_for_slot=False)).id == "b:1"
    finally:
        await cluster.stop()
