"""Tests for gateway/fleet/cluster.py: probing, health transitions, the model map,
membership changes. Workers are in-process fakes of WorkerClient (no sockets).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import pytest
from tritonclient.grpc import model_config_pb2, service_pb2

from gateway.fleet.cluster import Cluster, WorkerStatus
from gateway.replicas.errors import WorkerUnreachable
from gateway.settings import WorkerSpec
from protos.errors import InferGateError, ModelNotFound


class FakeWorker:
    """Stands in for WorkerClient: serves ``models`` (name -> versions) and scripted infer results.

    ``reachable=False`` makes every call fail as a dead worker would; ``hang``
    makes ServerReady never answer; ``infer_results`` is consumed one per
    ModelInfer (an exception is raised, anything else ignored) and
    ``hold`` (when set) keeps every ModelInfer pending until it is released.
    """

    def __init__(self, spec: WorkerSpec, models: dict[str, list[str]] | None = None) -> None:
        self.address = spec.address
        self.kind = spec.kind
        self.models = {"m": ["1"]} if models is None else models
        self.reachable = True
        self.ready = True
        self.hang = False
        self.ready_calls = 0
        self.config_errors: dict[str, InferGateError] = {}
        self.config_calls = 0
        self.infer_results: list[BaseException | None] = []
        self.infer_calls: list[tuple[service_pb2.ModelInferRequest, float | None]] = []
        self.hold: asyncio.Event | None = None
        self.closed = False

    def _check(self) -> None:
        if not self.reachable:
            raise WorkerUnreachable(f"worker {self.address} unreachable: connection refused")

    async def data_lane_ready(self, timeout_s: float) -> None:
        """Fakes are connected whenever they answer."""

    async def server_ready(self, timeout_s: float | None = None) -> bool:
        self.ready_calls += 1
        if self.hang:
            await asyncio.Event().wait()
        self._check()
        return self.ready

    async def repository_index(
        self, ready: bool = False, timeout_s: float | None = None
    ) -> list[service_pb2.RepositoryIndexResponse.ModelIndex]:
        self._check()
        return [
            service_pb2.RepositoryIndexResponse.ModelIndex(name=name, version=v, state="READY")
            for name, versions in self.models.items()
            for v in versions
        ]

    async def model_config(self, name: str, version: str = "", timeout_s: float | None = None) -> model_config_pb2.ModelConfig:
        self._check()
        self.config_calls += 1
        if name in self.config_errors:
            raise self.config_errors[name]
        return model_config_pb2.ModelConfig(name=name, max_batch_size=8)

    async def model_metadata(
        self, name: str, version: str = "", timeout_s: float | None = None
    ) -> service_pb2.ModelMetadataResponse:
        self._check()
        return service_pb2.ModelMetadataResponse(name=name, versions=self.models[name], platform="fake")

    async def infer(
        self, request: service_pb2.ModelInferRequest, timeout_s: float | None = None
    ) -> service_pb2.ModelInferResponse:
        self.infer_calls.append((request, timeout_s))
        self._check()
        if self.infer_results:
            result = self.infer_results.pop(0)
            if result is not None:
                raise result
        if self.hold is not None:
            await self.hold.wait()
        return service_pb2.ModelInferResponse(model_name=request.model_name, id=self.address)

    async def close(self, grace_s: float | None = None) -> None:
        self.closed = True


class FakeFleet:
    """Creates a FakeWorker per spec (the cluster's client_factory) and keeps them by address."""

    def __init__(self, models: dict[str, dict[str, list[str]]] | None = None) -> None:
        self.models = models or {}
        self.unreachable: set[str] = set()  # addresses whose fakes start unreachable
        self.by_address: dict[str, FakeWorker] = {}

    def __call__(self, spec: WorkerSpec) -> FakeWorker:
        fake = FakeWorker(spec, self.models.get(spec.address))
        fake.reachable = spec.address not in self.unreachable
        self.by_address[spec.address] = fake
        return fake

    def __getitem__(self, address: str) -> FakeWorker:
        return self.by_address[address]


def specs(*addresses: str) -> list[WorkerSpec]:
    return [WorkerSpec(a) for a in addresses]


def make_cluster(fleet: FakeFleet, *addresses: str, **kwargs: object) -> Cluster:
    kwargs.setdefault("probe_interval_s", 3600.0)  # tests probe explicitly through refresh()
    kwargs.setdefault("failures_to_down", 2)
    return Cluster(specs(*addresses), client_factory=fleet, **kwargs)  # type: ignore[arg-type]


async def wait_for(condition: Callable[[], bool], changed: asyncio.Event, timeout_s: float = 10.0) -> None:
    """Wait until ``condition()`` holds, re-checking whenever the cluster reports a change."""

    async def loop() -> None:
        while not condition():
            changed.clear()
            await changed.wait()

    await asyncio.wait_for(loop(), timeout_s)


async def test_start_discovers_models_of_all_workers() -> None:
    fleet = FakeFleet({"w1:1": {"a": ["1"], "b": ["1", "2"]}, "w2:1": {"b": ["2"]}})
    cluster = make_cluster(fleet, "w1:1", "w2:1")
    await cluster.start()
    try:
        w1, w2 = cluster.workers()
        assert w1.state is WorkerStatus.READY and w2.state is WorkerStatus.READY
        models = cluster.models()
        assert sorted(models) == ["a", "b"]
        assert models["a"].replicas == (w1,)
        assert models["b"].replicas == (w1, w2)
        assert models["b"].versions == ("1", "2")
        assert models["b"].config.max_batch_size == 8
        assert models["b"].metadata.platform == "fake"
        assert list(cluster.healthy("b", "1")) == [w1]
        assert list(cluster.healthy("b", "2")) == [w1, w2]
        assert list(cluster.healthy("b")) == [w1, w2]
        assert list(cluster.healthy("nope")) == []
    finally:
        await cluster.stop()
    assert fleet["w1:1"].closed and fleet["w2:1"].closed


async def test_down_after_n_failed_probes_and_up_on_recovery() -> None:
    fleet = FakeFleet()
    cluster = make_cluster(fleet, "w1:1", "w2:1", failures_to_down=3)
    changes: list[set[str]] = []
    cluster.on_change(lambda: changes.append({w.address for w in cluster.healthy("m")}))
    await cluster.start()
    try:
        w1 = cluster.worker("w1:1")
        assert w1 is not None
        assert changes[-1] == {"w1:1", "w2:1"}
        changes.clear()
        fleet["w1:1"].reachable = False
        for expected_failures in (1, 2):
            await cluster.refresh()
            assert w1.state is WorkerStatus.READY
            assert w1.consecutive_failures == expected_failures
        assert changes == []
        await cluster.refresh()
        assert w1.state is WorkerStatus.DOWN
        assert "connection refused" in w1.last_error
        assert [w.address for w in cluster.model("m").replicas] == ["w2:1"]
        assert changes == [{"w2:1"}]

        fleet["w1:1"].reachable = True
        await cluster.refresh()
        assert w1.state is WorkerStatus.READY and w1.consecutive_failures == 0
        assert changes[-1] == {"w1:1", "w2:1"}
    finally:
        await cluster.stop()


async def test_model_disappears_when_its_only_worker_goes_down() -> None:
    fleet = FakeFleet({"w1:1": {"only": ["1"]}, "w2:1": {"m": ["1"]}})
    cluster = make_cluster(fleet, "w1:1", "w2:1", failures_to_down=1)
    await cluster.start()
    try:
        assert "only" in cluster.models()
        fleet["w1:1"].reachable = False
        await cluster.refresh("w1:1")
        assert "only" not in cluster.models()
        # Still known (last report of a DOWN worker): callers can answer "unavailable", not "not found".
        assert "only" in cluster.known_models()
    finally:
        await cluster.stop()


async def test_periodic_probe_marks_down_and_up() -> None:
    fleet = FakeFleet()
    cluster = make_cluster(fleet, "w1:1", probe_interval_s=0.01, failures_to_down=2)
    changed = asyncio.Event()
    cluster.on_change(changed.set)
    await cluster.start()
    try:
        w1 = cluster.workers()[0]
        assert w1.state is WorkerStatus.READY
        fleet["w1:1"].reachable = False
        await wait_for(lambda: w1.state is WorkerStatus.DOWN, changed)
        assert cluster.models() == {}
        fleet["w1:1"].reachable = True
        await wait_for(lambda: w1.state is WorkerStatus.READY, changed)
        assert "m" in cluster.models()
    finally:
        await cluster.stop()


async def test_probe_failures_logged_once_per_transition(caplog: pytest.LogCaptureFixture) -> None:
    fleet = FakeFleet()
    cluster = make_cluster(fleet, "w1:1", failures_to_down=2)
    await cluster.start()
    try:
        fleet["w1:1"].reachable = False
        with caplog.at_level(logging.INFO, logger="gateway.fleet.cluster"):
            for _ in range(8):
                await cluster.refresh()
            fleet["w1:1"].reachable = True
            await cluster.refresh()
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        assert "marked DOWN" in warnings[0].getMessage()
        assert any("is READY" in r.getMessage() for r in caplog.records)
        assert len(caplog.records) == 3  # first failure (info), down (warning), back up (info)
    finally:
        await cluster.stop()


async def test_unreachable_from_the_start_is_down_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    fleet = FakeFleet()
    fleet.unreachable.add("dead:1")
    cluster = make_cluster(fleet, "w1:1", "dead:1")
    with caplog.at_level(logging.INFO, logger="gateway.fleet.cluster"):
        await cluster.start()
        for _ in range(3):
            await cluster.refresh()
    try:
        assert cluster.worker("dead:1").state is WorkerStatus.DOWN
        assert cluster.worker("w1:1").state is WorkerStatus.READY
        about_dead = [r for r in caplog.records if "dead:1" in r.getMessage() and r.levelno >= logging.WARNING]
        assert len(about_dead) == 1
    finally:
        await cluster.stop()


async def test_start_returns_within_timeout_when_a_worker_hangs() -> None:
    fleet = FakeFleet()
    cluster = make_cluster(fleet, "w1:1", "w2:1", probe_timeout_s=60.0, start_timeout_s=0.2)
    fleet["w1:1"].hang = True
    await asyncio.wait_for(cluster.start(), 30.0)
    try:
        assert cluster.worker("w1:1").state is WorkerStatus.DOWN
        assert cluster.worker("w2:1").state is WorkerStatus.READY
    finally:
        await cluster.stop()


async def test_probe_timeout_counts_as_failure() -> None:
    fleet = FakeFleet()
    cluster = make_cluster(fleet, "w1:1", failures_to_down=1, probe_timeout_s=0.05)
    await cluster.start()
    try:
        fleet["w1:1"].hang = True
        await cluster.refresh()
        assert cluster.worker("w1:1").state is WorkerStatus.DOWN
    finally:
        await cluster.stop()


async def test_a_hanging_probe_holds_up_neither_the_others_nor_the_next_rounds() -> None:
    # An unreachable worker's probe waits out probe_timeout_s; the rest of the fleet is probed meanwhile.
    fleet = FakeFleet()
    cluster = make_cluster(fleet, "w1:1", "w2:1", probe_interval_s=0.01, probe_timeout_s=3600.0)
    await cluster.start()
    try:
        fleet["w1:1"].hang = True
        hung, healthy = fleet["w1:1"].ready_calls, fleet["w2:1"].ready_calls

        async def probed() -> None:
            while fleet["w1:1"].ready_calls == hung or fleet["w2:1"].ready_calls < healthy + 5:
                await asyncio.sleep(0.01)  # polling a condition

        await asyncio.wait_for(probed(), 10.0)
        assert fleet["w1:1"].ready_calls == hung + 1  # one probe of it at a time, no pile-up
    finally:
        await asyncio.wait_for(cluster.stop(), 10.0)  # the hanging probe is cancelled with the loop


async def test_server_not_ready_counts_as_failure() -> None:
    fleet = FakeFleet()
    cluster = make_cluster(fleet, "w1:1", failures_to_down=1)
    await cluster.start()
    try:
        fleet["w1:1"].ready = False
        await cluster.refresh()
        assert cluster.worker("w1:1").state is WorkerStatus.DOWN
        assert "not ready" in cluster.worker("w1:1").last_error
    finally:
        await cluster.stop()


async def test_unreadable_model_is_skipped_not_the_worker() -> None:
    fleet = FakeFleet({"w1:1": {"good": ["1"], "bad": ["1"]}})
    cluster = make_cluster(fleet, "w1:1")
    fleet["w1:1"].config_errors["bad"] = ModelNotFound("unloaded meanwhile")
    await cluster.start()
    try:
        assert cluster.worker("w1:1").state is WorkerStatus.READY
        assert sorted(cluster.models()) == ["good"]
    finally:
        await cluster.stop()


async def test_details_reread_only_when_index_changes_or_forced() -> None:
    fleet = FakeFleet({"w1:1": {"a": ["1"]}})
    cluster = make_cluster(fleet, "w1:1")
    await cluster.start()
    try:
        fake, worker = fleet["w1:1"], cluster.workers()[0]
        assert fake.config_calls == 1
        await cluster._probe(worker, force=False)
        assert fake.config_calls == 1
        fake.models["b"] = ["1"]
        await cluster._probe(worker, force=False)
        assert fake.config_calls == 3  # a and b re-read
        assert sorted(cluster.models()) == ["a", "b"]
        await cluster.refresh()
        assert fake.config_calls == 5
    finally:
        await cluster.stop()


async def test_add_and_remove_worker_at_runtime() -> None:
    fleet = FakeFleet({"w2:1": {"m": ["1"], "extra": ["3"]}})
    cluster = make_cluster(fleet, "w1:1")
    changes = []
    cluster.on_change(lambda: changes.append(sorted(cluster.models())))
    await cluster.start()
    try:
        added = await cluster.add_worker(WorkerSpec("w2:1"))
        assert added.state is WorkerStatus.READY
        assert await cluster.add_worker(WorkerSpec("w2:1")) is added
        assert cluster.models()["extra"].versions == ("3",)
        assert len(cluster.healthy("m")) == 2
        assert changes[-1] == ["extra", "m"]

        assert await cluster.remove_worker("w2:1")
        assert not await cluster.remove_worker("w2:1")
        assert fleet["w2:1"].closed
        assert sorted(cluster.models()) == ["m"]
        assert [w.address for w in cluster.workers()] == ["w1:1"]
        assert changes[-1] == ["m"]
    finally:
        await cluster.stop()


async def test_mark_down_is_immediate_and_probe_brings_back() -> None:
    fleet = FakeFleet()
    cluster = make_cluster(fleet, "w1:1", failures_to_down=5)
    notified: list[WorkerStatus] = []
    await cluster.start()
    cluster.on_change(lambda: notified.append(cluster.worker("w1:1").state))
    try:
        worker = cluster.worker("w1:1")
        cluster.mark_down(worker, "connection reset")
        assert worker.state is WorkerStatus.DOWN and cluster.healthy("m") == ()
        cluster.mark_down(worker, "again")  # already down: no second notification
        assert notified == [WorkerStatus.DOWN]
        await cluster.refresh()
        assert worker.state is WorkerStatus.READY
        assert notified == [WorkerStatus.DOWN, WorkerStatus.READY]
    finally:
        await cluster.stop()


async def test_draining_worker_takes_no_work_and_stays_draining() -> None:
    fleet = FakeFleet()
    cluster = make_cluster(fleet, "w1:1", "w2:1")
    await cluster.start()
    try:
        cluster.set_draining("w1:1")
        assert [w.address for w in cluster.healthy("m")] == ["w2:1"]
        await cluster.refresh()
        assert cluster.worker("w1:1").state is WorkerStatus.DRAINING and cluster.worker("w1:1").is_up
        cluster.set_draining("w1:1", False)
        assert len(cluster.healthy("m")) == 2
    finally:
        await cluster.stop()


async def test_listener_errors_do_not_stop_other_listeners() -> None:
    fleet = FakeFleet()
    cluster = make_cluster(fleet, "w1:1")
    seen: list[int] = []

    def broken() -> None:
        raise RuntimeError("listener bug")

    cluster.on_change(broken)
    unsubscribe = cluster.on_change(lambda: seen.append(1))
    await cluster.start()
    try:
        assert seen == [1]
        unsubscribe()
        cluster.mark_down(cluster.workers()[0], "test")
        assert seen == [1]
    finally:
        await cluster.stop()

