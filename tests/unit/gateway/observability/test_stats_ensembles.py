"""An ensemble's statistics (gateway/observability/stats.py): its own entry in
Triton's shape (one execution per request, queue and compute the sums of its
steps') and, listed after it, each step's share of its work."""

from __future__ import annotations

from tritonclient.grpc import service_pb2

from gateway.ensembles.plan import Step
from gateway.ensembles.runner import StepRun
from gateway.observability.stats import GatewayStats

STEPS = [Step(0, "pre", "", (), ()), Step(1, "net", "2", (), ())]


def _run(step: Step, queue_ns: int, compute_ns: int, error: str = "") -> StepRun:
    return StepRun(step, step.version or "1", 3, queue_ns, compute_ns, queue_ns + compute_ns + 1, error)


def _response(stats: GatewayStats) -> service_pb2.ModelStatisticsResponse:
    response = stats.to_proto("ens", "1", [("ens", "1")])
    stats.add_step_entries(response, [(0, "pre", "1"), (1, "net", "2")])
    return response


def test_the_ensemble_counts_its_steps_compute_and_queue() -> None:
    stats = GatewayStats()
    queue_ns = stats.record_ensemble("ens", "1", 3, [_run(STEPS[0], 10, 100), _run(STEPS[1], 20, 200)])
    assert queue_ns == 30
    stats.record_success("ens", "1", 3, 400, queue_ns)
    ens, pre, net = _response(stats).model_stats
    assert (ens.name, ens.inference_count, ens.execution_count) == ("ens", 3, 1)
    assert (ens.inference_stats.compute_infer.ns, ens.inference_stats.queue.ns) == (300, 30)
    assert [(b.batch_size, b.compute_infer.count) for b in ens.batch_stats] == [(3, 1)]
    assert [(s.name, s.version, s.inference_count, s.execution_count) for s in (pre, net)] == [
        ("pre", "1", 3, 1), ("net", "2", 3, 1)]
    assert (net.inference_stats.queue.ns, net.inference_stats.compute_infer.ns, net.inference_stats.success.ns) == (
        20, 200, 221)


def test_a_failed_step_is_counted_on_the_step_not_as_an_execution() -> None:
    stats = GatewayStats()
    assert stats.record_ensemble("ens", "1", 3, [_run(STEPS[0], 10, 100), _run(STEPS[1], 0, 0, "Unavailable")]) == 0
    ens, pre, net = _response(stats).model_stats
    assert (ens.execution_count, ens.inference_stats.compute_infer.count) == (0, 0)
    assert (pre.inference_stats.success.count, net.inference_stats.fail.count, net.inference_count) == (1, 1, 0)


def test_steps_show_zeros_before_any_request_and_only_under_an_ensemble() -> None:
    stats = GatewayStats()
    ens, pre, net = _response(stats).model_stats
    assert [(s.name, s.version, s.inference_count) for s in (ens, pre, net)] == [
        ("ens", "1", 0), ("pre", "1", 0), ("net", "2", 0)]
    assert [s.name for s in stats.to_proto("", "", [("ens", "1")]).model_stats] == ["ens"]
