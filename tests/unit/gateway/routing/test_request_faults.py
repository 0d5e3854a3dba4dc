"""Tests for whose fault a failed batch is (gateway/routing/faults.py, attempts.py, router.py):
request faults never count against a worker; an INTERNAL failure is confirmed
on one other replica before it counts against anyone. The cluster is real;
its workers are in-process fakes.
"""

from __future__ import annotations

import pytest

from gateway.routing.outlier import CircuitState, OutlierDetector
from gateway.routing.retry_budget import RetryBudget
from gateway.routing.router import Router
from gateway.settings import OutlierSettings
from protos.errors import Internal, InvalidArgument
from tests.unit.gateway.routing.test_router import request, started

BROADCAST = "onnx runtime failed to run the model: Add node: cannot broadcast 2 by 3"


def consecutive(router: Router, address: str) -> int:
    return next(h.consecutive_failures for h in router.outliers.snapshot() if h.address == address)


async def test_request_faults_never_eject_a_worker() -> None:
    cluster, fleet = await started("a:1", "b:1")
    router = Router(cluster, retry_backoff_s=0.0, outliers=OutlierDetector(OutlierSettings(consecutive_failures=2)))
    a, b = cluster.workers()
    fleet["a:1"].infer_results = [InvalidArgument("onnx runtime error: Gather node: idx=9 out of bounds")] * 10
    try:
        b.inflight = 4  # every call goes to `a`
        for _ in range(10):
            with pytest.raises(InvalidArgument, match="idx=9"):
                await router.infer("m", "", request(), None)
        assert len(fleet["a:1"].infer_calls) == 10 and not fleet["b:1"].infer_calls  # no retry
        assert router.outliers.state("a:1") is CircuitState.CLOSED and consecutive(router, "a:1") == 0
        assert a.failures == 0 and router.retry_budget.counters().granted == 0
    finally:
        await cluster.stop()


async def test_internal_that_another_replica_serves_is_the_workers_fault() -> None:
    cluster, fleet = await started("a:1", "b:1")
    router = Router(cluster, retry_backoff_s=0.0)
    a, b = cluster.workers()
    fleet["a:1"].infer_results = [Internal("CUDA error: an illegal memory access")]
    try:
        b.inflight = 1
        response = await router.infer("m", "", request(), None)
        assert response.id == "b:1"
        assert a.failures == 1 and consecutive(router, "a:1") == 1
        assert b.failures == 0 and consecutive(router, "b:1") == 0
    finally:
        await cluster.stop()


async def test_the_same_internal_failure_on_two_replicas_is_the_requests_fault() -> None:
    cluster, fleet = await started("a:1", "b:1", "c:1")
    router = Router(cluster, retry_backoff_s=0.0, outliers=OutlierDetector(OutlierSettings(consecutive_failures=1)))
    for address in ("a:1", "b:1", "c:1"):
        fleet[address].infer_results = [Internal(BROADCAST)] * 5
    try:
        for _ in range(5):
            with pytest.raises(InvalidArgument, match="cannot broadcast 2 by 3.*same failure on 2 replicas"):
                await router.infer("m", "", request(), None)
        calls = sum(len(fleet[a].infer_calls) for a in ("a:1", "b:1", "c:1"))
        assert calls == 10  # one confirming attempt per call, never a third
        assert all(router.outliers.state(a) is CircuitState.CLOSED for a in ("a:1", "b:1", "c:1"))
        assert all(w.failures == 0 for w in cluster.workers())
        assert router.retry_budget.counters().granted == 5 and router.retry_budget.counters().extra_inflight == 0
    finally:
        await cluster.stop()


async def test_internal_with_no_other_replica_answers_its_cause_and_charges_no_one() -> None:
    cluster, fleet = await started("a:1")
    router = Router(cluster, retry_backoff_s=0.0, outliers=OutlierDetector(OutlierSettings(consecutive_failures=1)))
    fleet["a:1"].infer_results = [Internal(BROADCAST)]
    try:
        with pytest.raises(Internal, match="cannot broadcast"):
            await router.infer("m", "", request(), None)
        assert len(fleet["a:1"].infer_calls) == 1
        assert consecutive(router, "a:1") == 0 and cluster.workers()[0].failures == 0
    finally:
        await cluster.stop()


async def test_internal_with_no_budget_for_a_confirming_attempt_charges_no_one() -> None:
    cluster, fleet = await started("a:1", "b:1")
    router = Router(cluster, retry_backoff_s=0.0, retry_budget=RetryBudget(budget_percent=0, min_concurrency=0))
    a, b = cluster.workers()
    fleet["a:1"].infer_results = [Internal(BROADCAST)]
    try:
        b.inflight = 1
        with pytest.raises(Internal, match="cannot broadcast"):
            await router.infer("m", "", request(), None)
        assert not fleet["b:1"].infer_calls and consecutive(router, "a:1") == 0
    finally:
        await cluster.stop()


async def test_different_internal_failures_answer_the_last_cause() -> None:
    cluster, fleet = await started("a:1", "b:1")
    router = Router(cluster, retry_backoff_s=0.0)
    a, b = cluster.workers()
    fleet["a:1"].infer_results = [Internal("worker a: device lost")]
    fleet["b:1"].infer_results = [Internal("worker b: out of memory")]
    try:
        b.inflight = 1
        with pytest.raises(Internal, match="worker b: out of memory"):
            await router.infer("m", "", request(), None)
        assert consecutive(router, "a:1") == 0 and consecutive(router, "b:1") == 0
    finally:
        await cluster.stop()
