"""A long-lived ``ModelStreamInfer`` call that many requests share, and its lifecycle.

Two transports of the worker client keep one such call per worker
connection: small unary calls as its messages (``unary_stream``) and every
streamed request packed on it (``packed_streams``). Both open the call on
first use and again after it ended, read it with one task for the call's
life, take turns writing (grpc.aio allows one write in flight per call), and
end it the same way: half-close, a grace period for what is in flight, then
cancel. :class:`LongCall` is that shared part; :class:`Lane` is one opening
of the call, which a subclass extends with what it waits for.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Generic, TypeVar

import grpc

log = logging.getLogger(__name__)


class Lane:
    """One opening of the call: the call itself, the task reading it, and whether it is still open."""

    def __init__(self, call: grpc.aio.StreamStreamCall) -> None:
        self.call = call
        self.reader: asyncio.Task[None] | None = None
        self.open = True


_L = TypeVar("_L", bound=Lane)


class LongCall(Generic[_L]):
    """The long-lived call of one worker connection; opened on first use, reopened after it ends.

    A subclass gives ``new_lane`` (opens the call) and ``read`` (reads one
    lane until it ends, then fails what still waits on it).
    """

    def __init__(self, address: str, what: str) -> None:
        self.address = address
        self._what = what  # how the reader's crash is logged
        self._lane: _L | None = None
        self._writing = asyncio.Lock()  # grpc.aio allows one write in flight per call

    def new_lane(self) -> _L:
        raise NotImplementedError

    async def read(self, lane: _L) -> None:
        raise NotImplementedError

    def current(self) -> _L:
        """The open lane, opened now when there is none."""
        lane = self._lane
        if lane is None or not lane.open:
            lane = self._lane = self.new_lane()
            lane.reader = asyncio.get_running_loop().create_task(self.read(lane))
            lane.reader.add_done_callback(self._log_crash)
        return lane

    async def write(self, lane: _L, message: object, lost: Callable[[Exception], Exception]) -> None:
        """``message`` on ``lane``, after the writes before it; ``lost`` makes the error of a call that ended."""
        async with self._writing:
            if not lane.open:
                raise lost(grpc.aio.UsageError(f"the {self._what} call has ended"))
            try:
                await lane.call.write(message)
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as e:
                lane.open = False
                raise lost(e) from None

    async def close(self, grace_s: float | None = None) -> None:
        """End the call: half-close it, give what is in flight ``grace_s`` to be answered, cancel the rest."""
        lane, self._lane = self._lane, None
        if lane is None:
            return
        if lane.open:
            try:
                async with self._writing:
                    await lane.call.done_writing()
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
                pass  # already ended
        if lane.reader is not None:
            try:
                await asyncio.wait_for(asyncio.shield(lane.reader), grace_s or 0.0)
            except asyncio.TimeoutError:
                pass
            lane.call.cancel()
            await asyncio.gather(lane.reader, return_exceptions=True)

    def _log_crash(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("worker %s: %s call reader failed", self.address, self._what, exc_info=task.exception())
