"""Tests for gateway/fleet/placement.py and gateway/fleet/demand.py: rendezvous placement
(determinism, minimal movement, memory), the demand book (idle TTL,
autoscaling with hysteresis), and the controller and drain procedure against
a real Cluster of in-process fake workers (no sockets).
"""

from __future__ import annotations

import random
from dataclasses import replace
from types import SimpleNamespace

import pytest
from tritonclient.grpc import model_config_pb2, service_pb2

from gateway.fleet.cluster import Cluster, WorkerStatus
from gateway.fleet.demand import AutoscalePolicy, DemandBook, Observed
from gateway.fleet.drain import drain_worker
from gateway.fleet.placement import PlacementController
from gateway.fleet.rendezvous import Bin, Demand, plan, rendezvous_order
from gateway.settings import GatewayConfig, PlacementSettings, WorkerSpec
from protos.errors import InvalidArgument, ModelNotFound, Unavailable


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ---- rendezvous and plan ----------------------------------------------------------


def addresses(n: int) -> list[str]:
    return [f"10.0.0.{i}:8001" for i in range(1, n + 1)]


def test_rendezvous_order_is_a_function_of_names_only() -> None:
    workers = addresses(6)
    shuffled = workers[:]
    random.Random(3).shuffle(shuffled)
    assert rendezvous_order("mlp", workers) == rendezvous_order("mlp", shuffled)
    assert sorted(rendezvous_order("mlp", workers)) == sorted(workers)
    # Different models prefer different workers (else everything lands on one).
    firsts = {rendezvous_order(f"model{i}", workers)[0] for i in range(40)}
    assert len(firsts) >= 4


def test_adding_a_worker_moves_only_replicas_to_it() -> None:
    before_workers, after_workers = addresses(4), addresses(5)
    demands = [Demand(f"model{i}", 2) for i in range(300)]
    before = plan(demands, [Bin(a) for a in before_workers])
    after = plan(demands, [Bin(a) for a in after_workers])
    new = after_workers[-1]
    moved = 0
    for d in demands:
        gained = set(after[d.name]) - set(before[d.name])
        assert gained <= {new}, f"{d.name} moved to an old worker: {before[d.name]} -> {after[d.name]}"
        moved += len(gained)
    # The new worker takes about its share (2/5 of the models have it in their top 2): not all, not none.
    assert 0.25 * len(demands) < moved < 0.55 * len(demands)


def test_removing_a_worker_moves_only_its_replicas() -> None:
    workers = addresses(5)
    gone = workers[2]
    demands = [Demand(f"model{i}", 2) for i in range(300)]
    before = plan(demands, [Bin(a) for a in workers])
    after = plan(demands, [Bin(a) for a in workers if a != gone])
    for d in demands:
        if gone not in before[d.name]:
            assert after[d.name] == before[d.name]
        else:
            kept = set(before[d.name]) - {gone}
            assert kept <= set(after[d.name]) and gone not in after[d.name] and len(after[d.name]) == 2


def test_plan_respects_memory_and_packs_several_models_per_worker() -> None:
    bins = [Bin("a:1", capacity_bytes=100), Bin("b:1", capacity_bytes=100, reserved_bytes=60)]
    demands = [Demand("m1", 1, 50), Demand("m2", 1, 50), Demand("m3", 1, 40), Demand("m4", 1, 30)]
    targets = plan(demands, bins)
    used = {b.address: b.reserved_bytes for b in bins}
    for d in demands:
        for a in targets[d.name]:
            used[a] += d.memory_bytes
    assert all(used[b.address] <= b.capacity_bytes for b in bins)  # type: ignore[operator]
    assert sum(len(t) for t in targets.values()) == 3  # 50 + 50 on a, 40 on b; m4 (30) fits nowhere
    assert targets["m4"] == ()
    assert targets["m1"] == ("a:1",) and targets["m2"] == ("a:1",)


def test_plan_gives_room_to_the_earlier_demands_first() -> None:
    bins = [Bin("a:1", capacity_bytes=100)]
    old_first = plan([Demand("old", 1, 60), Demand("new", 1, 60)], bins)
    new_first = plan([Demand("new", 1, 60), Demand("old", 1, 60)], bins)
    assert old_first == {"old": ("a:1",), "new": ()}
    assert new_first == {"new": ("a:1",), "old": ()}


def test_plan_skips_refused_pairs_and_replicas_never_share_a_worker() -> None:
    workers = addresses(3)
    first = rendezvous_order("mlp", workers)[0]
    targets = plan([Demand("mlp", 3)], [Bin(a) for a in workers], refused={("mlp", first)})
    assert first not in targets["mlp"] and len(targets["mlp"]) == 2
    assert plan([Demand("mlp", 5)], [Bin(a) for a in workers])["mlp"] == tuple(rendezvous_order("mlp", workers))


# ---- the demand book ------------------------------------------------------------------


def test_idle_ttl_deactivates_and_a_request_brings_the_model_back() -> None:
    clock = FakeClock()
    book = DemandBook(AutoscalePolicy(), idle_ttl_s=10.0, clock=clock)
    book.declare("mlp", 2)
    clock.now += 9
    book.touch("mlp")
    clock.now += 9
    assert book.tick({}, workers=3) == []
    clock.now += 2
    assert book.tick({}, workers=3) == [("mlp", "idle")]
    demand = book.get("mlp")
    assert demand is not None and not demand.active and demand.reason == "idle"
    book.activate("mlp")
    assert demand.active and demand.replicas == 2


def test_worker_reported_use_keeps_a_model_alive() -> None:
    clock = FakeClock()
    book = DemandBook(AutoscalePolicy(), idle_ttl_s=10.0, clock=clock)
    book.activate("mlp")
    clock.now += 15
    # Another gateway's traffic, seen in a worker's heartbeat 1 s ago.
    assert book.tick({"mlp": Observed(last_used=clock.now - 1)}, workers=1) == []
    assert book.get("mlp").active  # type: ignore[union-attr]


def test_autoscaling_has_hysteresis_and_a_cooldown() -> None:
    clock = FakeClock()
    book = DemandBook(AutoscalePolicy(up_rate=100, down_rate=40, cooldown_s=5), clock=clock)
    demand = book.activate("mlp")
    book.tick({}, workers=4)

    def at(rate: float, seconds: float = 1.0) -> list[tuple[str, str]]:
        clock.now += seconds
        return book.tick({"mlp": Observed(rows_per_s=rate)}, workers=4)

    assert at(150) == [("mlp", "up")] and demand.replicas == 2
    assert at(250) == [] and demand.replicas == 2  # cooling down
    assert at(250, 5) == [("mlp", "up")] and demand.replicas == 3
    # 90/s is under the up threshold for 3 replicas but not under down_rate * 2 = 80: stays.
    assert at(90, 10) == [] and demand.replicas == 3
    assert at(70, 10) == [("mlp", "down")] and demand.replicas == 2
    assert at(30, 10) == [("mlp", "down")] and demand.replicas == 1
    assert at(0, 10) == [] and demand.replicas == 1  # never below the floor
    for _ in range(5):
        at(10_000, 10)
    assert demand.replicas == 4  # never above the number of workers


def test_local_requests_count_towards_the_rate() -> None:
    clock = FakeClock()
    book = DemandBook(AutoscalePolicy(up_rate=10, cooldown_s=0, window_s=1), clock=clock)
    demand = book.activate("mlp")
    book.tick({}, workers=2)
    for _ in range(10):
        for _ in range(50):
            book.touch("mlp")
        clock.now += 1
        book.tick({}, workers=2)
    assert demand.rate > 40 and demand.replicas == 2


# ---- the controller against a real Cluster of fakes --------------------------------------


class FakeWorker:
    """A worker client whose repository holds every model but ``MISSING``, loading and unloading on request."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.address = spec.address
        self.kind = spec.kind
        self.loaded: set[str] = set()
        self.calls: list[tuple[str, str]] = []
        self.refuse: dict[str, Exception] = {}

    async def data_lane_ready(self, timeout_s: float) -> None:
        """Fakes are connected whenever they answer."""

    async def server_ready(self, timeout_s: float | None = None) -> bool:
        return True

    async def server_live(self, timeout_s: float | None = None) -> bool:
        return True

    async def model_statistics(self, name: str = "", version: str = "", timeout_s: float | None = None
                               ) -> service_pb2.ModelStatisticsResponse:
        return service_pb2.ModelStatisticsResponse()

    async def repository_index(self, ready: bool = False, timeout_s: float | None = None
                               ) -> list[service_pb2.RepositoryIndexResponse.ModelIndex]:
        return [service_pb2.RepositoryIndexResponse.ModelIndex(name=n, version="1", state="READY")
                for n in sorted(self.loaded)]

    async def model_config(self, name: str, version: str = "", timeout_s: float | None = None
                           ) -> model_config_pb2.ModelConfig:
        return model_config_pb2.ModelConfig(name=name, max_batch_size=8)

    async def model_metadata(self, name: str, version: str = "", timeout_s: float | None = None
                             ) -> service_pb2.ModelMetadataResponse:
        return service_pb2.ModelMetadataResponse(name=name, versions=["1"])

    async def load(self, name: str, parameters: object = None, timeout_s: float | None = None) -> None:
        self.calls.append(("load", name))
        if name in self.refuse:
            raise self.refuse[name]
        if name in MISSING:
            raise ModelNotFound(f"failed to load '{name}', failed to poll from model repository")
        self.loaded.add(name)

    async def unload(self, name: str, parameters: object = None, timeout_s: float | None = None) -> None:
        self.calls.append(("unload", name))
        self.loaded.discard(name)

    async def close(self, grace_s: float | None = None) -> None:
        pass


MISSING = {"nonexistent", "private"}


class Fakes:
    def __init__(self) -> None:
        self.by_address: dict[str, FakeWorker] = {}

    def __call__(self, spec: WorkerSpec) -> FakeWorker:
        fake = self.by_address[spec.address] = FakeWorker(spec)
        return fake


async def make(config: GatewayConfig, n: int, clock: FakeClock | None = None
               ) -> tuple[Cluster, PlacementController, Fakes]:
    fakes = Fakes()
    cluster = Cluster([WorkerSpec(a) for a in addresses(n)], probe_interval_s=3600, client_factory=fakes)  # type: ignore[arg-type]
    await cluster.start()
    controller = PlacementController(cluster, None, settings=replace(config.placement, interval_s=3600),
                                     autoscale=config.autoscale, models=config.models,
                                     model_repository=config.model_repository,
                                     **({"clock": clock} if clock else {}))
    await controller.start()
    return cluster, controller, fakes


def hosts(fakes: Fakes, name: str) -> set[str]:
    return {a for a, f in fakes.by_address.items() if name in f.loaded}


async def close(cluster: Cluster, controller: PlacementController) -> None:
    await controller.stop()
    await cluster.stop()


async def test_declared_replicas_follow_rendezvous_and_move_minimally() -> None:
    config = GatewayConfig(models={"mlp": {"replicas": 2}, "cnn": {"replicas": 1}})
    cluster, controller, fakes = await make(config, 4)
    try:
        expected = rendezvous_order("mlp", addresses(4))[:2]
        assert hosts(fakes, "mlp") == set(expected)
        assert hosts(fakes, "cnn") == {rendezvous_order("cnn", addresses(4))[0]}
        assert controller.moves == 0
        assert cluster.model("mlp") is not None and len(cluster.model("mlp").replicas) == 2  # type: ignore[union-attr]

        lost = expected[0]
        await cluster.remove_worker(lost)
        await controller.wait_round(5)
        left = [a for a in addresses(4) if a != lost]
        assert hosts(fakes, "mlp") - {lost} == set(rendezvous_order("mlp", left)[:2])
        assert expected[1] in hosts(fakes, "mlp")  # the surviving replica stayed
        assert controller.moves == 1
    finally:
        await close(cluster, controller)


async def test_load_on_demand_and_unknown_models() -> None:
    cluster, controller, fakes = await make(GatewayConfig(placement=PlacementSettings(load_on_demand=True)), 3)
    try:
        assert controller.can_load("encoder")
        await controller.ensure("encoder", 5)
        assert len(hosts(fakes, "encoder")) == 1 and cluster.model("encoder") is not None
        with pytest.raises(ModelNotFound):
            await controller.ensure("nonexistent", 5)
        assert not controller.can_load("nonexistent")  # remembered for a while: no load storm
    finally:
        await close(cluster, controller)


async def test_a_broken_model_fails_its_request_and_is_not_retried_at_once() -> None:
    cluster, controller, fakes = await make(GatewayConfig(placement=PlacementSettings(load_on_demand=True)), 2)
    try:
        for fake in fakes.by_address.values():
            fake.refuse["cnn"] = InvalidArgument("load failed for model 'cnn': bad graph")
        def attempts() -> list[int]:
            return [f.calls.count(("load", "cnn")) for f in fakes.by_address.values()]

        with pytest.raises(Unavailable):
            await controller.ensure("cnn", 5)
        assert sorted(attempts()) == [0, 1]
        await controller.wait_round(5)
        assert sorted(attempts()) == [0, 1]  # no request, no retry
        with pytest.raises(Unavailable):
            await controller.ensure("cnn", 5)
        assert attempts() == [1, 1]  # the next request tried the other worker
    finally:
        await close(cluster, controller)


async def test_lru_eviction_under_a_memory_cap() -> None:
    clock = FakeClock()
    config = GatewayConfig(placement=PlacementSettings(load_on_demand=True, worker_memory_cap_bytes=250),
                           models={n: {"memory_bytes": 100} for n in ("mlp", "cnn", "encoder")})
    cluster, controller, fakes = await make(config, 1, clock)
    try:
        for name in ("mlp", "cnn"):
            clock.now += 1
            await controller.ensure(name, 5)
            controller.touch(name)
        clock.now += 1
        controller.touch("mlp")  # mlp is now more recent than cnn
        clock.now += 1
        await controller.ensure("encoder", 5)
        (worker,) = fakes.by_address.values()
        assert worker.loaded == {"mlp", "encoder"}
        assert controller.evictions == 1
        # The evicted one was unloaded before the new one was loaded (memory first).
        assert worker.calls.index(("unload", "cnn")) < worker.calls.index(("load", "encoder"))
    finally:
        await close(cluster, controller)


async def test_idle_models_are_unloaded_after_their_ttl() -> None:
    clock = FakeClock()
    config = GatewayConfig(placement=PlacementSettings(load_on_demand=True, idle_ttl_s=30),
                           models={"cnn": {"idle_ttl_s": 0}})
    cluster, controller, fakes = await make(config, 2, clock)
    try:
        await controller.ensure("mlp", 5)
        await controller.ensure("cnn", 5)
        clock.now += 20
        controller.touch("mlp")
        clock.now += 20
        await controller.wait_round(5)
        assert hosts(fakes, "mlp") and hosts(fakes, "cnn")
        clock.now += 11
        await controller.wait_round(5)
        assert not hosts(fakes, "mlp") and cluster.model("mlp") is None
        assert hosts(fakes, "cnn")  # its own TTL (0) turns the idle unload off
        assert controller.idle_unloads == 1
    finally:
        await close(cluster, controller)


async def test_drain_moves_every_model_before_the_worker_stops_taking_work() -> None:
    cluster, controller, fakes = await make(GatewayConfig(), 2)
    try:
        drained, other = addresses(2)
        # A model loaded outside placement, on the drained worker only.
        fakes.by_address[drained].loaded.add("simple")
        await cluster.refresh()
        gateway = SimpleNamespace(cluster=cluster, placement=controller,
                                  sequences=SimpleNamespace(open_on=lambda address: 0))
        status, body = await drain_worker(gateway, drained, timeout_s=10)  # type: ignore[arg-type]
        assert status == 200 and body["state"] == "drained" and body["moved"] == ["simple"]
        assert "simple" in fakes.by_address[other].loaded
        assert cluster.worker(drained).state is WorkerStatus.DRAINING  # type: ignore[union-attr]
        assert [w.address for w in cluster.healthy("simple")] == [other]
        assert ("unload", "simple") not in fakes.by_address[drained].calls  # in-flight work there finishes
    finally:
        await close(cluster, controller)


async def test_drain_is_undone_when_a_model_has_nowhere_to_go() -> None:
    cluster, controller, fakes = await make(GatewayConfig(), 2)
    try:
        drained = addresses(2)[0]
        fakes.by_address[drained].loaded.add("private")  # in no other worker's repository
        await cluster.refresh()
        gateway = SimpleNamespace(cluster=cluster, placement=controller,
                                  sequences=SimpleNamespace(open_on=lambda address: 0))
        status, body = await drain_worker(gateway, drained, timeout_s=1)  # type: ignore[arg-type]
        assert status == 409 and body["stranded"] == ["private"]
        assert cluster.worker(drained).state is WorkerStatus.READY  # type: ignore[union-attr]
        assert drained not in controller.excluded
        status, body = await drain_worker(gateway, drained, timeout_s=1, force=True)  # type: ignore[arg-type]
        assert status == 200 and body["stranded"] == ["private"]
        assert cluster.worker(drained).state is WorkerStatus.DRAINING  # type: ignore[union-attr]
    finally:
        await close(cluster, controller)


async def test_two_controllers_on_the_same_workers_agree() -> None:
    config = GatewayConfig(models={f"m{i}": {"replicas": 1 + i % 3} for i in range(12)})
    first = await make(config, 5)
    second = await make(config, 5)
    try:
        assert first[1].targets == second[1].targets
        assert len(first[1].targets) == 12
    finally:
        await close(first[0], first[1])
        await close(second[0], second[1])
