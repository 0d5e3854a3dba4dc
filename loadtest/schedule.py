"""Open-loop send schedules: when each request is due, as offsets from the start.

A run with R requests/s spread over P processes gives process i every P-th
send of the whole schedule. For ``constant`` that is exactly offsets
(i + P*k) / R, so the processes interleave into one evenly spaced stream. For
``poisson`` each process draws its own exponential gaps at rate R/P from its
own seed; merged independent Poisson streams are again a Poisson stream of
rate R. Schedules are plain iterators of floats: the agent turns them into
sends, and latency is measured from these due times, not from the actual
send, so a client or server that falls behind shows up as latency
(no coordinated omission).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np

from loadtest.config import Distribution

_CHUNK = 4096  # exponential gaps drawn per numpy call


def share(total: int, index: int, processes: int) -> int:
    """Process ``index``'s share when ``total`` units are split as evenly as possible."""
    return total // processes + (1 if index < total % processes else 0)


def constant_offsets(rate: float, index: int = 0, stride: int = 1) -> Iterator[float]:
    """Offsets (index + stride*k) / rate for k = 0, 1, 2, ..."""
    period = 1.0 / rate
    return ((index + stride * k) * period for k in itertools.count())


def poisson_offsets(rate: float, seed: int) -> Iterator[float]:
    """Offsets of a Poisson process of ``rate`` events/s (exponential gaps), seeded."""
    rng = np.random.default_rng(seed)
    elapsed = 0.0
    while True:
        for gap in rng.exponential(1.0 / rate, size=_CHUNK).tolist():
            elapsed += gap
            yield elapsed


def offsets(distribution: Distribution, total_rate: float, index: int, processes: int,
            seed: int, count: int = 0) -> Iterator[float]:
    """Process ``index``'s share of a schedule of ``total_rate`` requests/s.

    With ``count`` > 0, only this process's share of the first ``count``
    sends of the whole schedule.
    """
    if distribution is Distribution.CONSTANT:
        stream = constant_offsets(total_rate, index, processes)
    else:
        stream = poisson_offsets(total_rate / processes, seed)
    if count > 0:
        stream = itertools.islice(stream, share(count, index, processes))
    return stream
