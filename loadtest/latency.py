"""Latency samples: the per-window accumulator, merging, percentiles, stability.

A :class:`Window` holds the latency of every successful request that completed
in one measurement window (seconds, float64, in a compact ``array``) and the
errors by kind. Windows from several processes and several windows merge by
concatenation, so percentiles of a merged window are exact, not estimated
from histograms. Percentiles use the nearest-rank definition (the value at
rank ceil(p/100 * n)), so p100 is the maximum and every reported value is a
latency some request really had.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 95, 99)


@dataclass(slots=True)
class Window:
    """Requests completed in one window (or one process's share of it)."""

    samples: array = field(default_factory=lambda: array("d"))
    errors: dict[str, int] = field(default_factory=dict)
    duration_s: float = 0.0
    # Open loop: the worst delay between a request's scheduled and actual send.
    max_send_lag_s: float = 0.0

    @property
    def ok(self) -> int:
        return len(self.samples)

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    def add_error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1

    def absorb(self, other: Window) -> None:
        """Add another process's share of the same time span."""
        self.samples.extend(other.samples)
        for kind, count in other.errors.items():
            self.errors[kind] = self.errors.get(kind, 0) + count
        self.duration_s = max(self.duration_s, other.duration_s)
        self.max_send_lag_s = max(self.max_send_lag_s, other.max_send_lag_s)

    def mean_s(self) -> float:
        return float(np.frombuffer(self.samples, dtype=np.float64).mean()) if self.samples else math.nan

    def percentile_s(self, pct: float) -> float:
        """One nearest-rank percentile in O(n), cheap enough to run between windows."""
        n = len(self.samples)
        if n == 0:
            return math.nan
        rank = min(n, max(1, math.ceil(pct / 100.0 * n - 1e-9)))
        return float(np.partition(np.frombuffer(self.samples, dtype=np.float64), rank - 1)[rank - 1])


def concat(windows: Iterable[Window]) -> Window:
    """Consecutive windows as one: samples and errors joined, durations summed."""
    out = Window()
    for w in windows:
        out.samples.extend(w.samples)
        for kind, count in w.errors.items():
            out.errors[kind] = out.errors.get(kind, 0) + count
        out.duration_s += w.duration_s
        out.max_send_lag_s = max(out.max_send_lag_s, w.max_send_lag_s)
    return out


@dataclass(frozen=True, slots=True)
class LatencySummary:
    """Latency of the successful requests of a level, in microseconds."""

    count: int
    mean_us: float
    p50_us: float
    p90_us: float
    p95_us: float
    p99_us: float
    max_us: float
    min_us: float


def nearest_rank(sorted_values: Sequence[float] | np.ndarray, pct: float) -> float:
    """The nearest-rank percentile of ascending values (NaN when empty)."""
    n = len(sorted_values)
    if n == 0:
        return math.nan
    rank = max(1, math.ceil(pct / 100.0 * n - 1e-9))
    return float(sorted_values[min(rank, n) - 1])


def summarize(samples_s: Sequence[float] | array) -> LatencySummary:
    values = np.sort(np.frombuffer(samples_s, dtype=np.float64) if isinstance(samples_s, array)
                     else np.asarray(samples_s, dtype=np.float64)) * 1e6
    if values.size == 0:
        nan = math.nan
        return LatencySummary(0, nan, nan, nan, nan, nan, nan, nan)
    p50, p90, p95, p99 = (nearest_rank(values, p) for p in PERCENTILES)
    return LatencySummary(
        count=int(values.size),
        mean_us=float(values.mean()),
        p50_us=p50, p90_us=p90, p95_us=p95, p99_us=p99,
        max_us=float(values[-1]),
        min_us=float(values[0]),
    )  # fmt: skip


def within(values: Sequence[float], tolerance_pct: float) -> bool:
    """True when every value lies within tolerance_pct percent of their mean."""
    if not values or any(math.isnan(v) for v in values):
        return False
    mean = sum(values) / len(values)
    return all(abs(v - mean) <= abs(mean) * tolerance_pct / 100.0 for v in values)


def is_stable(windows: Sequence[Window], tolerance_pct: float) -> bool:
    """perf_analyzer's rule: throughput and mean latency of each window agree within the tolerance."""
    if not windows or any(w.ok == 0 or w.duration_s <= 0 for w in windows):
        return False
    rates = [w.ok / w.duration_s for w in windows]
    latencies = [w.mean_s() for w in windows]
    return within(rates, tolerance_pct) and within(latencies, tolerance_pct)
