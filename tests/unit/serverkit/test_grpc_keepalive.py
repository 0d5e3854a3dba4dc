"""The gateway's keepalive pings are within what the servers it calls accept (serverkit.grpc_server)."""

from __future__ import annotations

import grpc
import pytest

from gateway.config import load_config
from gateway.composition import remote_replicas
from gateway.replicas.errors import PingsRefused, WorkerBusy
from gateway.replicas.worker_client import WorkerClient
from gateway.settings import ConfigError, WorkerSpec
from serverkit.grpc_server import (
    KEEPALIVE_SERVER_OPTIONS,
    KEEPALIVE_TIME_MS,
    MIN_KEEPALIVE_TIME_MS,
    TRITON_KEEPALIVE_TIME_MS,
    WORKER_KEEPALIVE_OPTIONS,
    is_ping_refusal,
)

# A Triton server's defaults (its --grpc-http2-min-recv-ping-interval-without-data and
# --grpc-http2-max-ping-strikes), as its gRPC server documents them.
TRITON_MIN_RECV_PING_INTERVAL_MS = 300_000
TRITON_MAX_PING_STRIKES = 2

_MIN_RECV = "grpc.http2.min_ping_interval_without_data_ms"


def _channel_keepalive_ms(kind: str, **overrides: float) -> int:
    client = remote_replicas(load_config(None, **overrides))(WorkerSpec("127.0.0.1:1", kind=kind))
    return dict(client._options)["grpc.keepalive_time_ms"]


def test_the_gateways_channels_ping_each_kind_no_more_often_than_it_accepts() -> None:
    worker_floor_ms = dict(WORKER_KEEPALIVE_OPTIONS)[_MIN_RECV]
    assert _channel_keepalive_ms("infergate") == KEEPALIVE_TIME_MS >= 2 * worker_floor_ms
    # The lowest keepalive a gateway may be set to keeps a margin of two, too.
    assert MIN_KEEPALIVE_TIME_MS >= 2 * worker_floor_ms
    assert _channel_keepalive_ms("infergate", worker_keepalive_s=MIN_KEEPALIVE_TIME_MS / 1000) == MIN_KEEPALIVE_TIME_MS
    assert _channel_keepalive_ms("triton") == TRITON_KEEPALIVE_TIME_MS > TRITON_MIN_RECV_PING_INTERVAL_MS
    assert _channel_keepalive_ms("triton", triton_keepalive_s=20) == 20_000


def test_a_worker_never_refuses_pings_and_the_gateway_takes_what_it_sends_its_workers() -> None:
    worker = dict(WORKER_KEEPALIVE_OPTIONS)
    assert worker["grpc.http2.max_ping_strikes"] == 0  # no limit
    assert worker["grpc.keepalive_permit_without_calls"] == 1
    gateway = dict(KEEPALIVE_SERVER_OPTIONS)
    assert 2 * gateway[_MIN_RECV] <= MIN_KEEPALIVE_TIME_MS
    assert gateway["grpc.keepalive_permit_without_calls"] == 1
    assert gateway["grpc.http2.max_ping_strikes"] == TRITON_MAX_PING_STRIKES  # a public server still refuses a flood


def test_a_keepalive_below_the_workers_floor_is_refused() -> None:
    with pytest.raises(ConfigError, match="worker_keepalive_s must be at least 1"):
        load_config(None, worker_keepalive_s=0.5)
    with pytest.raises(ConfigError, match="triton_keepalive_s must be positive"):
        load_config(None, triton_keepalive_s=0)


@pytest.mark.parametrize("details, refused", [
    ("Too many pings", True),
    ("GOAWAY received; Error code: 11; Debug Text: too_many_pings", True),
    ("failed to connect to all addresses", False),
    ("Socket closed", False),
])
def test_a_ping_refusal_is_told_from_other_lost_connections(details: str, refused: bool) -> None:
    assert is_ping_refusal(details) is refused


def test_the_worker_client_takes_a_ping_refusal_for_no_fault_of_the_worker() -> None:
    client = WorkerClient("127.0.0.1:1")
    refusal = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                   "Too many pings")
    error = client.map_error(refusal)
    # WorkerBusy: the router retries it elsewhere and neither charges a failure nor marks the worker DOWN.
    assert isinstance(error, PingsRefused) and isinstance(error, WorkerBusy)
    assert isinstance(client._packed_call_lost(refusal), PingsRefused)
