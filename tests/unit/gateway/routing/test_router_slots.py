"""Tests for gateway/routing/router.py's per-replica bounds: each replica's
execution slots (from its served config) set when it is busy and when full."""

from __future__ import annotations

import dataclasses
import random

from gateway.fleet.cluster import Cluster
from gateway.routing.router import Router
from tests.unit.gateway.routing.test_router import started



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
