"""Tests for gateway/routing/router.py's per-replica bounds: each replica's
execution slots (from its served config) set when it is busy and when full;
a light model (gateway/routing/light.py) is busy at one batch, a heavy one
once its waiting batch is on the worker too."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from pathlib import Path

import pytest
from tritonclient.grpc import model_config_pb2, service_pb2

from gateway.config import load_config
from gateway.fleet.cluster import Cluster
from gateway.routing.light import RowCosts
from gateway.routing.router import Router
from gateway.settings import ConfigError
from tests.unit.gateway.batching.fakes import FakeClock
from tests.unit.gateway.routing.test_router import started, until



def with_slots(cluster: Cluster, address: str, slots: int) -> None:
    """The worker's served config states ``slots`` executions of "m" at once."""
    worker = cluster.worker(address)
    assert worker is not None
    worker.models = {**worker.models, "m": dataclasses.replace(worker.models["m"], slots=slots)}


async def test_bounds_follow_each_replicas_execution_slots() -> None:
    cluster, _ = await started("a:1", "b:1")
    router = Router(cluster)
    a, b = cluster.workers()
    with_slots(cluster, "a:1", 3)
    try:
        assert router.limits(a, "m") == (3, 4) and router.limits(b, "m") == (1, 2)
        capacity = router.capacity("m")
        b.inflight = 1  # b's one execution runs: only a's slots are free
        a.inflight = 2
        assert capacity.has_capacity()  # a still has a free execution slot: idle
        a.inflight = 3
        assert not capacity.has_capacity() and capacity.has_room()  # busy, but each takes one waiting batch
        a.inflight, b.inflight = 4, 2
        assert not capacity.has_room()
        # Fixed bounds in the config win over the slots.
        fixed = Router(cluster, max_inflight_per_replica=5, busy_inflight_per_replica=2)
        assert fixed.limits(a, "m") == (2, 5) == fixed.limits(b, "m")
        fixed.close()
    finally:
        a.inflight = b.inflight = 0
        await cluster.stop()


async def test_a_replica_with_free_slots_is_preferred_over_a_busy_one() -> None:
    cluster, _ = await started("a:1", "b:1")
    router = Router(cluster, rng=random.Random(3))
    a, b = cluster.workers()
    with_slots(cluster, "a:1", 4)
    try:
        a.inflight, b.inflight = 2, 1  # a has two free executions, b none
        assert {router._pick(cluster.healthy("m"), "m", set()) for _ in range(20)} == {a}
    finally:
        a.inflight = b.inflight = 0
        await cluster.stop()



async def test_idle_replicas_share_light_load_whatever_their_slots() -> None:
    cluster, _ = await started("a:1", "b:1")
    router = Router(cluster, rng=random.Random(5))
    a, b = cluster.workers()
    with_slots(cluster, "a:1", 4)
    try:
        picks = {router._pick(cluster.healthy("m"), "m", set()) for _ in range(40)}
        assert picks == {a, b}  # both idle: equals, chosen at random
    finally:
        await cluster.stop()


async def test_a_models_own_bounds_win_over_the_gateways_and_the_slots() -> None:
    cluster, _ = await started("a:1")
    (a,) = cluster.workers()
    with_slots(cluster, "a:1", 2)
    router = Router(cluster, max_inflight_per_replica=6, per_model={"m": {"busy_inflight_per_replica": 1}})
    try:
        # "m": busy after one batch (a light model batches more), full at the gateway-wide bound.
        assert router.limits(a, "m") == (1, 6)
        a.inflight = 1
        assert not router.capacity("m").has_capacity() and router.capacity("m").has_room()
        # Without its own bounds the same model is busy only at its two slots.
        plain = Router(cluster, max_inflight_per_replica=6, per_model={"other": {"busy_inflight_per_replica": 1}})
        assert plain.limits(a, "m") == (2, 6)
        plain.close()
        own_max = Router(cluster, per_model={"m": {"max_inflight_per_replica": 2}})
        assert own_max.limits(a, "m") == (2, 2)  # busy at the slots, capped by its own max
        own_max.close()
    finally:
        a.inflight = 0
        router.close()
        await cluster.stop()


def test_a_models_bounds_are_checked_at_load_and_kept_out_of_its_batching(tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text("models:\n  m:\n    mode: adaptive\n    busy_inflight_per_replica: 1\n")
    config = load_config(path)
    assert config.batching_settings("m") == {"mode": "adaptive"}
    assert config.model_settings("m")["busy_inflight_per_replica"] == 1
    path.write_text("models:\n  m:\n    max_inflight_per_replica: -1\n")
    with pytest.raises(ConfigError, match="models.m.max_inflight_per_replica must be an integer >= 0"):
        load_config(path)


def batch(rows: int) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="m")
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[rows, 16])
    return request


async def timed_calls(router: Router, fake: object, clock: FakeClock, calls: int, seconds: float, rows: int) -> None:
    """``calls`` batches of ``rows`` through the router, each taking ``seconds`` on the fake clock."""
    for _ in range(calls):
        fake.hold = asyncio.Event()  # type: ignore[attr-defined]
        task = asyncio.create_task(router.infer("m", "", batch(rows), None))
        await until(lambda: bool(fake.infer_calls) and not task.done())  # type: ignore[attr-defined]
        clock.t += seconds
        fake.hold.set()  # type: ignore[attr-defined]
        await task
        fake.infer_calls.clear()  # type: ignore[attr-defined]


async def test_a_light_model_is_busy_at_one_batch_a_heavy_one_once_its_waiting_batch_is_sent() -> None:
    cluster, fleet = await started("a:1")
    (a,) = cluster.workers()
    fake = fleet.by_address["a:1"]
    with_slots(cluster, "a:1", 2)
    clock = FakeClock()
    router = Router(cluster, clock=clock, row_costs=RowCosts(0.002, timer=clock.now))
    try:
        assert router.limits(a, "m") == (1, 2)  # no calls yet: counts as light, so a first burst batches up
        await timed_calls(router, fake, clock, 32, 0.004, 8)  # 0.5 ms a row
        assert router.limits(a, "m") == (1, 2)
        a.inflight = 1
        assert not router.capacity("m").has_capacity() and router.capacity("m").has_room()
        a.inflight = 0
        # An explicit bound still wins over the rule.
        fixed = Router(cluster, clock=clock, row_costs=router.row_costs,
                       per_model={"m": {"busy_inflight_per_replica": 2}})
        assert fixed.limits(a, "m") == (2, 3)
        fixed.close()
        # The same model turned heavy (20 ms a row over a whole window): busy only once its
        # waiting batch is there too, so a batch waits on the worker for each slot that frees.
        await timed_calls(router, fake, clock, 256, 0.020, 1)
        assert router.limits(a, "m") == (3, 3)
        a.inflight = 2
        assert router.capacity("m").has_capacity()  # both slots run: the waiting batch still goes at once
        a.inflight = 3
        assert not router.capacity("m").has_capacity() and not router.capacity("m").has_room()
        a.inflight = 0
        # A model that cannot batch (max_batch_size 0) gains nothing from waiting: never light.
        a.models = {"m": dataclasses.replace(a.models["m"], config=model_config_pb2.ModelConfig(name="m"))}
        router.row_costs.observe("m", 0.0, 1)
        cheap = RowCosts(0.002, min_samples=1)
        cheap.observe("m", 0.0001, 1)
        router.row_costs = cheap
        assert router.limits(a, "m") == (2, 3)
    finally:
        a.inflight = 0
        router.close()
        await cluster.stop()


async def test_the_rule_is_off_at_zero() -> None:
    cluster, fleet = await started("a:1")
    (a,) = cluster.workers()
    with_slots(cluster, "a:1", 2)
    clock = FakeClock()
    router = Router(cluster, clock=clock)  # no row_costs given: the rule is off; the gateway's config sets it
    try:
        await timed_calls(router, fleet.by_address["a:1"], clock, 40, 0.0001, 8)
        assert router.limits(a, "m") == (2, 3)
    finally:
        router.close()
        await cluster.stop()
