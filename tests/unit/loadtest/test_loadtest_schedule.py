"""Open-loop schedule math of the bench."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from loadtest.config import Distribution
from loadtest.schedule import constant_offsets, offsets, poisson_offsets, share


def test_constant_schedule_is_evenly_spaced() -> None:
    got = list(itertools.islice(constant_offsets(200.0), 5))
    assert got == pytest.approx([0.0, 0.005, 0.010, 0.015, 0.020])


@pytest.mark.parametrize("processes", [2, 3, 4])
def test_constant_shares_interleave_into_one_stream(processes: int) -> None:
    count = 103
    streams = [list(offsets(Distribution.CONSTANT, 1000.0, i, processes, seed=0, count=count))
               for i in range(processes)]
    assert [len(s) for s in streams] == [share(count, i, processes) for i in range(processes)]
    merged = sorted(itertools.chain.from_iterable(streams))
    assert merged == pytest.approx([k / 1000.0 for k in range(count)])


def test_poisson_schedule_rate_and_seed() -> None:
    a = list(itertools.islice(poisson_offsets(500.0, seed=1), 20_000))
    b = list(itertools.islice(poisson_offsets(500.0, seed=1), 20_000))
    c = list(itertools.islice(poisson_offsets(500.0, seed=2), 20_000))
    assert a == b and a != c
    gaps = np.diff([0.0] + a)
    assert np.all(gaps > 0)
    assert gaps.mean() == pytest.approx(1 / 500.0, rel=0.05)
    # Exponential gaps: the standard deviation equals the mean (constant gaps would give 0).
    assert gaps.std() == pytest.approx(gaps.mean(), rel=0.1)


def test_poisson_shares_add_up_to_the_total_rate() -> None:
    streams = [list(itertools.takewhile(lambda t: t < 20.0, offsets(Distribution.POISSON, 400.0, i, 4, seed=10 + i)))
               for i in range(4)]
    assert sum(len(s) for s in streams) / 20.0 == pytest.approx(400.0, rel=0.05)
    assert len({tuple(s[:5]) for s in streams}) == 4  # independent seeds


def test_share() -> None:
    assert [share(10, i, 3) for i in range(3)] == [4, 3, 3]
    assert sum(share(7, i, 7) for i in range(7)) == 7
    assert [share(2, i, 4) for i in range(4)] == [1, 1, 0, 0]
