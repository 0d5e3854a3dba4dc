"""End-to-end latency of successful requests, per model, as histograms.

The core observes each request's time here (fixed buckets, plain ints, no
locks: only the event loop touches them); ``metrics`` exports them.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# End-to-end latency buckets in seconds: six per decade (1, 1.5, 2, 3, 5, 7),
# 100 us to 70 s, fine enough for a dashboard to read p50/p99 from them.
LATENCY_BUCKETS_S: tuple[float, ...] = tuple(
    round(m * 10.0**e, 6) for e in range(-4, 2) for m in (1, 1.5, 2, 3, 5, 7)
)

@dataclass(slots=True)
class Histogram:
    """Counts per bucket (not cumulative; the last one is +Inf) and the sum of observations."""

    counts: list[int]
    sum: float = 0.0

    @property
    def count(self) -> int:
        return sum(self.counts)


@dataclass(slots=True)
class LatencyHistograms:
    """End-to-end latency of successful requests, per (model, version)."""

    bounds: tuple[float, ...] = LATENCY_BUCKETS_S
    _by_model: dict[tuple[str, str], Histogram] = field(default_factory=dict)

    def observe(self, model: str, version: str, seconds: float) -> None:
        key = (model, version)
        h = self._by_model.get(key)
        if h is None:
            h = self._by_model[key] = Histogram([0] * (len(self.bounds) + 1))
        # bisect_left: a value equal to a bound falls in that bound's bucket (le).
        h.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        h.sum += seconds

    def get(self, model: str, version: str) -> Histogram | None:
        return self._by_model.get((model, version))

    def items(self) -> list[tuple[tuple[str, str], Histogram]]:
        return sorted(self._by_model.items())
