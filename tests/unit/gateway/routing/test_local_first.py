"""Tests for gateway/routing/choice.py's ``LocalFirst``: the replica in the
gateway's own process takes a batch while it has a free execution slot, and
the wrapped policy picks among the others once it is busy; and the
composition root uses it only where the gateway runs models itself."""

from __future__ import annotations

from gateway.composition import build_router
from gateway.config import load_config
from gateway.fleet.cluster import Cluster, WorkerState
from gateway.replicas.local import LOCAL_SPEC
from gateway.routing.capacity import InflightBounds
from gateway.routing.choice import LeastLoaded, LocalFirst
from gateway.routing.prefix import PrefixAffinity
from gateway.routing.outlier import OutlierDetector
from gateway.settings import GatewayConfig, OutlierSettings, WorkerSpec


def replicas() -> tuple[WorkerState, WorkerState, WorkerState]:
    local = WorkerState(LOCAL_SPEC, client=None)  # type: ignore[arg-type]
    a = WorkerState(WorkerSpec("a:1"), client=None)  # type: ignore[arg-type]
    b = WorkerState(WorkerSpec("b:1"), client=None)  # type: ignore[arg-type]
    return local, a, b


def test_the_local_replica_goes_first_while_it_has_a_free_slot() -> None:
    local, a, b = replicas()
    bounds = InflightBounds(OutlierDetector(OutlierSettings()))
    chooser = LocalFirst(LeastLoaded())
    assert bounds.limits(local, "m")[0] == 1  # one execution slot (no config known)
    for _ in range(5):
        assert chooser.choose("m", "", [a, b, local], set(), bounds) is local
    local.inflight = 1  # busy: the least loaded remote takes the batch
    a.inflight = 1
    assert chooser.choose("m", "", [a, b, local], set(), bounds) is b


def test_the_composition_root_puts_local_first_only_with_a_local_replica() -> None:
    cluster = Cluster([WorkerSpec("a:1")])
    plain = build_router(GatewayConfig(), cluster)
    local = build_router(GatewayConfig(), cluster, local_first=True)
    try:
        assert isinstance(plain.chooser, PrefixAffinity) and isinstance(plain.chooser.inner, LeastLoaded)
        assert isinstance(local.chooser, LocalFirst)
    finally:
        plain.close()
        local.close()


def test_prefix_routing_false_leaves_streams_least_loaded() -> None:
    cluster = Cluster([WorkerSpec("a:1")])
    router = build_router(load_config(prefix_routing=False), cluster)
    try:
        assert isinstance(router.chooser, LeastLoaded)
    finally:
        router.close()
