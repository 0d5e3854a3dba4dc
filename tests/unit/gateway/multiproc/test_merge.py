"""Merging several gateway processes' answers: exact sums, the shared view taken once."""

from __future__ import annotations

import statistics

import pytest
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.grpc import service_pb2

from gateway.multiproc.merge import merge_cluster_stats, merge_cluster_view, merge_metrics, merge_statistics
from gateway.multiproc.peers import error_body, error_from_peer
from protos.errors import ModelNotFound, Overloaded, Unavailable


def _stats(model: str, inferences: int, last_ms: int, batches: dict[int, int]) -> service_pb2.ModelStatisticsResponse:
    response = service_pb2.ModelStatisticsResponse()
    s = response.model_stats.add(name=model, version="1", last_inference=last_ms, inference_count=inferences,
                                 execution_count=sum(batches.values()))
    s.inference_stats.success.count, s.inference_stats.success.ns = inferences, inferences * 1000
    for size, n in batches.items():
        b = s.batch_stats.add(batch_size=size)
        b.compute_infer.count, b.compute_infer.ns = n, n * 10
    s.memory_usage.add(type="CPU", id=0, byte_size=inferences)
    return response


def test_statistics_sum_exactly_and_keep_the_latest_inference() -> None:
    merged = merge_statistics([_stats("a", 5, 100, {1: 3, 2: 1}), _stats("a", 7, 90, {2: 2, 4: 1}),
                               _stats("b", 1, 5, {1: 1})])
    a, b = merged.model_stats
    assert (a.name, b.name) == ("a", "b")
    assert a.inference_count == 12 and a.execution_count == 7 and a.last_inference == 100
    assert (a.inference_stats.success.count, a.inference_stats.success.ns) == (12, 12000)
    assert [(x.batch_size, x.compute_infer.count, x.compute_infer.ns) for x in a.batch_stats] == [
        (1, 3, 30), (2, 3, 30), (4, 1, 10)]
    assert [(m.type, m.id, m.byte_size) for m in a.memory_usage] == [("CPU", 0, 12)]
    assert b.inference_count == 1 and b.name == "b" and b.version == "1"


def test_statistics_of_one_process_are_unchanged() -> None:
    one = _stats("a", 5, 100, {2: 1, 1: 3})
    merged = merge_statistics([one])
    assert merged.model_stats[0].inference_count == 5
    assert [x.batch_size for x in merged.model_stats[0].batch_stats] == [1, 2]


_TEXT = """\
# HELP nv_inference_count rows
# TYPE nv_inference_count counter
nv_inference_count{{model="a",version="1"}} {rows}
# HELP infergate_batch_size rows per batch
# TYPE infergate_batch_size histogram
infergate_batch_size_bucket{{le="1.0",model="a",version="1"}} {b1}
infergate_batch_size_bucket{{le="+Inf",model="a",version="1"}} {binf}
infergate_batch_size_count{{model="a",version="1"}} {binf}
infergate_batch_size_sum{{model="a",version="1"}} {rows}
# HELP infergate_model_replicas replicas
# TYPE infergate_model_replicas gauge
infergate_model_replicas{{model="a"}} 2
# HELP infergate_queue_depth queued
# TYPE infergate_queue_depth gauge
infergate_queue_depth{{model="a",version="1"}} {queued}
# HELP infergate_placement_rounds_total rounds
# TYPE infergate_placement_rounds_total counter
infergate_placement_rounds_total {rounds}
"""


def _family_samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text.decode()) for s in f.samples}


def test_metrics_sum_counters_and_buckets_take_the_view_once_and_count_per_process() -> None:
    merged = merge_metrics([_TEXT.format(rows=10, b1=4, binf=6, queued=1, rounds=7),
                            _TEXT.format(rows=5, b1=1, binf=3, queued=2, rounds=0)])
    text = merged.decode()
    assert 'nv_inference_count{model="a",version="1"} 15\n' in text  # Triton's bare counter name kept
    s = _family_samples(merged)
    labels = (("model", "a"), ("version", "1"))
    assert s[("infergate_batch_size_bucket", (("le", "1.0"), *labels))] == 5
    assert s[("infergate_batch_size_bucket", (("le", "+Inf"), *labels))] == 9
    assert s[("infergate_batch_size_count", labels)] == 9
    assert s[("infergate_model_replicas", (("model", "a"),))] == 2
    assert s[("infergate_queue_depth", labels)] == 3
    assert s[("infergate_placement_rounds_total", (("process", "0"),))] == 7
    assert s[("infergate_placement_rounds_total", (("process", "1"),))] == 0
    assert s[("infergate_gateway_processes", ())] == 2


def test_metrics_count_the_requests_each_process_answered() -> None:
    text = ('# HELP nv_inference_request_success ok\n# TYPE nv_inference_request_success counter\n'
            'nv_inference_request_success{{model="a",version="1"}} {}\n')
    s = _family_samples(merge_metrics([text.format(3), text.format(4)]))
    assert s[("infergate_process_requests_total", (("process", "0"),))] == 3
    assert s[("infergate_process_requests_total", (("process", "1"),))] == 4


def test_cluster_documents_sum_counters_on_one_view() -> None:
    def view(inflight: int, queued: int) -> dict:
        return {"gateway": {"ready": True}, "models": [{"name": "a", "queue_depth": queued, "replicas": ["w1"]}],
                "workers": [{"address": "w1", "state": "ready", "load": {
                    "inflight_batches": inflight, "batches_sent": 10, "failures": 0, "retries": 1}}]}
    merged = merge_cluster_view([view(1, 2), view(3, 4)])
    assert merged["workers"][0]["load"] == {"inflight_batches": 4, "batches_sent": 20, "failures": 0, "retries": 2}
    assert merged["models"][0]["queue_depth"] == 6 and merged["models"][0]["replicas"] == ["w1"]
    assert merged["gateway"]["processes"] == 2
    assert merged["models"][0]["light"] is None and merged["models"][0]["light_by_process"] == [None, None]

    def stats(success: int, counts: list[int]) -> dict:
        return {"time": 1.0, "latency_bounds_s": [0.1], "models": [
            {"model": "a", "version": "1", "success": success, "failure": 0, "inferences": success, "executions": 1,
             "batch_rows": success, "queue_depth": 0, "latency_counts": counts, "latency_sum_s": 0.5}],
            "workers": [{"address": "w1", "state": "ready", "inflight": 0, "sent": 1, "failures": 0, "retries": 0}]}
    doc = merge_cluster_stats([stats(3, [1, 2]), stats(4, [3, 1])])
    (model,) = doc["models"]
    assert model["success"] == 7 and model["latency_counts"] == [4, 3] and model["latency_sum_s"] == 1.0
    assert doc["workers"][0]["sent"] == 2 and doc["processes"] == 2


@pytest.mark.parametrize("error", [ModelNotFound("Request for unknown model: 'x' is not found"),
                                   Overloaded("queue full"), Unavailable("worker down")])
def test_a_peer_error_comes_back_as_the_same_class(error: Exception) -> None:
    back = error_from_peer(error.http_status, error_body(error))
    assert type(back) is type(error) and back.message == error.message


def test_a_peer_answer_that_is_not_ours_is_unavailable() -> None:
    back = error_from_peer(502, b"<html>bad gateway</html>")
    assert isinstance(back, Unavailable) and "502" in back.message


def _judged(light: bool | None, ms: float | None) -> dict:
    return {"gateway": {}, "workers": [], "models": [{"name": "a", "queue_depth": 0, "light": light,
                                                     "worker_ms_per_row": ms}]}


@pytest.mark.parametrize(("verdicts", "light"), [
    ([True, True, None], True),  # a process that has not judged yet does not hold the others back
    ([False, False, False], False),
    ([True, False, True], None),  # the processes disagree: no one verdict
    ([None, None, None], None),
])
def test_cluster_view_aggregates_each_process_light_verdict(verdicts: list, light: bool | None) -> None:
    costs = [None if v is None else (0.2 if v else 9.0) for v in verdicts]
    merged = merge_cluster_view([_judged(v, ms) for v, ms in zip(verdicts, costs)])["models"][0]
    assert merged["light"] is light
    assert merged["light_by_process"] == verdicts
    judged = sorted(ms for ms in costs if ms is not None)
    assert merged["worker_ms_per_row"] == (None if not judged else round(statistics.median(judged), 3))


def test_cluster_view_worker_cost_is_the_median_over_processes() -> None:
    merged = merge_cluster_view([_judged(True, 0.2), _judged(True, 0.4), _judged(True, 1.5)])["models"][0]
    assert merged["worker_ms_per_row"] == 0.4
    merged = merge_cluster_view([_judged(True, 0.2), _judged(True, 0.45)])["models"][0]
    assert merged["worker_ms_per_row"] == 0.325
