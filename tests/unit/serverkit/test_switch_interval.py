"""A serving process's GIL switch interval: shorter than Python's 5 ms default."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from serverkit.process import SWITCH_INTERVAL_MS, set_switch_interval


@pytest.fixture(autouse=True)
def restore() -> Iterator[None]:
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


def test_a_serving_process_hands_the_gil_over_within_half_a_millisecond() -> None:
    sys.setswitchinterval(0.005)
    set_switch_interval()
    assert SWITCH_INTERVAL_MS == 0.5
    assert sys.getswitchinterval() == pytest.approx(0.0005)
