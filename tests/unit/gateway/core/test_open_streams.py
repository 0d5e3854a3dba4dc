"""The open-stream count a shutdown waits on (gateway.core.streaming.OpenStreams)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from gateway.core.streaming import OpenStreams


@pytest.mark.parametrize("timeout_s", [0.0, -1.0, 30.0])
async def test_none_open_returns_at_once_without_a_warning(timeout_s: float, caplog: pytest.LogCaptureFixture) -> None:
    # A shutdown whose grace the batchers spent calls with no time left (0 or less).
    streams = OpenStreams()
    streams.opened()
    streams.closed()
    with caplog.at_level(logging.WARNING, logger="gateway.core.streaming"):
        assert await asyncio.wait_for(streams.wait_closed(timeout_s), 5) == 0
    assert not caplog.records


async def test_streams_still_open_are_counted_and_warned_of(caplog: pytest.LogCaptureFixture) -> None:
    streams = OpenStreams()
    streams.opened()
    streams.opened()
    with caplog.at_level(logging.WARNING, logger="gateway.core.streaming"):
        assert await streams.wait_closed(0.0) == 2
    assert [r.getMessage() for r in caplog.records] == ["2 stream(s) still open after 0.0 s"]


async def test_wait_ends_when_the_last_stream_closes(caplog: pytest.LogCaptureFixture) -> None:
    streams = OpenStreams()
    streams.opened()
    waiting = asyncio.create_task(streams.wait_closed(60.0))
    await asyncio.sleep(0)  # the wait has started
    assert not waiting.done()
    streams.closed()
    with caplog.at_level(logging.WARNING, logger="gateway.core.streaming"):
        assert await asyncio.wait_for(waiting, 5) == 0
    assert not caplog.records
