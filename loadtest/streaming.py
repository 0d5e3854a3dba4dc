"""What a streamed request is measured by: its timestamps, and their statistics.

A decoupled model answers one request with zero or more responses. The bench
records, per request, the instant it was sent and the arrival instant of every
response carrying data (a :class:`StreamRecord`; the empty final response that
only marks the end is not a response). From those it derives, as
perf_analyzer and its LLM front end do:

- time to first response: first arrival - send (a request with no data
  response has none);
- time between responses: the gap between consecutive arrivals of one
  request (a request with n responses gives n - 1 gaps);
- responses/s and requests/s: data responses and completed requests of the
  requests that finished inside the measured span, over that span.

:class:`StreamWindow` accumulates records of one measurement window; windows
merge by concatenation, so percentiles are exact (nearest rank, as in
``loadtest.latency``). Everything here is pure arithmetic on timestamps, so
tests drive it with made-up clocks.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from loadtest.latency import nearest_rank, within

STREAM_PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class StreamRecord:
    """One streamed request: when it was sent, when each data response arrived, how it ended."""

    sent_s: float
    arrivals_s: list[float] = field(default_factory=list)
    done_s: float = math.nan  # the final response (or the error) arrived
    error: str | None = None  # an error kind; None once it ended with its final response

    @property
    def responses(self) -> int:
        return len(self.arrivals_s)

    def first_response_s(self) -> float | None:
        return self.arrivals_s[0] - self.sent_s if self.arrivals_s else None

    def gaps_s(self) -> list[float]:
        return [b - a for a, b in zip(self.arrivals_s, self.arrivals_s[1:], strict=False)]


@dataclass(slots=True)
class StreamWindow:
    """The requests that completed in one window: their TTFR and inter-response samples and counts."""

    first_response: array = field(default_factory=lambda: array("d"))
    between_responses: array = field(default_factory=lambda: array("d"))
    requests: int = 0  # completed without error
    responses: int = 0  # data responses of those requests
    errors: dict[str, int] = field(default_factory=dict)
    duration_s: float = 0.0

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    def add(self, record: StreamRecord) -> None:
        if record.error is not None:
            self.errors[record.error] = self.errors.get(record.error, 0) + 1
            return
        self.requests += 1
        self.responses += record.responses
        first = record.first_response_s()
        if first is not None:
            self.first_response.append(first)
        self.between_responses.extend(record.gaps_s())

    def absorb(self, other: StreamWindow) -> None:
        """Append a later window (durations add up)."""
        self.first_response.extend(other.first_response)
        self.between_responses.extend(other.between_responses)
        self.requests += other.requests
        self.responses += other.responses
        for kind, count in other.errors.items():
            self.errors[kind] = self.errors.get(kind, 0) + count
        self.duration_s += other.duration_s

    def mean_first_response_s(self) -> float:
        return float(np.frombuffer(self.first_response, dtype=np.float64).mean()) if self.first_response else math.nan


def window_of(records: Iterable[StreamRecord], start_s: float, end_s: float) -> StreamWindow:
    """The records that completed in [start_s, end_s), as one window of that length."""
    window = StreamWindow(duration_s=end_s - start_s)
    for record in records:
        if start_s <= record.done_s < end_s:
            window.add(record)
    return window


def concat_windows(windows: Iterable[StreamWindow]) -> StreamWindow:
    out = StreamWindow()
    for w in windows:
        out.absorb(w)
    return out


def stream_stable(windows: Sequence[StreamWindow], tolerance_pct: float) -> bool:
    """perf_analyzer's rule on streams: responses/s and mean TTFR agree within the tolerance."""
    if not windows or any(w.requests == 0 or w.duration_s <= 0 for w in windows):
        return False
    rates = [w.responses / w.duration_s for w in windows]
    firsts = [w.mean_first_response_s() for w in windows]
    if all(math.isnan(f) for f in firsts):  # only empty answers: throughput alone decides
        return within(rates, tolerance_pct)
    return within(rates, tolerance_pct) and within(firsts, tolerance_pct)


@dataclass(frozen=True, slots=True)
class Percentiles:
    """p50/p90/p99 (and mean, max) of a sample set, in microseconds; NaN when empty."""

    count: int
    mean_us: float
    p50_us: float
    p90_us: float
    p99_us: float
    max_us: float


def percentiles(samples_s: array | Sequence[float]) -> Percentiles:
    values = np.sort(np.frombuffer(samples_s, dtype=np.float64) if isinstance(samples_s, array)
                     else np.asarray(samples_s, dtype=np.float64)) * 1e6
    if values.size == 0:
        return Percentiles(0, math.nan, math.nan, math.nan, math.nan, math.nan)
    p50, p90, p99 = (nearest_rank(values, p) for p in STREAM_PERCENTILES)
    return Percentiles(int(values.size), float(values.mean()), p50, p90, p99, float(values[-1]))


@dataclass(frozen=True, slots=True)
class StreamLevelResult:
    """One concurrency level (open streams) of a streaming run."""

    level: int  # streams open at once
    requests: int  # completed requests measured
    responses: int  # their data responses
    errors: dict[str, int]
    duration_s: float
    requests_per_s: float
    responses_per_s: float
    first_response: Percentiles  # time to first response
    between_responses: Percentiles  # time between consecutive responses of one request
    stable: bool
    windows: int
    interrupted: bool = False

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    @property
    def responses_per_request(self) -> float:
        return self.responses / self.requests if self.requests else math.nan


def stream_level_result(level: int, window: StreamWindow, *, stable: bool, windows: int,
                        interrupted: bool = False) -> StreamLevelResult:
    duration = window.duration_s
    return StreamLevelResult(
        level=level,
        requests=window.requests,
        responses=window.responses,
        errors=dict(sorted(window.errors.items())),
        duration_s=duration,
        requests_per_s=window.requests / duration if duration > 0 else math.nan,
        responses_per_s=window.responses / duration if duration > 0 else math.nan,
        first_response=percentiles(window.first_response),
        between_responses=percentiles(window.between_responses),
        stable=stable,
        windows=windows,
        interrupted=interrupted,
    )
