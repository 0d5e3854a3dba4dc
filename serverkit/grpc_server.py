"""gRPC settings shared by infergate's servers and the gateway's channels to
its workers: a burst of calls taken in full, and keepalive pings that servers
accept.

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


# ---- keepalive -----------------------------------------------------------------
#
# The gateway's channels to a worker ping its connection when it has been
# silent for the keepalive time while calls are open, and close it when a ping
# goes unanswered: a cut link (no reset, no refusal) is found in seconds, not
# after TCP's retransmission timer. A gRPC server counts a ping that comes
# sooner than its ``grpc.http2.min_ping_interval_without_data_ms`` (gRPC
# core's GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS) after
# the previous one with no data between (5 min by default, 2 h while it has
# no call open unless ``grpc.keepalive_permit_without_calls``) as a strike,
# and past ``grpc.http2.max_ping_strikes`` (2) it answers GOAWAY
# ENHANCE_YOUR_CALM "too_many_pings" and drops the connection with every
# call on it. The gateway's packed stream call to a worker stays open while
# idle, so its pings (every 10 s against the defaults) were refused after a
# few silent periods and a healthy worker was marked DOWN within minutes of
# light streaming. The client's periods and the servers' limits are set
# here, together. The channels keep gRPC's default
# ``grpc.http2.max_pings_without_data`` (2 pings with no data between, then
# none until data flows): within a Triton server's 2 strikes even at a short
# keepalive time, where an unbounded channel is told GOAWAY on a silent
# stream (tests/integration/gateway/test_keepalive.py).

# How long an infergate worker's connection may be silent, with calls open, before the gateway pings it.
KEEPALIVE_TIME_MS = 10_000
# How long the gateway waits for a ping's answer before it closes the connection.
KEEPALIVE_TIMEOUT_MS = 5_000
# The shortest keepalive time a gateway may be configured with: twice what the servers accept.
MIN_KEEPALIVE_TIME_MS = 1_000
# What infergate's gRPC servers (workers, the gateway) accept: a ping every half second, with or without calls.
MIN_RECV_PING_INTERVAL_MS = MIN_KEEPALIVE_TIME_MS // 2
# A Triton server with its defaults (``--grpc-http2-min-recv-ping-interval-without-data``
# 300000, ``--grpc-http2-max-ping-strikes`` 2) refuses pings less than 300 s apart.
TRITON_MIN_RECV_PING_INTERVAL_MS = 300_000
TRITON_KEEPALIVE_TIME_MS = TRITON_MIN_RECV_PING_INTERVAL_MS + 10_000

# The gateway's own server, open to any client: pings as often as a gateway sends its workers are
# accepted, a client pinging faster is still told to calm down (gRPC's default strikes, as Triton).
KEEPALIVE_SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.http2.min_ping_interval_without_data_ms", MIN_RECV_PING_INTERVAL_MS),
    # A ping that crosses the end of the last call is no strike.
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_ping_strikes", 2),
)
# A worker's server, whose one client is the gateway: it never answers pings with GOAWAY
# (0 strikes: no limit), whatever pings a gateway's connection sends beside its keepalive.
WORKER_KEEPALIVE_OPTIONS: tuple[tuple[str, int], ...] = (
    *KEEPALIVE_SERVER_OPTIONS[:2],
    ("grpc.http2.max_ping_strikes", 0),
)


def keepalive_time_ms(kind: str) -> int:
    """The default keepalive time of a channel to a server of ``kind`` (``infergate`` or ``triton``)."""
    return TRITON_KEEPALIVE_TIME_MS if kind == "triton" else KEEPALIVE_TIME_MS


def keepalive_channel_options(time_ms: int) -> tuple[tuple[str, int], ...]:
    """A client channel's keepalive options: pings after ``time_ms`` of silence, only while calls are open."""
    return (
        ("grpc.keepalive_time_ms", time_ms),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 0),
    )


def is_ping_refusal(details: str) -> bool:
    """Whether a call's failure is a server's GOAWAY for too many pings (the connection, not the server, failed)."""
    return "too many pings" in details.lower() or "too_many_pings" in details.lower()
