"""serverkit/prometheus.py: Triton's per-model counters declared once, with a server's own help texts."""

from __future__ import annotations

import pytest

from serverkit.prometheus import ModelCounters


def test_model_counters_carry_tritons_names_and_a_servers_own_words() -> None:
    counters = ModelCounters.declare(failure_labels=("reason", "error"), execs="Number of batches sent to workers")
    assert [f.name for f in counters.families()] == [
        "nv_inference_request_success", "nv_inference_request_failure", "nv_inference_count", "nv_inference_exec_count",
        "nv_inference_request_duration_us", "nv_inference_queue_duration_us", "nv_inference_compute_infer_duration_us",
    ]
    assert counters.execs.documentation == "Number of batches sent to workers"
    assert counters.success.documentation == "Number of successful inference requests, all batch sizes"
    counters.failure.add_metric(["cnn", "1", "OTHER", "Internal"], 2)
    [sample] = counters.failure.samples
    assert sample.labels == {"model": "cnn", "version": "1", "reason": "OTHER", "error": "Internal"}
    with pytest.raises(TypeError, match="exec_count"):
        ModelCounters.declare(exec_count="a typo")
