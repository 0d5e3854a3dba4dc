"""A worker's gRPC server never refuses the gateway's keepalive pings (serverkit.grpc_server).

A real ``grpc.aio`` server on 127.0.0.1 and a channel with the gateway's
keepalive options at their floor (1 s), holding one call open and silent, as
the gateway's packed stream call to a worker is between streams. The client
is let ping on without data between (``grpc.http2.max_pings_without_data``
0), the worst a gateway's connection can do. gRPC's default server policy
answers GOAWAY "too_many_pings" after a few periods, and the call fails in the
words the gateway's worker client reads as a ping refusal; a worker's options,
and the gateway's own server's, let the call stay open.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from serverkit.grpc_server import (
    KEEPALIVE_SERVER_OPTIONS,
    MIN_KEEPALIVE_TIME_MS,
    WORKER_KEEPALIVE_OPTIONS,
    is_ping_refusal,
    keepalive_channel_options,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

PERIODS = 8  # silent keepalive periods the call is held open


async def _silent(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    async for _ in requests:
        pass
    return
    yield b""  # a generator: answers nothing


async def _hold_silent_call(server_options: tuple[tuple[str, int], ...]) -> grpc.aio.AioRpcError | None:
    """The failure of a silent call held for PERIODS keepalive periods, or None when it stayed open."""
    server = grpc.aio.server(options=list(server_options))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "test.Silent", {"Hold": grpc.stream_stream_rpc_method_handler(_silent)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    options = [*keepalive_channel_options(MIN_KEEPALIVE_TIME_MS), ("grpc.http2.max_pings_without_data", 0)]
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options)
    try:
        call = channel.stream_stream("/test.Silent/Hold")()
        try:
            # Held silent past several periods; not a wait for readiness.
            await asyncio.wait_for(call.read(), PERIODS * MIN_KEEPALIVE_TIME_MS / 1000)
        except asyncio.TimeoutError:
            return None
        except grpc.aio.AioRpcError as e:
            return e
        finally:
            call.cancel()
        raise AssertionError("the silent call answered")
    finally:
        await channel.close()
        await server.stop(None)


async def test_grpc_defaults_refuse_the_pings_of_a_silent_call() -> None:
    # The failure the workers' servers gave before: what the fix is measured against.
    error = await _hold_silent_call(())
    assert error is not None and error.code() is grpc.StatusCode.UNAVAILABLE
    assert is_ping_refusal(error.details() or ""), error.details()


@pytest.mark.parametrize("server_options", [WORKER_KEEPALIVE_OPTIONS, KEEPALIVE_SERVER_OPTIONS], ids=["worker", "gateway"])
async def test_the_servers_keep_a_silent_call_open_past_several_keepalive_periods(
    server_options: tuple[tuple[str, int], ...],
) -> None:
    assert await _hold_silent_call(server_options) is None
