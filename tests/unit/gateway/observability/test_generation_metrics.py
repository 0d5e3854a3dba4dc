"""Tests for the generation metrics (gateway/observability/streams.py and
metrics.py): a streamed response carrying ``text_output`` is a token; tokens
generated, time to first token and inter-token latency per model; models
that stream no tokens show none of them."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from gateway.observability.metrics import GatewayCollector
from gateway.observability.streams import TOKEN_GAP_BUCKETS_S, StreamStats
from gateway.types import Tensor
from serverkit.prometheus import render_text
from tests.unit.gateway.observability.test_metrics_gateway import FakeGateway

TOKEN = (Tensor("text_output", "BYTES", (1,), b"\x01\x00\x00\x00a"),)
OTHER = (Tensor("OUT", "INT32", (1,), b"\x00\x00\x00\x00"),)


def generation(stats: StreamStats, model: str, ttft_s: float, gaps_s: list[float], *, final_counts: bool) -> None:
    """One stream: the first token after ``ttft_s``, then one token after each gap, then (optionally)
    a final response with counts and no token."""
    stats.opened(model, "1")
    at = ttft_s
    stats.response(model, "1", at, 0, at, TOKEN)
    for i, gap in enumerate(gaps_s, start=1):
        at += gap
        stats.response(model, "1", at, i, gap, TOKEN)
    if final_counts:
        stats.response(model, "1", at + 0.001, len(gaps_s) + 1, 0.001, ())
    stats.closed(model, "1", len(gaps_s) + 1 + int(final_counts))


def test_tokens_first_token_and_gaps_per_model() -> None:
    stats = StreamStats()
    generation(stats, "lm", 0.02, [0.001, 0.003], final_counts=True)
    generation(stats, "lm", 0.04, [0.002], final_counts=False)
    stats.opened("sq", "1")
    for i in range(3):
        stats.response("sq", "1", 0.01 * (i + 1), i, 0.01, OTHER)
    stats.closed("sq", "1", 3)
    by_model = dict(stats.items())
    lm, sq = by_model[("lm", "1")], by_model[("sq", "1")]
    assert (lm.responses, lm.tokens) == (6, 5)
    assert lm.first_token.count == 2 and abs(lm.first_token.sum - 0.06) < 1e-12
    assert lm.token_gap.count == 3 and abs(lm.token_gap.sum - 0.006) < 1e-12  # the final's gap is no token's
    assert lm.token_gap.counts[TOKEN_GAP_BUCKETS_S.index(0.001)] == 1
    assert lm.token_gap.counts[TOKEN_GAP_BUCKETS_S.index(0.0025)] == 1
    assert lm.token_gap.counts[TOKEN_GAP_BUCKETS_S.index(0.005)] == 1
    assert (sq.tokens, sq.first_token.count, sq.token_gap.count) == (0, 0, 0)
    assert sq.first_response.count == 1  # streams keep their own numbers


def test_the_metrics_show_generations_of_models_that_generated() -> None:
    gw = FakeGateway()
    gw.streams = StreamStats()  # type: ignore[attr-defined]
    generation(gw.streams, "lm", 0.02, [0.001, 0.003], final_counts=True)  # type: ignore[attr-defined]
    gw.streams.opened("sq", "1")  # type: ignore[attr-defined]
    gw.streams.response("sq", "1", 0.01, 0, 0.01, OTHER)  # type: ignore[attr-defined]
    text = render_text([GatewayCollector(gw)]).decode()  # type: ignore[arg-type]
    samples = {(s.name, s.labels.get("model"), s.labels.get("le")): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples[("infergate_generation_tokens_total", "lm", None)] == 3
    assert samples[("infergate_generation_time_to_first_token_seconds_count", "lm", None)] == 1
    assert samples[("infergate_generation_inter_token_seconds_count", "lm", None)] == 2
    assert samples[("infergate_generation_inter_token_seconds_bucket", "lm", "0.001")] == 1
    assert not any(model == "sq" and name.startswith("infergate_generation") for name, model, _ in samples)


def test_the_dashboard_stats_carry_a_generative_models_histograms() -> None:
    from gateway.multiproc.merge import merge_cluster_stats
    from gateway.observability.cluster_api import cluster_stats

    gw = FakeGateway()
    gw.streams = StreamStats()  # type: ignore[attr-defined]
    generation(gw.streams, "lm", 0.02, [0.001, 0.003], final_counts=True)  # type: ignore[attr-defined]
    for model in ("lm", "simple"):
        gw.stats.record_success(model, "1", 1, 1_000_000, queue_ns=0)
    doc = cluster_stats(gw)  # type: ignore[arg-type]
    assert doc["token_gap_bounds_s"] == list(TOKEN_GAP_BUCKETS_S)
    models = {m["model"]: m for m in doc["models"]}
    lm = models["lm"]
    assert lm["tokens"] == 3 and sum(lm["ttft_counts"]) == 1 and sum(lm["itl_counts"]) == 2
    assert "tokens" not in models["simple"]
    merged = {m["model"]: m for m in merge_cluster_stats([doc, doc])["models"]}
    assert merged["lm"]["tokens"] == 6 and sum(merged["lm"]["itl_counts"]) == 4
    assert merged["simple"]["success"] == 2 and "tokens" not in merged["simple"]
