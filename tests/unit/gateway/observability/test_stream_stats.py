"""Tests for gateway/observability/streams.py and the refusal of a unary call to a decoupled
model (gateway/types.py, gateway/core/streaming.py): what the metrics read and Triton's words."""

from __future__ import annotations

import contextvars

import grpc
from tritonclient.grpc import model_config_pb2

from gateway.core.streaming import is_decoupled
from gateway.observability.streams import FORWARD_BUCKETS_S, RESPONSE_COUNT_BUCKETS, StreamStats
from gateway.types import DecoupledRefused, single_response_endpoint


def test_stream_stats_count_opened_open_responses_and_first_response_time() -> None:
    stats = StreamStats()
    stats.opened("m", "1")
    stats.opened("m", "1")
    for index in range(3):
        stats.response("m", "1", 0.002 * (index + 1), index)
    stats.closed("m", "1", 3)
    ((key, m),) = stats.items()
    assert key == ("m", "1") and (m.opened, m.open, m.responses) == (2, 1, 3)
    assert m.first_response.count == 1 and abs(m.first_response.sum - 0.002) < 1e-12
    assert m.per_stream.counts[RESPONSE_COUNT_BUCKETS.index(4)] == 1  # 3 responses: the le=4 bucket
    assert stats.open_total() == 1


def test_the_forwarding_gap_lands_in_its_bucket() -> None:
    stats = StreamStats()
    stats.forwarded(0.0009)
    stats.forwarded(0.003)
    assert stats.forward.counts[FORWARD_BUCKETS_S.index(0.001)] == 1
    assert stats.forward.counts[FORWARD_BUCKETS_S.index(0.005)] == 1


def test_a_model_is_decoupled_by_its_transaction_policy() -> None:
    config = model_config_pb2.ModelConfig(name="m")
    assert not is_decoupled(config)
    config.model_transaction_policy.decoupled = True
    assert is_decoupled(config)


def test_the_refusal_speaks_tritons_words_for_each_endpoint() -> None:
    http = DecoupledRefused()
    assert str(http) == "HTTP end point doesn't support models with decoupled transaction policy"
    assert (http.http_status, http.grpc_code) == (501, grpc.StatusCode.UNIMPLEMENTED)

    def in_grpc_call() -> str:
        single_response_endpoint.set("ModelInfer RPC")
        return str(DecoupledRefused())

    assert contextvars.copy_context().run(in_grpc_call) == (
        "ModelInfer RPC doesn't support models with decoupled transaction policy")
    assert str(DecoupledRefused()).startswith("HTTP end point")  # the setting stayed in that call's context
