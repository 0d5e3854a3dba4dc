"""How the worker's ``ModelStreamInfer`` writes its responses: one at a time on a client's
call, packed several to a message on a gateway's (``protos.stream_pack``).

gRPC allows one write in flight per call. On a client's call each response
waits for the one before it (:class:`DirectWriter`), so a client that stops
reading holds its requests back through gRPC's flow control.

On a packed call (a gateway's, carrying every streamed request it sends
this worker) a response is queued and the writer returns at once
(:class:`PackedWriter`); one task writes what is queued, all of it in one
message when more than one response waits. A generation batch's decode step
wakes each of its sequences in the same turn of the event loop, and the
writing task runs after them: the step's tokens leave as one message. The
gateway reads that call without pause and keeps each request's responses
until its client takes them, so no request's reader holds back another's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
from tritonclient.grpc import service_pb2

from protos.stream_pack import pack


# A packed message's most bytes (a response larger than this goes on its own): well under the
# gRPC message limits of both ends, so packing never makes a message too large to read.
PACK_MAX_BYTES = 1 << 20


def _messages(queued: list[service_pb2.ModelStreamInferResponse]) -> list[service_pb2.ModelStreamInferResponse]:
    """The messages that carry ``queued`` in order: runs of responses packed up to ``PACK_MAX_BYTES``."""
    if len(queued) == 1:
        return queued
    out: list[service_pb2.ModelStreamInferResponse] = []
    run: list[tuple[service_pb2.ModelStreamInferResponse, bytes]] = []
    size = 0

    def flush() -> None:
        if len(run) == 1:
            out.append(run[0][0])
        elif run:
            out.append(pack([data for _, data in run]))
        run.clear()

    for response in queued:
        data = response.SerializeToString()
        if run and size + len(data) > PACK_MAX_BYTES:
            flush()
            size = 0
        run.append((response, data))
        size += len(data)
    flush()
    return out


class DirectWriter:
    """Each response written on the call in turn."""

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self._context = context
        self._lock = asyncio.Lock()

    async def write(self, response: service_pb2.ModelStreamInferResponse) -> None:
        async with self._lock:
            await self._context.write(response)

    async def close(self) -> None:
        """Every write has been awaited by its caller: nothing is left to send."""

    def cancel(self) -> None:
        """The call is gone: no write of this writer's outlives it."""


class PackedWriter:
    """Responses queued as they come, written by one task as many to a message as are waiting;
    a request alone on the call writes its own (``lone``), nothing to pack it with."""

    def __init__(self, context: grpc.aio.ServicerContext, lone: Callable[[], bool]) -> None:
        self._context = context
        self._lone = lone
        self._queued: list[service_pb2.ModelStreamInferResponse] = []
        self._writing = False  # a write in flight, the task's or a lone request's
        self._wake = asyncio.Event()
        self._closing = False
        self._task: asyncio.Task[None] | None = None

    async def write(self, response: service_pb2.ModelStreamInferResponse) -> None:
        if self._closing:
            raise RuntimeError("the stream's writer is closed")
        task = self._task
        if task is not None and task.done():  # its write failed: the call is broken
            raise RuntimeError("the stream's writer failed") from (None if task.cancelled() else task.exception())
        if not self._writing and not self._queued and self._lone():
            # One request on the call: waking the task would only cost this response a turn.
            self._writing = True
            try:
                await self._context.write(response)
            finally:
                self._writing = False
            if self._queued:
                self._wake.set()  # queued meanwhile (another request started)
            return
        self._queued.append(response)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())
        self._wake.set()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queued and not self._writing:
                queued, self._queued = self._queued, []
                self._writing = True
                try:
                    for message in _messages(queued):
                        await self._context.write(message)
                finally:
                    self._writing = False
            if self._closing and not self._queued:
                return

    async def close(self) -> None:
        """Send what is queued, then stop (the call's handler is about to return)."""
        self._closing = True
        if self._task is None:
            return
        self._wake.set()
        await self._task

    def cancel(self) -> None:
        """The call is gone: drop what is queued."""
        self._closing = True
        if self._task is not None:
            self._task.cancel()
