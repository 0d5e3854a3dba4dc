"""When a call deserves a second attempt: hedging and hang thresholds per model.

:class:`LatencyTracker` keeps the recent latencies of successful attempts per
model; :class:`AttemptPolicy` turns them into the two thresholds the router's
calls (``gateway.routing.attempts.AttemptRace``) act on:

* the hang threshold, ``max(hang_min_s, hang_multiplier * p99)``: an attempt
  silent that long counts as a failure of its worker (found by time, not by
  errors) and gets a second attempt beside it on another replica;
* with hedging on (``percentile`` > 0), the hedge delay: that
  percentile of the model's latency (at least ``min_delay_s``), after
  which a second attempt starts beside the first whether or not it hangs.

Neither applies before a model has ``min_samples`` latencies: a model's first
calls are never judged slow. :class:`AttemptPolicy` also bundles what every
call shares: the outlier detector, the retry budget, the backoff.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol

from gateway.routing.outlier import OutlierDetector
from gateway.routing.retry_budget import Backoff, RetryBudget
from gateway.settings import HedgeSettings

log = logging.getLogger(__name__)

# Thresholds follow a model's latencies, recomputed after this many new ones.
_REFRESH_EVERY = 16

class Clock(Protocol):
    def now(self) -> float: ...

    async def sleep(self, s: float) -> None: ...


class LatencyTracker:
    """The latest ``window`` successful attempt latencies of each model, with percentiles.

    Sorted copies are rebuilt at most once per ``window // 8`` new samples,
    so asking for a percentile on every call costs a lookup, not a sort.
    """

    def __init__(self, window: int = 256) -> None:
        if window < 8:
            raise ValueError("window must be at least 8")
        self._window = window
        self._every = window // 8
        self._rings: dict[str, _Ring] = {}

    def observe(self, model: str, seconds: float) -> None:
        ring = self._rings.get(model)
        if ring is None:
            ring = self._rings[model] = _Ring(self._window)
        ring.add(seconds)

    def count(self, model: str) -> int:
        ring = self._rings.get(model)
        return 0 if ring is None else ring.total

    def percentile(self, model: str, pct: float) -> float | None:
        """The ``pct``-th percentile of the model's recent latencies; None with no samples."""
        ring = self._rings.get(model)
        if ring is None or not ring.values:
            return None
        ordered = ring.ordered(self._every)
        index = min(len(ordered) - 1, max(0, round(pct / 100 * len(ordered)) - 1))
        return ordered[index]


@dataclass(slots=True)
class _Ring:
    size: int
    values: list[float] = field(default_factory=list)
    next: int = 0
    total: int = 0
    _sorted: list[float] = field(default_factory=list)
    _sorted_at: int = 0

    def add(self, value: float) -> None:
        if len(self.values) < self.size:
            self.values.append(value)
        else:
            self.values[self.next] = value
        self.next = (self.next + 1) % self.size
        self.total += 1

    def ordered(self, every: int) -> list[float]:
        # A young ring re-sorts after each sample or few: thresholds matter most early on.
        stale = self.total - self._sorted_at
        if stale and stale >= max(1, min(every, len(self.values) // 8)):
            self._sorted = sorted(self.values)
            self._sorted_at = self.total
        return self._sorted


@dataclass(slots=True)
class AttemptPolicy:
    """What every call's race shares: the router's fault-handling state."""

    outliers: OutlierDetector
    budget: RetryBudget
    backoff: Backoff
    latency: LatencyTracker
    hedge: HedgeSettings
    retry_limit: int
    clock: Clock
    # Attempts running in this gateway now, every model's: the gateway's own load, under which an
    # attempt's latency is filed for outlier judging (its event loop answers later when busy).
    attempts_running: int = 0
    # model -> (samples seen when computed, hang threshold, hedge delay): read on
    # every call, recomputed only as new latencies come in.
    _thresholds: dict[str, tuple[int, float | None, float | None]] = field(default_factory=dict)

    def thresholds(self, model: str) -> tuple[float | None, float | None]:
        """``(hang threshold, hedge delay)`` of ``model`` in seconds; None where it does not apply."""
        count = self.latency.count(model)
        cached = self._thresholds.get(model)
        hedge = self.hedge
        if cached is not None and (count == cached[0] or (
                cached[0] >= hedge.min_samples and count - cached[0] < _REFRESH_EVERY)):
            return cached[1], cached[2]
        hang_s = hedge_s = None
        if count >= hedge.min_samples:
            if hedge.hang_multiplier:
                p99 = self.latency.percentile(model, 99.0) or 0.0
                hang_s = max(hedge.hang_min_s, hedge.hang_multiplier * p99)
            if hedge.percentile:
                p = self.latency.percentile(model, hedge.percentile) or 0.0
                hedge_s = max(hedge.min_delay_s, p)
        self._thresholds[model] = (count, hang_s, hedge_s)
        return hang_s, hedge_s
