"""Tests for gateway/routing/retry_budget.py (the budget, the jittered backoff) and for
the router's use of them: retries cannot amplify an outage, and batches leaving
a replica that is going always move.
"""

from __future__ import annotations

import asyncio
import random

import pytest
from tritonclient.grpc import service_pb2

from gateway.replicas.errors import ModelNotReady, WorkerBusy
from gateway.routing.retry_budget import Backoff, RetryBudget
from gateway.routing.router import Router
from gateway.settings import RetrySettings
from protos.errors import Unavailable
from tests.unit.gateway.routing.test_router import started, until


def test_budget_is_a_share_of_active_calls_with_a_floor() -> None:
    budget = RetryBudget(budget_percent=20.0, min_concurrency=3)
    assert budget.limit() == 3  # no calls: the floor
    for _ in range(100):
        budget.call_started()
    assert budget.limit() == 20
    granted = sum(budget.try_acquire() for _ in range(50))
    assert granted == 20
    counters = budget.counters()
    assert (counters.active, counters.extra_inflight, counters.granted, counters.denied) == (100, 20, 20, 30)
    budget.release()
    assert budget.try_acquire()  # a finished retry frees its token
    assert not budget.try_acquire()
    for _ in range(100):
        budget.call_finished()
    assert budget.limit() == 3


def test_budget_release_without_a_token_is_a_bug() -> None:
    budget = RetryBudget()
    with pytest.raises(RuntimeError):
        budget.release()


def test_backoff_is_fully_jittered_exponential_and_capped() -> None:
    backoff = Backoff(base_s=0.025, max_s=0.25, rng=random.Random(7))
    assert [backoff.ceiling_s(n) for n in (0, 1, 2, 3, 4, 5, 10, 1000)] == [
        0.0, 0.025, 0.05, 0.1, 0.2, 0.25, 0.25, 0.25,
    ]
    for retry in (1, 2, 3, 6):
        delays = [backoff.delay_s(retry) for _ in range(500)]
        ceiling = backoff.ceiling_s(retry)
        assert all(0 <= d < ceiling for d in delays)
        # Spread over the whole range, not clustered at its end: callers that failed together scatter.
        assert min(delays) < ceiling * 0.1 and max(delays) > ceiling * 0.9
    assert Backoff(0.0, 0.0).delay_s(3) == 0.0


def test_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="retry.budget_percent"):
        RetrySettings(budget_percent=120)
    with pytest.raises(ValueError, match="retry.backoff_base_s"):
        RetrySettings(backoff_base_s=1.0, backoff_max_s=0.5)


async def test_outage_retries_are_bounded_by_the_budget() -> None:
    """Every replica fails: 40 concurrent calls make at most 40 first attempts plus
    the budget's retries, not 40 x (1 + retry_limit)."""
    cluster, fleet = await started("a:1", "b:1")
    budget = RetryBudget(budget_percent=20.0, min_concurrency=2)
    router = Router(cluster, max_inflight_per_replica=100, retry_limit=3, retry_backoff_s=0.001,
                    retry_backoff_max_s=0.001, retry_budget=budget)
    release = asyncio.Event()

    async def slow_failure(*args: object, **kwargs: object) -> None:
        await release.wait()
        raise Unavailable("model not ready")

    calls = {"n": 0}
    for fake in fleet.by_address.values():
        def infer(request: object, timeout_s: object = None, _fake=fake) -> object:  # type: ignore[no-untyped-def]
            calls["n"] += 1
            return slow_failure()
        fake.infer = infer  # type: ignore[method-assign]
    try:
        tasks = [asyncio.create_task(router.infer("m", "", service_pb2.ModelInferRequest(model_name="m"), None))
                 for _ in range(40)]
        while calls["n"] < 40:
            await asyncio.sleep(0)
        release.set()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(r, Unavailable) for r in results)
        assert sum("retries are limited" in str(r) for r in results) > 0
        # 40 first attempts; retries at most the budget's share of the 40 calls at any time (8),
        # each retry attempt failing before the next may start.
        assert 40 < calls["n"] <= 40 + 8 * 4
        assert budget.counters().extra_inflight == 0 and budget.counters().active == 0
        assert all(w.inflight == 0 for w in cluster.workers())
    finally:
        await cluster.stop()


def test_a_failover_gets_a_token_whatever_the_budget() -> None:
    budget = RetryBudget(budget_percent=0.0, min_concurrency=0)
    assert not budget.try_acquire()  # no budget at all for retries
    assert budget.try_acquire(failover=True)  # but a batch leaving a replica that is going still moves
    assert budget.counters().extra_inflight == 1  # and its token counts while it runs
    budget.release()
    assert budget.counters().extra_inflight == 0


async def test_batches_on_a_stopping_replica_all_move_when_the_budget_is_spent() -> None:
    """A Triton server shutting down answers every batch it holds "Server is stopping":
    each one moves to the other replica even with no retry budget left, where a plain
    failure would go back to its caller."""
    cluster, fleet = await started("a:1", "b:1")
    a, b = cluster.workers()
    budget = RetryBudget(budget_percent=0.0, min_concurrency=0)
    router = Router(cluster, max_inflight_per_replica=8, busy_inflight_per_replica=8, retry_backoff_s=0.0,
                    retry_backoff_max_s=0.0, retry_budget=budget)
    release = asyncio.Event()
    held = {"n": 0}

    async def stopping(*args: object, **kwargs: object) -> None:
        held["n"] += 1
        await release.wait()
        raise ModelNotReady("[request id: <id_unknown>] Server is stopping, scheduler for model has stopped "
                            "accepting new inference requests")

    fleet["a:1"].infer = stopping  # type: ignore[method-assign]
    try:
        b.inflight = 8  # every batch goes to a first
        tasks = [asyncio.create_task(router.infer("m", "", service_pb2.ModelInferRequest(model_name="m"), None))
                 for _ in range(5)]
        await until(lambda: held["n"] == 5)
        b.inflight = 0
        release.set()
        answers = await asyncio.gather(*tasks)
        assert [r.id for r in answers] == ["b:1"] * 5
        assert "m" not in a.models  # out of the model's rotation until a probe brings it back
        assert budget.counters().extra_inflight == 0
        # A plain failure with the same (empty) budget is not retried.
        fleet["b:1"].infer_results = [Unavailable("worker overloaded")]
        with pytest.raises(Unavailable, match="retries are limited"):
            await router.infer("m", "", service_pb2.ModelInferRequest(model_name="m"), None)
    finally:
        await cluster.stop()


async def test_a_load_refusal_with_the_budget_spent_goes_back_in_its_own_words() -> None:
    """Under a burst every replica may be full and the budget spent: the caller hears the refusal (load,
    with its retry hint), not that many requests fail."""
    cluster, fleet = await started("a:1", "b:1")
    a, b = cluster.workers()
    router = Router(cluster, retry_backoff_s=0.0, retry_backoff_max_s=0.0,
                    retry_budget=RetryBudget(budget_percent=0.0, min_concurrency=0))
    fleet["a:1"].infer_results = [WorkerBusy("model 'm' is at capacity (32 sequences); retry later")]
    try:
        b.inflight = 1  # makes `a` the first choice
        with pytest.raises(WorkerBusy, match="at capacity"):
            await router.infer("m", "", service_pb2.ModelInferRequest(model_name="m"), None)
        assert a.failures == 0  # load, charged to no one
    finally:
        await cluster.stop()
