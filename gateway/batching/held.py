"""How many requests of a model the gateway held at once, remembered a window back.

The burst hold (``gateway.batching.batcher``, adaptive mode) ends early once
closed-loop clients are all in: as many requests queued or running as the
most the previous window saw at once. Such clients send no more until they
are answered, so waiting longer only waits out the hold. A window that has
seen more than twice the previous one's most is not steady (a burst, or
load growing): then the hold runs as ever. Within twice, because
closed-loop clients are not all in the gateway at once in every window, and
a few more must not cost the rest of the window's holds.
"""

from __future__ import annotations

# The window over which the most requests held at once is remembered.
WINDOW_S = 1.0


class HeldPeak:
    """The most requests held at once in the current window and in the one before it."""

    __slots__ = ("_ends", "_now", "_before")

    def __init__(self) -> None:
        self._ends = 0.0
        self._now = 0
        self._before = 0

    def note(self, now: float, held: int) -> None:
        """``held`` requests (queued or running) at time ``now``."""
        if now >= self._ends:  # a new window; the one before it ended (or is long gone)
            self._before = self._now if now < self._ends + WINDOW_S else 0
            self._now = 0
            self._ends = now + WINDOW_S
        if held > self._now:
            self._now = held

    def steady(self) -> bool:
        """The last window held requests, and this one has not held more than twice as many at once."""
        return 0 < self._now <= 2 * self._before

    def all_in(self, held: int) -> bool:
        """Closed-loop clients all in: ``held`` reaches the last window's most, in a steady window."""
        return self.steady() and held >= self._before

    def missing(self, held: int) -> int | None:
        """How many more requests make all of them in (None when the window is not steady)."""
        return max(0, self._before - held) if self.steady() else None
