"""gRPC server settings that let a ``grpc.aio`` server take a burst of calls.

gRPC core keeps every call that has arrived but that the application has not
yet asked for on a pending list. A ``grpc.aio`` server asks for calls one at
a time from its event loop, so a burst of thousands of concurrent calls (one
client channel is enough) outruns it and the list grows. Past
``grpc.server.max_pending_requests`` (1,000 by default) core drops calls at
random, and past ``grpc.server.max_pending_requests_hard_limit`` (3,000) it
drops them all; the client sees CANCELLED, which it cannot tell from its own
cancel, so it neither retries nor backs off. Measured with a bare server
that answers a prebuilt reply: 3,000 calls from one channel lost about 540,
10,000 calls from 16 channels about 3,600.

:data:`BURST_OPTIONS` lifts both limits so that every call reaches the
handlers, where the application answers it -- served, or refused at once
with UNAVAILABLE and a retry hint when its own bounds are reached (the
gateway's admission and model queues, a worker's model queue). Calls not
yet taken wait in gRPC core (their headers and message) only until the
handlers reach them, and a refusal takes far less time than a call; what
the process holds beyond that is bounded by the application's bounds.

Measured and not kept: ``grpc.max_concurrent_streams`` makes the server
reset the streams a client opens before it has read the limit (UNAVAILABLE
"Stream removed", no retry hint), and HTTP/2 ping and BDP settings change
nothing.
"""

from __future__ import annotations

# Far above any burst a process could hold: the application's bounds refuse long before.
_NO_PENDING_LIMIT = 2**30

BURST_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.server.max_pending_requests", _NO_PENDING_LIMIT),
    ("grpc.server.max_pending_requests_hard_limit", _NO_PENDING_LIMIT),
)
