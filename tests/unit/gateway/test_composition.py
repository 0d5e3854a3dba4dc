"""The composition root hands the core the parts it built, and several-process
mode's parts arrive through the same seams (no subclass, nothing patched)."""

from __future__ import annotations

from typing import Any

import pytest
from tritonclient.grpc import service_pb2

from gateway.batching.registry import Batchers
from gateway.composition import (Seams, build_cluster, build_gateway, build_placement, build_router, compose,
                                 core_settings, group_seams)
from gateway.core import CoreSettings, Gateway, LocalModelControl, LocalStatistics
from gateway.fleet.cluster import Cluster
from gateway.fleet.placement import PlacementController
from gateway.fleet.registry import Registry
from gateway.multiproc.group import FollowerPlacement, GroupModelControl, GroupStatistics
from gateway.multiproc.replicated import GroupLogSettings, GroupRegions, GroupTraceSettings, Replicator
from gateway.observability.trace_settings import TraceSettings
from gateway.settings import BatchingSettings, GatewayConfig, PlacementSettings, ProbeSettings
from protos.errors import Unavailable


class FakeGroup:
    """What the group's parts ask of the process group; every call is recorded."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.size = 2
        self.calls: list[tuple[Any, ...]] = []

    @property
    def is_leader(self) -> bool:
        return self.index == 0

    async def call(self, index: int, method: str, path: str, **kwargs: Any) -> bytes:
        self.calls.append(("call", index, method, path))
        return b"{}"

    async def gather(self, method: str, path: str, **kwargs: Any) -> list[bytes]:
        self.calls.append(("gather", method, path))
        if path == "stats":
            other = service_pb2.ModelStatisticsResponse()
            other.model_stats.add(name="m", version="1", inference_count=5)
            return [other.SerializeToString()]
        return []


def test_the_core_is_handed_what_the_root_built() -> None:
    config = GatewayConfig()
    cluster = build_cluster(config)
    router = build_router(config, cluster)
    gateway = build_gateway(config, cluster=cluster, router=router)
    assert isinstance(gateway, Gateway)
    pipeline, models, streaming = gateway.pipeline, gateway.models, gateway.pipeline.streaming
    # Each core part holds the very parts the root built, not copies or parts of its own.
    assert gateway.cluster is cluster and pipeline._cluster is cluster and models._cluster is cluster
    assert gateway.router is router and pipeline._router is router
    assert gateway.placement is gateway.fleet.placement
    assert pipeline._placement is gateway.fleet.placement and models._placement is gateway.fleet.placement
    assert pipeline._parallel is gateway.parallel and models._parallel is gateway.parallel
    assert pipeline._ensembles is gateway.ensembles and models._ensembles is gateway.ensembles
    assert isinstance(gateway._batchers, Batchers) and pipeline._batchers is gateway._batchers
    assert pipeline._sequences is gateway.sequences and pipeline._cache is gateway.cache
    assert pipeline._stats is gateway.stats and streaming._stats is gateway.stats
    assert pipeline._latency is gateway.latency and streaming._latency is gateway.latency
    assert gateway.streams is streaming.streams
    assert pipeline._tracing is gateway.tracing and type(gateway.tracing.settings) is TraceSettings
    assert isinstance(gateway._statistics, LocalStatistics)
    assert isinstance(gateway._control, LocalModelControl)


async def test_the_core_reads_the_settings_the_root_gave_it() -> None:
    config = GatewayConfig(server_name="triton", strict_readiness=False, model_control_mode="none",
                           shutdown_grace_s=3.0, default_timeout_s=7.0, probe=ProbeSettings(timeout_s=0.5))
    assert core_settings(config) == CoreSettings(server_name="triton", strict_readiness=False,
                                                 model_control_mode="none", shutdown_grace_s=3.0,
                                                 default_timeout_s=7.0, cluster_join_wait_s=0.5)
    gateway = build_gateway(config)
    assert gateway.settings == core_settings(config)
    assert gateway.server_metadata().name == "triton"
    assert (gateway.models._default_timeout_s, gateway.models._cluster_join_wait_s) == (7.0, 0.5)
    assert gateway.pipeline._default_timeout_s == 7.0
    with pytest.raises(Unavailable, match="not allowed"):  # model_control_mode none
        await gateway.load_model("m", {})


def test_a_placement_passed_in_is_the_one_used() -> None:
    made: list[PlacementController] = []

    def placement(config: GatewayConfig, cluster: Cluster, registry: Registry) -> PlacementController:
        made.append(build_placement(config, cluster, registry))
        return made[-1]

    config = GatewayConfig(placement=PlacementSettings(load_on_demand=True))
    gateway = build_gateway(config, seams=Seams(placement=placement))
    assert len(made) == 1
    assert gateway.fleet.placement is made[0] and gateway.placement is made[0]
    assert gateway.pipeline._placement is made[0] and gateway.models._placement is made[0]
    assert made[0]._registry is gateway.fleet.registry  # built on the fleet's own registry
    assert made[0]._cluster is gateway.cluster
    assert made[0].can_load("anything")  # from the config's placement settings


def test_a_followers_parts_arrive_through_the_seams() -> None:
    group = FakeGroup(index=1)
    composed = compose(GatewayConfig(placement=PlacementSettings(load_on_demand=True)), group)  # type: ignore[arg-type]
    gateway = composed.gateway
    assert type(gateway) is Gateway  # no subclass
    assert isinstance(gateway.fleet.placement, FollowerPlacement) and gateway.placement is gateway.fleet.placement
    assert gateway.pipeline._placement is gateway.fleet.placement  # requests touch the follower's
    assert gateway.fleet.placement.can_load("anything")  # with the config's placement settings
    assert isinstance(gateway._statistics, GroupStatistics)
    assert isinstance(gateway._control, GroupModelControl)
    assert isinstance(gateway.tracing.settings, GroupTraceSettings)
    assert isinstance(composed.shm, GroupRegions) and isinstance(composed.logs, GroupLogSettings)
    assert isinstance(composed.replicator, Replicator) and composed.group is group


def test_the_leader_keeps_its_own_placement() -> None:
    group = FakeGroup(index=0)
    gateway = build_gateway(GatewayConfig(), seams=group_seams(group, Replicator(group)))  # type: ignore[arg-type]
    assert type(gateway.fleet.placement) is PlacementController


async def test_statistics_are_the_scopes() -> None:
    group = FakeGroup(index=1)
    gateway = compose(GatewayConfig(), group).gateway  # type: ignore[arg-type]
    local = await gateway.local_statistics()
    whole = await gateway.model_statistics()
    assert ("gather", "GET", "stats") in group.calls
    assert [s.inference_count for s in whole.model_stats if s.name == "m"] == [5]
    assert not [s for s in local.model_stats if s.name == "m"]


async def test_a_follower_forwards_repository_control_to_the_leader() -> None:
    group = FakeGroup(index=1)
    gateway = compose(GatewayConfig(), group).gateway  # type: ignore[arg-type]
    await gateway.load_model("m", {})
    await gateway.unload_model("m")
    assert group.calls == [("call", 0, "POST", "load"), ("call", 0, "POST", "unload")]


def test_batch_policies_come_from_the_config_the_root_read() -> None:
    from tritonclient.grpc import model_config_pb2

    gateway = build_gateway(GatewayConfig(batching=BatchingSettings(mode="fixed", max_queue_size=7)))
    model = model_config_pb2.ModelConfig(max_batch_size=8, dynamic_batching=model_config_pb2.ModelDynamicBatching())
    policy = gateway._batchers.policy("m", model, backend_batches=False)
    assert (policy.mode, policy.max_batch_size, policy.max_queue_size) == ("fixed", 8, 7)
