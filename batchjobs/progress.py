"""The progress line of an offline batch job: rows done, rows/s, ETA (on stderr).

Owns the rate estimate (rows over a sliding window of recent seconds, so a
resumed job or a slow start does not skew it) and the rendering: redrawn in
place on a terminal, a plain line every few seconds otherwise (log files).
The clock is injectable for tests.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable
from typing import TextIO

_WINDOW_S = 10.0
_BAR_WIDTH = 24


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"


class Progress:
    def __init__(self, total: int, done: int = 0, *, label: str = "", stream: TextIO | None = None,
                 enabled: bool = True, clock: Callable[[], float] = time.monotonic) -> None:
        self.total = total
        self.done = done
        self.bad = 0
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.clock = clock
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval_s = 0.2 if self.tty else 5.0
        now = clock()
        self._samples: deque[tuple[float, int]] = deque([(now, done)])
        self._last_draw = now

    def advance(self, rows: int, bad: int = 0) -> None:
        self.done += rows
        self.bad += bad
        now = self.clock()
        self._samples.append((now, self.done))
        while len(self._samples) > 2 and now - self._samples[0][0] > _WINDOW_S:
            self._samples.popleft()
        if self.enabled and now - self._last_draw >= self.interval_s:
            self._last_draw = now
            self._draw()

    def rate(self) -> float:
        """Rows per second over the recent window (0 until two samples differ in time)."""
        (t0, r0), (t1, r1) = self._samples[0], self._samples[-1]
        return (r1 - r0) / (t1 - t0) if t1 > t0 else 0.0

    def line(self) -> str:
        fraction = self.done / self.total if self.total else 1.0
        filled = int(fraction * _BAR_WIDTH)
        bar = "#" * filled + "-" * (_BAR_WIDTH - filled)
        rate = self.rate()
        eta = format_duration((self.total - self.done) / rate) if rate > 0 else "?"
        label = f"{self.label} " if self.label else ""
        bad = f"  bad {self.bad:,}" if self.bad else ""
        return (f"{label}[{bar}] {fraction * 100:5.1f}%  {self.done:,}/{self.total:,} rows  "
                f"{rate:,.0f} rows/s  ETA {eta}{bad}")

    def _draw(self) -> None:
        if self.tty:
            self.stream.write("\r" + self.line() + "\x1b[K")
        else:
            self.stream.write(self.line() + "\n")
        self.stream.flush()

    def finish(self) -> None:
        if self.enabled:
            self._draw()
            if self.tty:
                self.stream.write("\n")
                self.stream.flush()
