"""Tests for gateway/routing/outlier.py: ejection on consecutive failures and on latency,
growing ejection times, the ejection share, the half-open circuit, and the
router skipping ejected replicas (panic mode when all are). Fake clock, no sockets.
"""

from __future__ import annotations

import pytest
from tritonclient.grpc import service_pb2

from gateway.fleet.cluster import WorkerStatus
from gateway.routing.outlier import CircuitState, OutlierDetector
from gateway.routing.router import Router
from gateway.settings import OutlierSettings
from tests.unit.gateway.fleet.test_cluster import FakeFleet, make_cluster


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def detector(*addresses: str, **settings: object) -> tuple[OutlierDetector, FakeClock]:
    clock = FakeClock()
    d = OutlierDetector(OutlierSettings(**settings), clock=clock)  # type: ignore[arg-type]
    d.sync((a, True) for a in addresses)
    return d, clock


def fail(d: OutlierDetector, address: str, times: int) -> None:
    for _ in range(times):
        d.failed(address, "boom", d.attempt_started(address))


def succeed(d: OutlierDetector, address: str, latency_s: float, times: int = 1, model: str = "m") -> None:
    for _ in range(times):
        d.succeeded(address, model, latency_s, d.attempt_started(address))


def test_five_consecutive_failures_eject_and_a_success_resets_the_count() -> None:
    d, _ = detector("a", "b")
    fail(d, "a", 4)
    succeed(d, "a", 0.01)  # the streak is broken
    fail(d, "a", 4)
    assert d.routable("a") and d.state("a") is CircuitState.CLOSED
    fail(d, "a", 1)
    assert not d.routable("a") and d.state("a") is CircuitState.OPEN
    (health,) = [h for h in d.snapshot() if h.address == "a"]
    assert health.ejections == 1 and health.ejected_for_s == pytest.approx(30.0)
    assert "5 consecutive failures" in health.reason
    assert d.routable("b")


def test_ejection_time_grows_with_repeats_and_is_capped() -> None:
    d, clock = detector("a", "b", base_ejection_s=10.0, max_ejection_s=25.0)
    durations = []
    for _ in range(4):
        fail(d, "a", 5)
        (health,) = [h for h in d.snapshot() if h.address == "a"]
        durations.append(health.ejected_for_s)
        clock.t += health.ejected_for_s
        assert d.routable("a")  # half-open: one trial
        fail(d, "a", 1)  # the trial fails: ejected again at once
        (health,) = [h for h in d.snapshot() if h.address == "a"]
        durations.append(health.ejected_for_s)
        clock.t += health.ejected_for_s
        assert d.routable("a")
        succeed(d, "a", 0.01)  # the next trial succeeds: closed
        assert d.state("a") is CircuitState.CLOSED
    assert durations[:4] == [10.0, 20.0, 25.0, 25.0]
    assert max(durations) == 25.0


def test_half_open_lets_one_trial_through_at_a_time() -> None:
    d, clock = detector("a", "b", base_ejection_s=5.0)
    fail(d, "a", 5)
    assert not d.routable("a")
    clock.t += 4.9
    assert not d.routable("a")
    clock.t += 0.2
    assert d.routable("a")
    trial = d.attempt_started("a")
    assert trial and d.state("a") is CircuitState.HALF_OPEN
    assert not d.routable("a")  # the trial is in flight
    d.abandoned("a", "m", 0.1, trial)  # cancelled: no verdict, the slot frees
    assert d.routable("a") and d.state("a") is CircuitState.HALF_OPEN
    succeed(d, "a", 0.01)
    assert d.state("a") is CircuitState.CLOSED


def test_never_more_than_the_ejection_share() -> None:
    d, _ = detector("a", "b", "c", "d", max_ejection_percent=50.0)
    for address in "abcd":
        fail(d, address, 5)
    states = [d.state(a) for a in "abcd"]
    assert states.count(CircuitState.OPEN) == 2  # 50% of four
    # Two workers: one may go (at least one), never both.
    d2, _ = detector("x", "y", max_ejection_percent=10.0)
    fail(d2, "x", 5)
    fail(d2, "y", 5)
    assert [d2.state(a) for a in "xy"] == [CircuitState.OPEN, CircuitState.CLOSED]
    # One worker alone is never ejected.
    d3, _ = detector("solo")
    fail(d3, "solo", 50)
    assert d3.routable("solo")


def test_latency_outlier_is_ejected_only_when_clearly_slower() -> None:
    d, _ = detector("fast1", "fast2", "slow", latency_min_samples=5)
    for _ in range(5):
        succeed(d, "fast1", 0.010)
        succeed(d, "fast2", 0.012)
        succeed(d, "slow", 0.025)  # 2x slower: within the factor
    assert all(d.routable(a) for a in ("fast1", "fast2", "slow"))
    succeed(d, "slow", 2.0)  # one slow call (a pause) is no reason
    succeed(d, "slow", 0.025, times=3)
    assert d.routable("slow")
    succeed(d, "slow", 0.400, times=12)  # a slow worker, call after call
    assert not d.routable("slow")
    (health,) = [h for h in d.snapshot() if h.address == "slow"]
    assert "latency outlier for model m" in health.reason
    # Tiny absolute differences never eject, whatever the ratio.
    d2, _ = detector("a", "b", latency_min_samples=3)
    succeed(d2, "a", 0.0005, times=3)
    succeed(d2, "b", 0.005, times=3)
    assert d2.routable("b")


def test_latency_is_compared_per_model() -> None:
    d, _ = detector("a", "b", latency_min_samples=3)
    succeed(d, "a", 0.005, times=3, model="small")
    succeed(d, "b", 0.500, times=3, model="big")  # no peer for "big": nothing to compare
    assert d.routable("b")


def test_worker_coming_back_up_starts_clean() -> None:
    d, _ = detector("a", "b")
    fail(d, "a", 5)
    assert d.state("a") is CircuitState.OPEN
    d.sync([("a", False), ("b", True)])
    d.sync([("a", True), ("b", True)])  # down, then up again: a restarted worker
    assert d.state("a") is CircuitState.CLOSED and d.routable("a")
    assert [h.ejections for h in d.snapshot() if h.address == "a"] == [0]
    d.sync([("b", True)])  # removed from the cluster: forgotten
    assert [h.address for h in d.snapshot()] == ["b"]


def test_hung_attempt_counts_once_and_its_late_answer_is_no_trial() -> None:
    d, clock = detector("a", "b", base_ejection_s=1.0)
    fail(d, "a", 5)
    clock.t += 1.0
    trial = d.attempt_started("a")
    d.failed("a", "no answer after 1.00s", trial)  # the hang is the trial's verdict
    assert d.state("a") is CircuitState.OPEN
    d.succeeded("a", "m", 5.0, False)  # the hung attempt answers late: ignored while open
    assert d.state("a") is CircuitState.OPEN


def test_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="outlier.latency_factor"):
        OutlierSettings(latency_factor=0.5)
    with pytest.raises(ValueError, match="outlier.max_ejection_percent"):
        OutlierSettings(max_ejection_percent=150)
    with pytest.raises(ValueError, match="outlier.base_ejection_s"):
        OutlierSettings(base_ejection_s=10, max_ejection_s=5)


async def test_router_skips_ejected_replicas_and_panics_when_all_are() -> None:
    # "m" lives on a, b and c; "n" only on a and b, so ejecting a and b (two of
    # three workers, within the share) leaves "n" with nothing but ejected replicas.
    fleet = FakeFleet({"a:1": {"m": ["1"], "n": ["1"]}, "b:1": {"m": ["1"], "n": ["1"]}, "c:1": {"m": ["1"]}})
    cluster = make_cluster(fleet, "a:1", "b:1", "c:1")
    await cluster.start()
    clock = FakeClock()
    outliers = OutlierDetector(OutlierSettings(max_ejection_percent=100.0), clock=clock)
    router = Router(cluster, outliers=outliers)
    try:
        fail(outliers, "a:1", 5)
        fail(outliers, "b:1", 5)
        assert {outliers.state(a) for a in ("a:1", "b:1")} == {CircuitState.OPEN}
        answers = {(await router.infer("m", "", _request("m"), None)).id for _ in range(6)}
        assert answers == {"c:1"}
        # c fills up: the batcher sees no capacity rather than ejected replicas taking work.
        cluster.workers()[2].inflight = router.limits(cluster.workers()[2], "m")[1]
        assert not router.capacity("m").has_capacity()
        cluster.workers()[2].inflight = 0
        # Every replica of "n" ejected is the same as none ejected: all serve (panic mode).
        answers = {(await router.infer("n", "", _request("n"), None)).id for _ in range(30)}
        assert answers == {"a:1", "b:1"}
        assert router.capacity("n").has_capacity()
        # Never all three: the detector keeps one worker in rotation whatever happens.
        fail(outliers, "c:1", 5)
        assert outliers.state("c:1") is CircuitState.CLOSED
        # A worker the cluster marks down and back up rejoins with a closed circuit.
        a = cluster.workers()[0]
        cluster.mark_down(a, "test")
        await cluster.refresh()
        assert a.state is WorkerStatus.READY and outliers.state("a:1") is CircuitState.CLOSED
    finally:
        await cluster.stop()


def _request(model: str) -> service_pb2.ModelInferRequest:
    return service_pb2.ModelInferRequest(model_name=model)


def test_latency_is_compared_only_at_the_same_load() -> None:
    d, _ = detector("a", "b", latency_min_samples=5)
    for _ in range(8):
        d.succeeded("a", "m", 0.020, d.attempt_started("a"), queued=0)  # idle
        d.succeeded("b", "m", 0.200, d.attempt_started("b"), queued=2)  # behind the gateway's own queue
    assert d.routable("b")  # loaded, not slow: no peer at its load to be slower than
    for _ in range(8):
        d.succeeded("a", "m", 0.180, d.attempt_started("a"), queued=2)
    assert d.routable("b")  # as fast as its peer at that load
    for _ in range(12):
        d.succeeded("b", "m", 0.300, d.attempt_started("b"), queued=0)  # idle, and still slow: slow
    assert not d.routable("b")
    (health,) = [h for h in d.snapshot() if h.address == "b"]
    assert ("at the same load (batches of up to 1 rows, waiting up to 0 executions first, no other attempt "
            "in the gateway)") in health.reason


def test_latency_is_compared_only_at_the_same_gateway_load() -> None:
    d, _ = detector("a", "b", latency_min_samples=5)
    for _ in range(8):  # both at rest: one call at a time
        d.succeeded("a", "m", 0.022, d.attempt_started("a"), beside=0)
        d.succeeded("b", "m", 0.022, d.attempt_started("b"), beside=0)
    for _ in range(12):  # answers read late by a gateway taking in a burst: not b's doing
        d.succeeded("b", "m", 0.100, d.attempt_started("b"), beside=30)
    assert d.routable("b")
    for _ in range(8):
        d.succeeded("a", "m", 0.095, d.attempt_started("a"), beside=30)
    assert d.routable("b")  # as slow as its peer under that load
    for _ in range(12):
        d.succeeded("b", "m", 0.200, d.attempt_started("b"), beside=0)  # at rest, and still slow: slow
    assert not d.routable("b")
    (health,) = [h for h in d.snapshot() if h.address == "b"]
    assert "no other attempt in the gateway" in health.reason


async def test_the_return_trial_runs_on_a_timer_without_traffic() -> None:
    import asyncio

    from gateway.routing.outlier_trials import ReturnTrials

    d, clock = detector("a", "b", consecutive_failures=2, base_ejection_s=30.0)
    probed: list[tuple[str, str]] = []
    sleeping: list[tuple[float, asyncio.Future[None]]] = []
    answer = {"ready": False}

    async def probe(address: str, model: str) -> bool:
        probed.append((address, model))
        return answer["ready"]

    async def sleep(s: float) -> None:
        wake = asyncio.get_running_loop().create_future()
        sleeping.append((s, wake))
        await wake

    async def time_passes() -> None:  # the fake clock moves by what the waiting trial waits
        s, wake = sleeping.pop(0)
        clock.t += s
        wake.set_result(None)
        for _ in range(5):
            await asyncio.sleep(0)

    trials = ReturnTrials(d, probe, sleep=sleep)
    d.on_eject = trials.ejected
    fail(d, "b", 2)
    await asyncio.sleep(0)
    assert d.state("b") is CircuitState.OPEN and probed == [] and sleeping[0][0] == 30.0
    await time_passes()
    assert probed == [("b", "")]  # no client request came: the timer tried it
    assert d.state("b") is CircuitState.OPEN and sleeping[0][0] == 60.0  # not ready: ejected again, for longer
    answer["ready"] = True
    await time_passes()
    assert d.state("b") is CircuitState.CLOSED and not sleeping
    trials.cancel()


def test_latency_is_compared_only_at_the_same_batch_size() -> None:
    d, _ = detector("a", "b", latency_min_samples=5)
    for _ in range(12):
        d.succeeded("a", "m", 0.020, d.attempt_started("a"), rows=1)
        d.succeeded("b", "m", 0.150, d.attempt_started("b"), rows=64)  # the burst's full batches
    assert d.routable("b")
