"""Percentiles, window merging and the stability rule of the bench."""

from __future__ import annotations

import math
from array import array

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loadtest.latency import Window, concat, is_stable, nearest_rank, summarize, within


def test_nearest_rank_small_cases() -> None:
    values = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0]
    assert nearest_rank(values, 50) == 5.0
    assert nearest_rank(values, 90) == 9.0
    assert nearest_rank(values, 95) == 10.0
    assert nearest_rank(values, 99) == 10.0
    assert nearest_rank(values, 100) == 10.0
    assert nearest_rank(values, 1) == 1.0
    assert nearest_rank([7.0], 50) == 7.0
    assert math.isnan(nearest_rank([], 50))
    hundred = [float(i) for i in range(1, 101)]
    assert [nearest_rank(hundred, p) for p in (50, 90, 95, 99)] == [50.0, 90.0, 95.0, 99.0]


@given(st.lists(st.floats(min_value=0, max_value=1e3, allow_nan=False), min_size=1, max_size=300),
       st.floats(min_value=0.1, max_value=100))
def test_nearest_rank_definition(values: list[float], pct: float) -> None:
    ordered = sorted(values)
    got = nearest_rank(ordered, pct)
    assert got in ordered
    # At least pct% of the values are <= it, and fewer than pct% are strictly below it.
    n = len(ordered)
    assert sum(v <= got for v in ordered) >= pct / 100 * n - 1e-6
    assert sum(v < got for v in ordered) < pct / 100 * n + 1e-6


def test_summarize_in_microseconds() -> None:
    samples = array("d", [0.001 * i for i in range(1, 101)])  # 1..100 ms
    s = summarize(samples)
    assert s.count == 100
    assert s.p50_us == pytest.approx(50_000)
    assert s.p99_us == pytest.approx(99_000)
    assert s.max_us == pytest.approx(100_000) and s.min_us == pytest.approx(1_000)
    assert s.mean_us == pytest.approx(50_500)
    empty = summarize(array("d"))
    assert empty.count == 0 and math.isnan(empty.p50_us)


def test_window_absorb_and_concat() -> None:
    a = Window(array("d", [0.1, 0.2]), {"timeout": 1}, duration_s=1.0, max_send_lag_s=0.01)
    b = Window(array("d", [0.3]), {"timeout": 2, "UNAVAILABLE": 1}, duration_s=1.0, max_send_lag_s=0.05)
    a.absorb(b)  # two processes, same span
    assert a.ok == 3 and a.errors == {"timeout": 3, "UNAVAILABLE": 1} and a.duration_s == 1.0
    assert a.max_send_lag_s == 0.05
    joined = concat([a, Window(array("d", [0.4]), {}, duration_s=1.0)])  # consecutive spans
    assert joined.ok == 4 and joined.duration_s == 2.0 and joined.error_count == 4


def _window(n: int, latency_s: float) -> Window:
    return Window(array("d", [latency_s] * n), {}, duration_s=1.0)


def test_stability_rule() -> None:
    assert within([100, 105, 95], 10)
    assert not within([100, 130, 95], 10)
    assert is_stable([_window(100, 0.01), _window(104, 0.0101), _window(97, 0.0099)], 10)
    assert not is_stable([_window(100, 0.01), _window(150, 0.01), _window(100, 0.01)], 10)  # throughput moved
    assert not is_stable([_window(100, 0.01), _window(100, 0.02), _window(100, 0.01)], 10)  # latency moved
    assert not is_stable([_window(100, 0.01), _window(0, 0.01), _window(100, 0.01)], 10)  # an empty window


@given(st.lists(st.floats(min_value=0, max_value=10, allow_nan=False), min_size=1, max_size=200),
       st.sampled_from([1, 50, 90, 99, 100]))
def test_window_percentile_matches_sorted_nearest_rank(values: list[float], pct: int) -> None:
    window = Window(array("d", values))
    assert window.percentile_s(pct) == nearest_rank(sorted(values), pct)
    assert window.mean_s() == pytest.approx(sum(values) / len(values))
