"""Tests for gateway/routing/hedging.py through the router: a hung worker is found by
time and its calls answered by another replica, hedges race the slow, the
first answer wins exactly once, and the losers are cancelled and release
their slots. The cluster is real; its workers are in-process fakes.
"""

from __future__ import annotations

import asyncio

import pytest
from tritonclient.grpc import service_pb2

from gateway.replicas.errors import ModelNotReady
from gateway.routing.hedging import LatencyTracker
from gateway.routing.outlier import CircuitState, OutlierDetector
from gateway.routing.retry_budget import RetryBudget
from gateway.routing.router import Router
from gateway.settings import HedgeSettings, OutlierSettings
from protos.errors import Unavailable
from tests.unit.gateway.routing.test_router import started, until

# Thresholds of tens of milliseconds keep the tests quick; the fakes answer at once.
FAST_HANG = HedgeSettings(hang_multiplier=1.0, hang_min_s=0.05, min_samples=1)


def request() -> service_pb2.ModelInferRequest:
    return service_pb2.ModelInferRequest(model_name="m")


def test_latency_percentiles() -> None:
    tracker = LatencyTracker(window=64)
    assert tracker.percentile("m", 99) is None
    for i in range(1, 101):
        tracker.observe("m", i / 1000)
    assert tracker.count("m") == 100
    # Only the latest 64 samples (37..100 ms) count.
    assert tracker.percentile("m", 50) == pytest.approx(0.068, abs=0.002)
    assert tracker.percentile("m", 99) == pytest.approx(0.100, abs=0.002)
    assert tracker.percentile("other", 50) is None


def test_hedge_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="hedge.percentile"):
        HedgeSettings(percentile=10)
    with pytest.raises(ValueError, match="hedge.hang_min_s"):
        HedgeSettings(hang_min_s=0)


async def test_hung_worker_is_detected_by_time_and_the_call_answered_elsewhere() -> None:
    cluster, fleet = await started("a:1", "b:1")
    outliers = OutlierDetector(OutlierSettings(consecutive_failures=3))
    router = Router(cluster, hedging=FAST_HANG, outliers=outliers)
    router.latency.observe("m", 0.001)
    fleet["a:1"].hold = asyncio.Event()  # accepts calls, never answers
    a, b = cluster.workers()
    try:
        b.inflight = 1  # makes `a` the first choice
        answer = await asyncio.wait_for(router.infer("m", "", request(), None), 10)
        b.inflight = 0
        assert answer.id == "b:1"
        assert len(fleet["a:1"].infer_calls) == 1 and len(fleet["b:1"].infer_calls) == 1
        assert a.inflight == 0 and b.inflight == 0  # the hung attempt was cancelled, its slot freed
        assert [h.consecutive_failures for h in outliers.snapshot() if h.address == "a:1"] == [1]
        # Two more hangs make three in a row: ejected, and calls stop going there.
        for _ in range(2):
            b.inflight = 1
            assert (await asyncio.wait_for(router.infer("m", "", request(), None), 10)).id == "b:1"
            b.inflight = 0
        assert outliers.state("a:1") is CircuitState.OPEN
        before = len(fleet["a:1"].infer_calls)
        for _ in range(5):
            assert (await router.infer("m", "", request(), None)).id == "b:1"
        assert len(fleet["a:1"].infer_calls) == before
        assert router.retry_budget.counters().extra_inflight == 0
    finally:
        await cluster.stop()


async def test_hedge_races_a_slow_attempt_and_exactly_one_answer_wins() -> None:
    cluster, fleet = await started("a:1", "b:1")
    hedging = HedgeSettings(percentile=95.0, min_delay_s=0.01, min_samples=1, hang_multiplier=0)
    router = Router(cluster, hedging=hedging)
    router.latency.observe("m", 0.001)
    slow = asyncio.Event()
    fleet["a:1"].hold = slow
    a, b = cluster.workers()
    try:
        b.inflight = 1
        answer = await asyncio.wait_for(router.infer("m", "", request(), None), 10)
        b.inflight = 0
        assert answer.id == "b:1"
        assert a.inflight == 0
        assert router.attempts.attempts_running == 0  # the losing attempt too
        # No hang detection configured: the slow attempt was no failure, only lost the race.
        assert router.outliers.state("a:1") is CircuitState.CLOSED
        assert [h.consecutive_failures for h in router.outliers.snapshot() if h.address == "a:1"] == [0]
    finally:
        slow.set()
        await cluster.stop()


async def test_both_attempts_answering_still_gives_one_response() -> None:
    cluster, fleet = await started("a:1", "b:1")
    hedging = HedgeSettings(percentile=95.0, min_delay_s=0.0, min_samples=1, hang_multiplier=0)
    router = Router(cluster, hedging=hedging)
    router.latency.observe("m", 0.0)
    gate = asyncio.Event()
    for fake in fleet.by_address.values():
        fake.hold = gate
    try:
        call = asyncio.create_task(router.infer("m", "", request(), None))
        await until(lambda: sum(len(f.infer_calls) for f in fleet.by_address.values()) == 2)
        assert router.attempts.attempts_running == 2  # the gateway's own load, for outlier judging
        gate.set()  # both attempts answer in the same loop turn
        answer = await asyncio.wait_for(call, 10)
        assert answer.id in ("a:1", "b:1")
        assert all(w.inflight == 0 for w in cluster.workers())
        assert router.retry_budget.counters().extra_inflight == 0
        assert router.attempts.attempts_running == 0
    finally:
        await cluster.stop()


async def test_retry_goes_beside_a_hung_attempt_when_the_other_replica_fails() -> None:
    cluster, fleet = await started("a:1", "b:1", "c:1")
    router = Router(cluster, max_inflight_per_replica=4, hedging=FAST_HANG, retry_backoff_s=0.0)
    router.latency.observe("m", 0.001)
    fleet["a:1"].hold = asyncio.Event()
    fleet["b:1"].infer_results = [Unavailable("model not ready")]
    _, b, c = cluster.workers()
    try:
        b.inflight, c.inflight = 1, 2  # a first, then b, then c
        answer = await asyncio.wait_for(router.infer("m", "", request(), None), 10)
        b.inflight = c.inflight = 0
        assert answer.id == "c:1"
        assert [len(fleet[x].infer_calls) for x in ("a:1", "b:1", "c:1")] == [1, 1, 1]
        assert all(w.inflight == 0 for w in cluster.workers())
    finally:
        await cluster.stop()


async def test_no_second_attempt_without_budget_the_call_waits_for_its_first() -> None:
    cluster, fleet = await started("a:1", "b:1")
    router = Router(cluster, hedging=FAST_HANG, retry_budget=RetryBudget(budget_percent=0, min_concurrency=0))
    router.latency.observe("m", 0.001)
    slow = asyncio.Event()
    fleet["a:1"].hold = slow
    _, b = cluster.workers()
    try:
        b.inflight = 1
        call = asyncio.create_task(router.infer("m", "", request(), None))
        await asyncio.sleep(0.2)  # past the hang threshold a few times over
        assert not call.done() and len(fleet["b:1"].infer_calls) == 0
        slow.set()
        assert (await asyncio.wait_for(call, 10)).id == "a:1"
        b.inflight = 0
        assert router.retry_budget.counters().denied >= 1
    finally:
        await cluster.stop()


async def test_caller_cancel_cancels_every_attempt() -> None:
    cluster, fleet = await started("a:1", "b:1")
    router = Router(cluster, hedging=FAST_HANG)
    router.latency.observe("m", 0.001)
    for fake in fleet.by_address.values():
        fake.hold = asyncio.Event()
    try:
        call = asyncio.create_task(router.infer("m", "", request(), None))
        await until(lambda: sum(len(f.infer_calls) for f in fleet.by_address.values()) == 2)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert all(w.inflight == 0 for w in cluster.workers())
        assert router.retry_budget.counters().extra_inflight == 0
        assert router.retry_budget.counters().active == 0
        assert router.attempts.attempts_running == 0  # cancelled attempts are counted out too
    finally:
        await cluster.stop()


async def test_a_dropped_model_is_retried_without_counting_against_the_worker() -> None:
    cluster, fleet = await started("a:1", "b:1")
    router = Router(cluster, retry_backoff_s=0.0)
    fleet["a:1"].infer_results = [ModelNotReady("model 'm' is not at ready state")]
    _, b = cluster.workers()
    try:
        b.inflight = 1
        assert (await router.infer("m", "", request(), None)).id == "b:1"
        b.inflight = 0
        assert [h.consecutive_failures for h in router.outliers.snapshot() if h.address == "a:1"] == [0]
    finally:
        await cluster.stop()
