"""Tests for protos/errors.py: the retry hint every refusal carries over gRPC."""

from __future__ import annotations

import pytest

from protos.errors import (
    DeadlineExceeded,
    InferGateError,
    InvalidArgument,
    Overloaded,
    QuotaExceeded,
    Unavailable,
    retry_metadata,
)


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (Overloaded("model 'm' queue is full (8 requests)"), {"retry-after": "1", "grpc-retry-pushback-ms": "1000"}),
        (Overloaded("full", retry_after_s=2.5), {"retry-after": "3", "grpc-retry-pushback-ms": "2500"}),
        (Overloaded("full", retry_after_s=0.2), {"retry-after": "1", "grpc-retry-pushback-ms": "200"}),
        (QuotaExceeded("too many requests", retry_after_s=4), {"retry-after": "4", "grpc-retry-pushback-ms": "4000"}),
        # UNAVAILABLE is "try again later" whatever the cause, so it always says when.
        (Unavailable("no healthy replica of model 'm'"), {"retry-after": "1", "grpc-retry-pushback-ms": "1000"}),
    ],
)
def test_refusals_carry_a_retry_hint(error: InferGateError, expected: dict[str, str]) -> None:
    assert dict(retry_metadata(error)) == expected


@pytest.mark.parametrize("error", [InvalidArgument("bad shape"), DeadlineExceeded("too late")])
def test_other_errors_carry_none(error: InferGateError) -> None:
    assert retry_metadata(error) == ()
