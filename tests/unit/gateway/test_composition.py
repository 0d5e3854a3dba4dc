"""The composition root hands the core the parts it built, and several-process
mode's parts arrive through the same seams (no subclass, nothing patched)."""

from __future__ import annotations

from typing import Any

from tritonclient.grpc import service_pb2

from gateway.batching.registry import Batchers
from gateway.composition import Seams, build_cluster, build_gateway, build_placement, compose, group_seams
from gateway.core import Gateway, LocalModelControl, LocalStatistics
from gateway.fleet.cluster import Cluster
from gateway.fleet.placement import PlacementController
from gateway.fleet.registry import Registry
from gateway.multiproc.group import FollowerPlacement, GroupModelControl, GroupStatistics
from gateway.multiproc.replicated import GroupLogSettings, GroupRegions, GroupTraceSettings, Replicator
from gateway.observability.trace_settings import TraceSettings
from gateway.settings import BatchingSettings, GatewayConfig


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
    gateway = build_gateway(config, cluster=cluster)
    assert isinstance(gateway, Gateway)
    assert gateway.cluster is cluster and gateway.parts.cluster is cluster
    assert gateway.router is gateway.parts.router
    assert gateway.fleet is gateway.parts.fleet and gateway.placement is gateway.fleet.placement
    assert isinstance(gateway.parts.batchers, Batchers)
    assert gateway.tracing is gateway.parts.tracing and type(gateway.tracing.settings) is TraceSettings
    assert isinstance(gateway.parts.statistics, LocalStatistics)
    assert isinstance(gateway.parts.control, LocalModelControl)


def test_a_placement_passed_in_is_the_one_used() -> None:
    made: list[PlacementController] = []

    def placement(config: GatewayConfig, cluster: Cluster, registry: Registry) -> PlacementController:
        made.append(build_placement(config, cluster, registry))
        return made[-1]

    gateway = build_gateway(GatewayConfig(), seams=Seams(placement=placement))
    assert len(made) == 1
    assert gateway.fleet.placement is made[0] and gateway.placement is made[0]
    assert made[0]._registry is gateway.fleet.registry  # built on the fleet's own registry


def test_a_followers_parts_arrive_through_the_seams() -> None:
    group = FakeGroup(index=1)
    composed = compose(GatewayConfig(), group)  # type: ignore[arg-type]
    gateway = composed.gateway
    assert type(gateway) is Gateway  # no subclass
    assert isinstance(gateway.fleet.placement, FollowerPlacement) and gateway.placement is gateway.fleet.placement
    assert isinstance(gateway.parts.statistics, GroupStatistics)
    assert isinstance(gateway.parts.control, GroupModelControl)
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
    policy = gateway.parts.batchers.policy("m", model, backend_batches=False)
    assert (policy.mode, policy.max_batch_size, policy.max_queue_size) == ("fixed", 8, 7)
