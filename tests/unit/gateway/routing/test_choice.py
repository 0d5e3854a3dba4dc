"""Tests for gateway/routing/choice.py: the router consults the replica choice
policy it is handed, with the candidates and the replicas a call has tried;
the default policy is the least loaded one, in the router and in the
composition root."""

from __future__ import annotations

from collections.abc import Sequence, Set

import pytest

from gateway.batching.seams import NotSent
from gateway.composition import build_router
from gateway.fleet.cluster import WorkerState
from gateway.routing.capacity import InflightBounds
from gateway.routing.choice import LeastLoaded
from gateway.routing.prefix import PrefixAffinity
from gateway.routing.router import Router
from gateway.settings import GatewayConfig
from protos.errors import Unavailable
from tests.unit.gateway.routing.test_router import request, started


class Fixed:
    """Picks the candidate at ``address``, else the first one (with ``fallback``) or none; records every call."""

    def __init__(self, address: str | None, *, fallback: bool = False) -> None:
        self.address = address
        self.fallback = fallback
        self.calls: list[tuple[str, str, list[str], set[str]]] = []

    def choose(
        self, model: str, version: str, candidates: Sequence[WorkerState], avoid: Set[WorkerState],
        bounds: InflightBounds,
    ) -> WorkerState | None:
        self.calls.append((model, version, sorted(w.address for w in candidates), {w.address for w in avoid}))
        return next((w for w in candidates if w.address == self.address), candidates[0] if self.fallback else None)


async def test_the_policy_handed_in_is_the_one_consulted() -> None:
    cluster, fleet = await started("a:1", "b:1")
    a, b = cluster.workers()
    chooser = Fixed("b:1")
    router = Router(cluster, max_inflight_per_replica=4, chooser=chooser)
    try:
        b.inflight = 1  # least loaded would pick a
        assert LeastLoaded().choose("m", "", [a, b], set(), router.bounds) is a
        assert (await router.infer("m", "", request(), None)).id == "b:1"
        assert chooser.calls == [("m", "", ["a:1", "b:1"], set())]
        assert fleet["a:1"].infer_calls == [] and len(fleet["b:1"].infer_calls) == 1
    finally:
        b.inflight = 0
        router.close()
        await cluster.stop()


async def test_a_retry_tells_the_policy_which_replica_failed() -> None:
    cluster, fleet = await started("a:1", "b:1")
    chooser = Fixed("a:1", fallback=True)
    router = Router(cluster, retry_backoff_s=0.0, chooser=chooser)
    fleet["a:1"].infer_results = [Unavailable("model not ready")]
    try:
        assert (await router.infer("m", "", request(), None)).id == "b:1"
        # The retry's candidates are the replicas not tried yet; the failed one is in ``avoid``.
        assert chooser.calls == [("m", "", ["a:1", "b:1"], set()), ("m", "", ["b:1"], {"a:1"})]
    finally:
        router.close()
        await cluster.stop()


async def test_a_policy_that_picks_none_means_no_replica_now() -> None:
    cluster, _ = await started("a:1", "b:1")
    router = Router(cluster, chooser=Fixed(None))
    try:
        with pytest.raises(NotSent):
            await router.infer("m", "", request(), None, wait_for_slot=False)
    finally:
        router.close()
        await cluster.stop()


async def test_the_default_policy_is_least_loaded() -> None:
    cluster, _ = await started("a:1")
    try:
        assert isinstance(Router(cluster).chooser, LeastLoaded)
        # The composition root's: least loaded, with prefix affinity for generative streams.
        chooser = build_router(GatewayConfig(), cluster).chooser
        assert isinstance(chooser, PrefixAffinity) and isinstance(chooser.inner, LeastLoaded)
    finally:
        await cluster.stop()
