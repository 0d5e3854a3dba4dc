"""Streams of decoupled models, as the metrics read them (``StreamStats``).

Per (model, version): streams opened, open now, responses forwarded, a
histogram of responses per finished stream and one of the time from a
request's arrival to its first response. One more histogram, for the whole
gateway, holds the forwarding gap: the time between a worker's response
arriving at the gateway and the gateway's frontend having written it to its
client (the "forwarded at once" promise, measured). Success and failure
counts stay in Triton's per-model statistics (``observability.stats``).
Only the event loop touches these counters, so no locks.

Generative streams (a response carrying ``text_output`` is one token, as
the generation contract streams them) add, per (model, version): tokens
generated, time to first token (a request's arrival to its first token) and
inter-token latency (the gap between a token and the stream's previous
response).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

from gateway.observability.latency import LATENCY_BUCKETS_S, Histogram
from gateway.types import Tensor

# Responses per stream: 0 (only the final flag) up to long generations.
RESPONSE_COUNT_BUCKETS: tuple[float, ...] = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
# Forwarding gap in seconds: 10 us to 100 ms, the 1 ms mark among them.
FORWARD_BUCKETS_S: tuple[float, ...] = (
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1)

# Inter-token latency in seconds: 100 us to 2.5 s.
TOKEN_GAP_BUCKETS_S: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# The output a generative model streams one token per response in (the generation contract).
TOKEN_OUTPUT = "text_output"


def _histogram(bounds: tuple[float, ...]) -> Histogram:
    return Histogram([0] * (len(bounds) + 1))


def _observe(h: Histogram, bounds: tuple[float, ...], value: float) -> None:
    h.counts[bisect.bisect_left(bounds, value)] += 1  # a value equal to a bound is in that bucket (le)
    h.sum += value


@dataclass(slots=True)
class ModelStreams:
    """One (model, version)'s streams."""

    opened: int = 0
    open: int = 0
    responses: int = 0
    per_stream: Histogram = field(default_factory=lambda: _histogram(RESPONSE_COUNT_BUCKETS))
    first_response: Histogram = field(default_factory=lambda: _histogram(LATENCY_BUCKETS_S))
    tokens: int = 0  # generated: responses carrying a token
    first_token: Histogram = field(default_factory=lambda: _histogram(LATENCY_BUCKETS_S))
    token_gap: Histogram = field(default_factory=lambda: _histogram(TOKEN_GAP_BUCKETS_S))


@dataclass(slots=True)
class StreamStats:
    """Counters and histograms of the gateway's streams."""

    _by_model: dict[tuple[str, str], ModelStreams] = field(default_factory=dict)
    forward: Histogram = field(default_factory=lambda: _histogram(FORWARD_BUCKETS_S))

    def _model(self, model: str, version: str) -> ModelStreams:
        entry = self._by_model.get((model, version))
        if entry is None:
            entry = self._by_model[(model, version)] = ModelStreams()
        return entry

    def opened(self, model: str, version: str) -> None:
        entry = self._model(model, version)
        entry.opened += 1
        entry.open += 1

    def response(self, model: str, version: str, since_arrival_s: float, index: int,
                 since_previous_s: float | None = None, outputs: Sequence[Tensor] = ()) -> None:
        """A response forwarded; ``index`` counts from 0, and the first one's time is observed.

        ``outputs`` with a token (``text_output``): one token generated; its gap since the
        stream's previous response (``since_previous_s``) is observed after the first token."""
        entry = self._model(model, version)
        entry.responses += 1
        if index == 0:
            _observe(entry.first_response, LATENCY_BUCKETS_S, since_arrival_s)
        if not any(t.name == TOKEN_OUTPUT for t in outputs):
            return
        entry.tokens += 1
        if index == 0:
            _observe(entry.first_token, LATENCY_BUCKETS_S, since_arrival_s)
        elif since_previous_s is not None:
            _observe(entry.token_gap, TOKEN_GAP_BUCKETS_S, since_previous_s)

    def closed(self, model: str, version: str, responses: int) -> None:
        entry = self._model(model, version)
        entry.open -= 1
        _observe(entry.per_stream, RESPONSE_COUNT_BUCKETS, responses)

    def forwarded(self, gap_s: float) -> None:
        """A response written to its client ``gap_s`` after it arrived from its worker."""
        _observe(self.forward, FORWARD_BUCKETS_S, gap_s)

    def open_total(self) -> int:
        return sum(m.open for m in self._by_model.values())

    def items(self) -> list[tuple[tuple[str, str], ModelStreams]]:
        return sorted(self._by_model.items())
