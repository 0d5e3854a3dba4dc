"""Light models: batches that cost the worker little per row are better grown than spread.

A replica with several execution slots can run several batches of a model
at once. Filling every slot pays when a row costs the worker real compute
(a second core works while the first does); for a light model the fixed
cost of each call (the gateway's and the worker's per-call work, the round
trip) outweighs the rows, and a second concurrent batch mostly splits the
queue into two small batches that cost twice the calls. Measured on 2 cores
through the gateway at 16 / 64 single-row gRPC clients, one batch executing
per replica instead of one per slot: ``mlp`` 2,075 -> 3,582 req/s at 16,
the example ``cnn`` 1,785 -> 2,047 and 2,571 -> 2,822; the compute-bound
``cnn_large`` (about 5 ms a row on a core) lost a third of its rows at 8
clients (311 -> 198). The measured per-row cost tells them apart: under
1.2 ms a row for ``mlp`` and ``cnn``, 5 ms and more for ``cnn_large``.

:class:`RowCosts` keeps, per model, the recent successful worker calls'
time per row as the gateway sees it, and calls a model *light* while the
median is below the threshold (gateway setting ``light_row_ms``; 0 turns
the rule off) and *heavy* while it is not. Before ``min_samples`` calls a
model is neither: its first calls (one row each at low load, the dearest
per row) decide. The state keeps itself: a light model's batches grow and
its cost per row falls further; a heavy model's batches stay small and
their cost per row high.

A heavy model gets the other half of the rule: its replicas count as idle
until their waiting batch is there too (the router's busy bound is the
slots plus one), so the next batch is on the worker when a slot frees
instead of one gateway round trip later. Its rows cost the same whatever
the batch, so sending the waiting batch early costs nothing; in steady
state the batches are the rows that arrive during one execution either
way. Measured on 2 cores, ``cnn_large`` at 8 single-row clients: the
default kept 2 batches in flight 96% of the time (``/v2/cluster`` sampled
every 10 ms) and left 0.22 of the machine idle.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from gateway.routing.hedging import LatencyTracker

# How many new calls before a model's verdict is looked at again.
_REFRESH_EVERY = 32


class RowCosts:
    """Per model: the median worker time per row of recent calls, and whether it is light or heavy."""

    def __init__(self, threshold_s: float, *, window: int = 256, min_samples: int = 32,
                 timer: Callable[[], float] = time.perf_counter) -> None:
        if threshold_s < 0:
            raise ValueError("the light-model threshold must be >= 0 (0 = off)")
        self.threshold_s = threshold_s
        self.min_samples = min_samples
        # What the router times worker calls with: a fine clock (the event loop's
        # is in whole milliseconds under uvloop, as coarse as a light call).
        self.timer = timer
        self._per_row = LatencyTracker(window)
        # model -> (calls seen when judged, light)
        self._verdicts: dict[str, tuple[int, bool]] = {}

    def observe(self, model: str, seconds: float, rows: int) -> None:
        """One successful worker call of ``rows`` rows that took ``seconds``."""
        if self.threshold_s:
            self._per_row.observe(model, seconds / max(1, rows))

    def verdict(self, model: str) -> bool | None:
        """True: ``model`` is light now; False: heavy; None: not judged (too few calls, or the rule off)."""
        if not self.threshold_s:
            return None
        count = self._per_row.count(model)
        if count < self.min_samples:
            return None
        verdict = self._verdicts.get(model)
        if verdict is not None and count - verdict[0] < _REFRESH_EVERY:
            return verdict[1]
        median = self._per_row.percentile(model, 50.0)
        light = median is not None and median < self.threshold_s
        self._verdicts[model] = (count, light)
        return light

    def median_row_s(self, model: str) -> float | None:
        """The recent median worker time per row of ``model`` in seconds (None before any call)."""
        return self._per_row.percentile(model, 50.0)
