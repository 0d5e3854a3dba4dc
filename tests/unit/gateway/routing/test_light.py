"""Tests for gateway/routing/light.py: which models count as light, from their calls' time per row."""

from __future__ import annotations

import pytest

from gateway.routing.light import RowCosts


def feed(costs: RowCosts, model: str, calls: int, seconds: float, rows: int) -> None:
    for _ in range(calls):
        costs.observe(model, seconds, rows)


def test_a_model_is_light_once_enough_calls_cost_little_per_row() -> None:
    costs = RowCosts(0.002, min_samples=32)
    feed(costs, "m", 31, 0.004, 8)  # 0.5 ms a row, but too few calls to judge
    assert costs.verdict("m") is None
    feed(costs, "m", 1, 0.004, 8)
    assert costs.verdict("m") is True
    assert costs.median_row_s("m") == pytest.approx(0.0005)
    # The same call time for one row each is 4 ms a row: heavy.
    feed(costs, "h", 64, 0.004, 1)
    assert costs.verdict("h") is False
    assert costs.median_row_s("unknown") is None and costs.verdict("unknown") is None


def test_the_verdict_follows_the_recent_median_not_the_first_calls() -> None:
    costs = RowCosts(0.002, window=64, min_samples=32)
    feed(costs, "m", 64, 0.001, 1)
    assert costs.verdict("m") is True
    feed(costs, "m", 31, 0.010, 1)  # not yet a majority of the window, nor a refresh
    assert costs.verdict("m") is True
    feed(costs, "m", 33, 0.010, 1)  # the window is now all 10 ms a row
    assert costs.verdict("m") is False


def test_zero_turns_the_rule_off_and_negative_is_refused() -> None:
    off = RowCosts(0.0, min_samples=1)
    feed(off, "m", 100, 0.0001, 64)
    assert off.verdict("m") is None and off.median_row_s("m") is None
    with pytest.raises(ValueError, match=">= 0"):
        RowCosts(-1.0)
