"""Tests for gateway/fleet/registry.py, gateway/fleet/discovery.py and gateway/fleet/membership.py:
registration, heartbeats and their expiry, the worker token, DNS discovery
with a fake resolver; against a real Cluster of in-process fakes (no sockets).
"""

from __future__ import annotations

import pytest

from gateway.fleet.cluster import Cluster, WorkerStatus
from gateway.fleet.discovery import DnsDiscovery
from gateway.fleet.manager import Fleet
from gateway.fleet.membership import Membership
from gateway.fleet.placement import PlacementController
from gateway.fleet.registry import Registry
from gateway.settings import AutoscaleSettings, PlacementSettings, WorkerSpec
from protos import cluster_pb2
from protos.errors import InvalidArgument, Unauthenticated
from tests.unit.gateway.fleet.test_placement import FakeClock, Fakes

A, B, C = "10.0.0.1:8001", "10.0.0.2:8001", "10.0.0.3:8001"


async def make_cluster(*static: str) -> tuple[Cluster, Membership]:
    specs = [WorkerSpec(a) for a in static]
    cluster = Cluster(specs, probe_interval_s=3600, client_factory=Fakes())  # type: ignore[arg-type]
    await cluster.start()
    return cluster, Membership(cluster, specs)


def register_request(address: str, worker_id: str = "w1") -> cluster_pb2.RegisterRequest:
    load = cluster_pb2.WorkerLoad(models=[cluster_pb2.ModelLoad(name="mlp", versions=["1"], memory_bytes=1234,
                                                                rows_per_s=5.0)])
    return cluster_pb2.RegisterRequest(
        address=address, worker_id=worker_id, backend="onnx", load=load,
        devices=[cluster_pb2.Device(kind="gpu", name="GPU", memory_total_bytes=80 << 30, memory_free_bytes=70 << 30),
                 cluster_pb2.Device(kind="host", name="host", memory_total_bytes=512 << 30)])


async def test_register_heartbeat_and_missed_heartbeats() -> None:
    clock = FakeClock()
    cluster, membership = await make_cluster()
    registry = Registry(membership, heartbeat_interval_s=1.0, misses_to_down=3, clock=clock)
    try:
        answer = await registry.register(register_request(A))
        assert answer.heartbeat_interval_s == 1.0
        worker = cluster.worker(A)
        assert worker is not None and worker.state is WorkerStatus.READY
        report = registry.report(A)
        assert report is not None and report.memory_total_bytes == 80 << 30  # the GPU's, not the host's
        assert report.models["mlp"].memory_bytes == 1234

        beat = cluster_pb2.HeartbeatRequest(address=A, worker_id="w1", load=cluster_pb2.WorkerLoad(inflight=3))
        clock.now += 2.5
        assert registry.heartbeat(beat).known
        assert registry.report(A).inflight == 3  # type: ignore[union-attr]
        # A worker id the registry does not know: register again.
        assert not registry.heartbeat(cluster_pb2.HeartbeatRequest(address=A, worker_id="other")).known

        clock.now += 2.9
        assert await registry.expire() == []
        clock.now += 0.2
        assert await registry.expire() == [A]
        assert cluster.worker(A) is None and registry.report(A) is None
        assert not registry.heartbeat(beat).known
    finally:
        await cluster.stop()


async def test_deregister_and_static_workers() -> None:
    clock = FakeClock()
    cluster, membership = await make_cluster(B)
    registry = Registry(membership, heartbeat_interval_s=1.0, misses_to_down=2, clock=clock)
    try:
        await registry.register(register_request(A, "a"))
        await registry.register(register_request(B, "b"))
        assert (await registry.deregister(cluster_pb2.DeregisterRequest(address=A, worker_id="a"))).known
        assert cluster.worker(A) is None
        # A static worker that also registers stays in the cluster when its heartbeats stop, marked down.
        clock.now += 10
        assert await registry.expire() == [B]
        worker = cluster.worker(B)
        assert worker is not None and worker.state is WorkerStatus.DOWN
    finally:
        await cluster.stop()


async def test_a_restarted_worker_is_a_fresh_member() -> None:
    cluster, membership = await make_cluster()
    registry = Registry(membership)
    try:
        await registry.register(register_request(A, "first"))
        cluster.set_draining(A, True)
        await registry.register(register_request(A, "second"))
        assert cluster.worker(A).state is WorkerStatus.READY  # type: ignore[union-attr]
        assert registry.report(A).worker_id == "second"  # type: ignore[union-attr]
    finally:
        await cluster.stop()


async def test_token_and_bad_requests() -> None:
    cluster, membership = await make_cluster()
    registry = Registry(membership, token="s3cret")
    try:
        with pytest.raises(Unauthenticated):
            registry.check_token([("authorization", "Bearer wrong")])
        with pytest.raises(Unauthenticated):
            registry.check_token([])
        registry.check_token([("authorization", "Bearer s3cret")])
        Registry(membership).check_token([])  # no token configured: open
        with pytest.raises(InvalidArgument):
            await registry.register(register_request("no-port"))
        assert cluster.workers() == []
    finally:
        await cluster.stop()


def placement(cluster: Cluster, registry: Registry) -> PlacementController:
    return PlacementController(cluster, registry, settings=PlacementSettings(), autoscale=AutoscaleSettings(), models={})


async def test_the_fleet_checks_registrations_against_the_token_it_is_given() -> None:
    cluster, _ = await make_cluster()
    try:
        fleet = Fleet(cluster, placement, token="s3cret")
        with pytest.raises(Unauthenticated):
            fleet.registry.check_token([("authorization", "Bearer wrong")])
        fleet.registry.check_token([("authorization", "Bearer s3cret")])
        Fleet(cluster, placement).registry.check_token([])  # none given: open
        # The placement is made by the factory given, on this fleet's cluster and registry.
        assert fleet.placement._cluster is cluster and fleet.placement._registry is fleet.registry
    finally:
        await cluster.stop()


class FakeDns:
    def __init__(self) -> None:
        self.answers: dict[str, list[str] | OSError] = {}

    async def __call__(self, host: str, port: int) -> list[str]:
        answer = self.answers[host]
        if isinstance(answer, OSError):
            raise answer
        return [f"{ip}:{port}" for ip in answer]


async def test_dns_discovery_follows_the_name() -> None:
    cluster, membership = await make_cluster(C)
    dns = FakeDns()
    dns.answers["workers.svc"] = ["10.0.0.1", "10.0.0.3"]
    discovery = DnsDiscovery(membership, ["workers.svc:8001"], resolver=dns)
    try:
        await discovery.start()
        assert {w.address for w in cluster.workers()} == {A, C}
        dns.answers["workers.svc"] = ["10.0.0.2"]
        await discovery.refresh()
        # A left; C stays (the static list names it too); B joined.
        assert {w.address for w in cluster.workers()} == {B, C}
        dns.answers["workers.svc"] = OSError("temporary failure in name resolution")
        await discovery.refresh()
        assert {w.address for w in cluster.workers()} == {B, C}  # a failed lookup changes nothing
        assert discovery.addresses() == {"workers.svc:8001": [B]}
    finally:
        await discovery.stop()
        await cluster.stop()


async def test_triton_dns_names_make_triton_workers() -> None:
    cluster, membership = await make_cluster()
    dns = FakeDns()
    dns.answers["triton.svc"] = ["10.0.0.1"]
    discovery = DnsDiscovery(membership, ["triton://triton.svc:8001"], resolver=dns)
    try:
        await discovery.refresh()
        (worker,) = cluster.workers()
        assert worker.address == A and worker.kind == "triton"
    finally:
        await cluster.stop()


async def test_a_relayed_worker_is_dropped_by_the_process_it_talks_to_then_by_the_others() -> None:
    clock = FakeClock()
    cluster, membership = await make_cluster()
    registry = Registry(membership, heartbeat_interval_s=1.0, misses_to_down=3, clock=clock)
    told: list[tuple[str, str]] = []

    async def expired(address: str, worker_id: str) -> None:
        told.append((address, worker_id))

    registry.on_expired = expired
    try:
        await registry.register(register_request(A, "a"), relayed=True)  # another process took the call
        await registry.register(register_request(B, "b"))  # this one did
        clock.now += 3.5  # both past one window of 3 heartbeats
        assert await registry.expire() == [B]  # its own verdict, passed on to the others
        assert told == [(B, "b")] and cluster.worker(A) is not None
        beat = cluster_pb2.HeartbeatRequest(address=A, worker_id="a")
        assert registry.heartbeat(beat, relayed=True).known
        clock.now += 14.0  # under five windows since the relayed heartbeat: the other process decides
        assert await registry.expire() == []
        assert (await registry.deregister(cluster_pb2.DeregisterRequest(address=A, worker_id="a"))).known
        assert cluster.worker(A) is None
        # A relayed worker whose process went away too is dropped here after five windows, not passed on.
        await registry.register(register_request(C, "c"), relayed=True)
        clock.now += 15.1
        assert await registry.expire() == [C] and told == [(B, "b")]
    finally:
        await cluster.stop()
