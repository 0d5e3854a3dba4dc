"""Tests for gateway/limits.py: the gateway-wide admission bounds (requests,
bytes, the priority reserve) and the HTTP timeout header; and the validation
of the reliability config keys.
"""

from __future__ import annotations

import pytest

from gateway.config import load_config
from gateway.limits import TIMEOUT_HEADER, Admission, apply_timeout_header
from gateway.settings import AdmissionSettings, ConfigError
from gateway.types import InferRequest, Tensor
from protos.errors import InvalidArgument, Overloaded


def req(nbytes: int = 4, priority: int = 0) -> InferRequest:
    return InferRequest("m", "", "id", [Tensor("X", "UINT8", (nbytes,), b"\0" * nbytes)], [], priority=priority)


def test_request_bound_rejects_at_once_with_a_retry_hint() -> None:
    admission = Admission(AdmissionSettings(max_inflight_requests=10, priority_reserve_percent=20.0))
    tickets = [admission.admit(req()) for _ in range(8)]
    with pytest.raises(Overloaded, match="limit of 8 requests in flight for this priority") as info:
        admission.admit(req())
    assert info.value.retry_after_s > 0 and info.value.http_status == 503
    # The reserve takes only the highest priority.
    tickets += [admission.admit(req(priority=1)) for _ in range(2)]
    with pytest.raises(Overloaded, match="limit of 10 requests"):
        admission.admit(req(priority=1))
    counters = admission.counters()
    assert (counters.inflight_requests, counters.admitted, counters.rejected) == (10, 10, 2)
    for t in tickets:
        t.release()
        t.release()  # idempotent: released once
    assert admission.counters().inflight_requests == 0
    with admission.admit(req()):
        assert admission.counters().inflight_requests == 1
    assert admission.counters().inflight_requests == 0


def test_byte_bound_counts_input_tensors() -> None:
    admission = Admission(AdmissionSettings(max_inflight_requests=0, max_inflight_bytes=100))
    first = admission.admit(req(60))
    with pytest.raises(Overloaded, match="100 bytes"):
        admission.admit(req(60))
    small = admission.admit(req(40))
    assert admission.counters().inflight_bytes == 100
    first.release()
    small.release()
    # Alone, a request larger than the whole bound still runs (or it never could).
    with admission.admit(req(500)):
        assert admission.counters().inflight_bytes == 500


def test_no_bounds_when_zero() -> None:
    admission = Admission(AdmissionSettings(max_inflight_requests=0, max_inflight_bytes=0))
    tickets = [admission.admit(req(10**6)) for _ in range(1000)]
    assert admission.counters().inflight_requests == 1000
    for t in tickets:
        t.release()


def test_timeout_header_tightens_the_deadline_only() -> None:
    r = req()
    apply_timeout_header(r, None, 100.0)
    assert r.deadline is None
    apply_timeout_header(r, " 250 ", 100.0)
    assert r.deadline == pytest.approx(100.25)
    apply_timeout_header(r, "1000.5", 100.0)  # later than the one it has: no change
    assert r.deadline == pytest.approx(100.25)
    for bad in ("", "abc", "-5", "0", "nan", "inf", "1e30"):
        with pytest.raises(InvalidArgument, match=TIMEOUT_HEADER):
            apply_timeout_header(req(), bad, 0.0)


def test_config_keys_are_validated() -> None:
    config = load_config(None, admission={"max_inflight_requests": 5}, hedge={"percentile": 99},
                         outlier={"consecutive_failures": 7})
    assert (config.admission.max_inflight_requests, config.hedge.percentile,
            config.outlier.consecutive_failures) == (5, 99.0, 7)
    for group, key, value in (("admission", "max_inflight_requests", -1),
                              ("admission", "priority_reserve_percent", 100), ("hedge", "percentile", 20),
                              ("outlier", "max_ejection_percent", 101), ("retry", "budget_percent", -1),
                              ("outlier", "latency_factor", 0.5), ("hedge", "hang_min_s", 0)):
        with pytest.raises(ConfigError, match=f"{group}.{key}"):
            load_config(None, **{group: {key: value}})
