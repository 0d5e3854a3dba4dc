"""Gateway-wide bounds on admitted work, and how long a request may live.

:class:`Admission` bounds what the gateway holds at once across every model:
``max_inflight_requests`` requests and ``max_inflight_bytes`` bytes of input
tensors, from the moment the core accepts a request to its answer. Beyond
either bound a request is refused at once with ``Overloaded`` (HTTP 503 /
gRPC UNAVAILABLE, with a Retry-After hint) -- it is never queued -- so the
memory the gateway holds for requests is bounded whatever the offered load.
The per-model queues (``max_queue_size``) bound each model inside that.

Priorities shed lowest first: the last ``priority_reserve_percent`` of the
request bound is kept for requests of the highest priority (``priority`` 1,
Triton's highest level); requests of any other priority (0, the model's
default, included) are refused once the rest is taken.

Deadlines: a request lives at most until the first of its gRPC deadline, its
``timeout`` parameter (microseconds, as Triton's), the
``X-Request-Timeout-Ms`` HTTP header (:data:`TIMEOUT_HEADER`, read by
:func:`apply_timeout_header`) and the gateway's ``default_timeout_s``; the
batcher answers it with DEADLINE_EXCEEDED / 504 when that passes, queued or
running, and the router gives each worker call only the time that is left.

Everything runs on the gateway's event loop: counters, no locks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Self

from gateway.settings import AdmissionSettings
from gateway.types import InferRequest
from protos.errors import InvalidArgument, Overloaded

# Triton defines no HTTP timeout header; this one takes milliseconds (an integer or a decimal).
TIMEOUT_HEADER = "X-Request-Timeout-Ms"
# Longest timeout a client may ask for through the header (a day): beyond is a typo.
_MAX_HEADER_TIMEOUT_MS = 86_400_000.0


@dataclass(frozen=True, slots=True)
class AdmissionCounters:
    inflight_requests: int
    inflight_bytes: int
    admitted: int
    rejected: int


class Ticket:
    """One admitted request's share of the bounds; release it exactly once (a context manager)."""

    __slots__ = ("_admission", "_bytes", "_released")

    def __init__(self, admission: Admission, nbytes: int) -> None:
        self._admission = admission
        self._bytes = nbytes
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._admission._release(self._bytes)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Admission:
    """The gateway-wide bounds (see the module docstring)."""

    def __init__(self, settings: AdmissionSettings | None = None) -> None:
        self.settings = settings or AdmissionSettings()
        limit = self.settings.max_inflight_requests
        # Requests of ordinary priority stop here; the rest of the bound is the reserve.
        self._ordinary_limit = math.ceil(limit * (1 - self.settings.priority_reserve_percent / 100)) if limit else 0
        self._requests = 0
        self._bytes = 0
        self._admitted = 0
        self._rejected = 0

    def admit(self, request: InferRequest) -> Ticket:
        """A ticket for ``request``, or ``Overloaded`` at once when a bound is reached."""
        return self.admit_bytes(sum(memoryview(t.data).nbytes for t in request.inputs), request.priority)

    def admit_bytes(self, nbytes: int, priority: int = 0) -> Ticket:
        """A ticket for a request of ``nbytes`` at ``priority`` (a relayed call: its message's size)."""
        settings = self.settings
        limit = settings.max_inflight_requests
        if limit:
            bound = limit if priority == 1 else self._ordinary_limit
            if self._requests >= bound:
                self._rejected += 1
                raise Overloaded(
                    f"the gateway is at its limit of {bound} requests in flight"
                    + ("" if bound == limit else " for this priority"),
                    retry_after_s=settings.retry_after_s,
                )
        byte_limit = settings.max_inflight_bytes
        # One request larger than the whole bound still runs alone, or it never could.
        if byte_limit and self._bytes and self._bytes + nbytes > byte_limit:
            self._rejected += 1
            raise Overloaded(f"the gateway holds its limit of {byte_limit} bytes of requests in flight",
                             retry_after_s=settings.retry_after_s)
        self._requests += 1
        self._bytes += nbytes
        self._admitted += 1
        return Ticket(self, nbytes)

    def _release(self, nbytes: int) -> None:
        self._requests -= 1
        self._bytes -= nbytes

    def counters(self) -> AdmissionCounters:
        return AdmissionCounters(self._requests, self._bytes, self._admitted, self._rejected)


def apply_timeout_header(request: InferRequest, value: str | None, now: float) -> None:
    """Tighten ``request.deadline`` to ``value`` milliseconds after ``now`` (the header's value).

    A malformed, negative or absurd value is the client's error (400).
    """
    if value is None:
        return
    text = value.strip()
    try:
        timeout_ms = float(text)
    except ValueError:
        timeout_ms = math.nan
    if not math.isfinite(timeout_ms) or timeout_ms <= 0 or timeout_ms > _MAX_HEADER_TIMEOUT_MS:
        raise InvalidArgument(
            f"{TIMEOUT_HEADER} must be a positive number of milliseconds up to {_MAX_HEADER_TIMEOUT_MS:.0f}, "
            f"got {value[:40]!r}"
        )
    deadline = now + timeout_ms / 1000.0
    request.deadline = deadline if request.deadline is None else min(deadline, request.deadline)
