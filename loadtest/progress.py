"""Progress lines for long runs, on stderr: one per measurement window and level.

On a terminal each window overwrites the previous line; elsewhere (``--progress``
into a log) every line stays.
"""

from __future__ import annotations

import math
import sys
from typing import Protocol, TextIO

from loadtest.latency import Window
from loadtest.report import LevelResult


class Progress(Protocol):
    def level_started(self, mode: str, level: float) -> None: ...
    def window(self, mode: str, level: float, index: int, window: Window) -> None: ...
    def level_done(self, result: LevelResult) -> None: ...


class SilentProgress:
    def level_started(self, mode: str, level: float) -> None:
        pass

    def window(self, mode: str, level: float, index: int, window: Window) -> None:
        pass

    def level_done(self, result: LevelResult) -> None:
        pass


def _label(mode: str, level: float) -> str:
    return f"concurrency {level:g}" if mode == "concurrency" else f"{level:g} req/s"


class StreamProgress:
    def __init__(self, stream: TextIO = sys.stderr) -> None:
        self._stream = stream
        self._tty = stream.isatty()

    def _line(self, text: str, final: bool) -> None:
        if self._tty:
            self._stream.write("\r\x1b[2K" + text + ("\n" if final else ""))
        else:
            self._stream.write(text + "\n")
        self._stream.flush()

    def level_started(self, mode: str, level: float) -> None:
        self._line(f"[{_label(mode, level)}] measuring...", final=False)

    def window(self, mode: str, level: float, index: int, window: Window) -> None:
        rate = window.ok / window.duration_s if window.duration_s > 0 else math.nan
        p99 = window.percentile_s(99) * 1000.0
        self._line(f"[{_label(mode, level)}] window {index + 1}: {rate:,.1f} req/s, p99 {p99:.2f} ms, "
                   f"errors {window.error_count}", final=False)

    def level_done(self, result: LevelResult) -> None:
        state = "stable" if result.stable else ("stopped" if result.interrupted else "not stable")
        cpu = " ".join(f"{c:.0%}" for c in result.client_cpu)
        self._line(f"[{_label(result.mode, result.level)}] {result.throughput_rps:,.1f} req/s, "
                   f"p99 {result.latency.p99_us / 1000.0:.2f} ms, errors {result.error_count} "
                   f"({state}, {result.windows} window(s), client CPU {cpu})", final=True)
