"""Unit tests for execution/stats.py: Triton's ModelStatistics counters."""

from __future__ import annotations

from execution.stats import ExecutionTiming, ModelStats


def timing(batch: int, base: int) -> ExecutionTiming:
    return ExecutionTiming(
        batch_size=batch,
        queue_ns=base,
        compute_input_ns=base + 1,
        compute_infer_ns=base + 2,
        compute_output_ns=base + 3,
        total_ns=base + 10,
    )


def test_counters_and_durations_accumulate_like_triton() -> None:
    stats = ModelStats()
    stats.record_success(timing(4, 100))
    stats.record_success(timing(4, 200))
    stats.record_success(timing(1, 1000))
    stats.record_failure(7)
    proto = stats.to_proto("mlp", "1")
    assert (proto.name, proto.version) == ("mlp", "1")
    assert proto.inference_count == 9 and proto.execution_count == 3
    s = proto.inference_stats
    assert (s.success.count, s.success.ns) == (3, 110 + 210 + 1010)
    assert (s.fail.count, s.fail.ns) == (1, 7)
    assert (s.queue.count, s.queue.ns) == (3, 1300)
    assert (s.compute_input.ns, s.compute_infer.ns, s.compute_output.ns) == (1303, 1306, 1309)
    assert [b.batch_size for b in proto.batch_stats] == [1, 4]
    four = proto.batch_stats[1]
    assert (four.compute_infer.count, four.compute_infer.ns) == (2, 102 + 202)
    assert (four.compute_input.ns, four.compute_output.ns) == (101 + 201, 103 + 203)
    assert proto.last_inference > 1_600_000_000_000  # milliseconds since the epoch


def test_fresh_stats_are_zero() -> None:
    proto = ModelStats().to_proto("m", "3")
    assert proto.inference_count == 0 and proto.last_inference == 0
    assert proto.inference_stats.success.count == 0 and not proto.batch_stats
