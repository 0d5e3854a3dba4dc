"""Inference calls to one worker as messages of one long-lived ``ModelStreamInfer`` call.

A message on an open stream costs the gateway (and the worker) about a third
less CPU than a unary ``ModelInfer`` (no call set-up, metadata or status per
message; ``bench/worker_call_bench.py``). A unary call carries three things a
stream message does not; the :class:`WorkerClient` that owns this stream
keeps the unary behaviour for each:

- a status code: an in-stream error (``error_message``) comes back here as
  the answer, and the client sends that request once more as a unary call,
  whose status is the worker's word (errors are rare; inference is idempotent);
- a deadline: the caller stops waiting at it with DEADLINE_EXCEEDED, as a
  unary call would end; the worker finishes the message unasked;
- a connection: when the stream ends (a lost connection, a worker stopping),
  every call waiting on it fails with :class:`WorkerUnreachable`, retried
  elsewhere like a unary call's transport failure, and the next call opens a
  fresh stream.

Answers are matched to calls by id: each message goes out under an id unique
on its stream (the worker echoes it). The request message itself is not
changed: it is serialized here with that id, and the shared message may be
sent by other attempts at the same time.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable

import grpc
from tritonclient.grpc import service_pb2

from protos import wire
from protos.errors import Unavailable, from_grpc_code

log = logging.getLogger(__name__)

OpenStream = Callable[[], grpc.aio.StreamStreamCall]


class StreamLost(Unavailable):
    """The stream ended under a call: the worker client turns it into its transport failure."""


class _Lane:
    """One open stream call, the calls waiting on it, and the task reading its answers."""

    def __init__(self, call: grpc.aio.StreamStreamCall) -> None:
        self.call = call
        self.waiting: dict[str, asyncio.Future[service_pb2.ModelStreamInferResponse]] = {}
        self.reader: asyncio.Task[None] | None = None
        self.open = True


class InferStream:
    """The stream of one worker connection; opened on first use, reopened after it ends."""

    def __init__(self, open_stream: OpenStream, address: str) -> None:
        self._open_stream = open_stream
        self._address = address
        self._lane: _Lane | None = None
        self._ids = itertools.count()
        # grpc.aio allows one write in flight per call: senders take turns.
        self._writing = asyncio.Lock()

    def _current(self) -> _Lane:
        lane = self._lane
        if lane is None or not lane.open:
            lane = self._lane = _Lane(self._open_stream())
            lane.reader = asyncio.get_running_loop().create_task(self._read(lane))
            lane.reader.add_done_callback(_log_crash)
        return lane

    async def _read(self, lane: _Lane) -> None:
        reason = "the stream ended"
        try:
            async for answer in lane.call:
                future = lane.waiting.pop(answer.infer_response.id, None)
                if future is not None and not future.done():
                    future.set_result(answer)
        except grpc.aio.AioRpcError as e:
            reason = f"{e.code().name}: {e.details() or ''}"
        finally:
            lane.open = False
            waiting, lane.waiting = lane.waiting, {}
            for future in waiting.values():
                if not future.done():
                    future.set_exception(StreamLost(f"worker {self._address}: inference stream lost ({reason})"))

    async def infer(
        self, request: service_pb2.ModelInferRequest | wire.RawInferRequest, timeout_s: float | None
    ) -> service_pb2.ModelStreamInferResponse:
        """The worker's answer to ``request`` (an in-stream error included); raises on a lost stream or deadline."""
        lane = self._current()
        key = str(next(self._ids))
        header = request.header if isinstance(request, wire.RawInferRequest) else request
        # Serialized now, under the stream's id, and the message left as it was:
        # another attempt may be sending the same message elsewhere.
        original = header.id
        header.id = key
        try:
            data = wire.serialize(request)
        finally:
            header.id = original
        future: asyncio.Future[service_pb2.ModelStreamInferResponse] = asyncio.get_running_loop().create_future()
        lane.waiting[key] = future
        try:
            async with self._writing:
                if not lane.open:
                    raise StreamLost(f"worker {self._address}: inference stream lost")
                try:
                    await lane.call.write(data)
                except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as e:
                    lane.open = False
                    raise StreamLost(f"worker {self._address}: inference stream lost ({e})") from None
            if timeout_s is None:
                return await future
            try:
                return await asyncio.wait_for(future, timeout_s)
            except asyncio.TimeoutError:
                raise from_grpc_code(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        finally:
            lane.waiting.pop(key, None)

    async def close(self, grace_s: float | None = None) -> None:
        """End the stream: half-close it, give what is in flight ``grace_s`` to be answered, cancel the rest."""
        lane, self._lane = self._lane, None
        if lane is not None:
            await end_call(lane.call, lane.open, self._writing, lane.reader, grace_s)


async def end_call(call: grpc.aio.StreamStreamCall, open_: bool, writing: asyncio.Lock,
                   reader: asyncio.Task[None] | None, grace_s: float | None) -> None:
    """End a long-lived stream call: half-close it (when still ``open_``), give its ``reader``
    ``grace_s`` to read what is in flight, then cancel the call and wait for the reader."""
    if open_:
        try:
            async with writing:
                await call.done_writing()
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
            pass  # already ended
    if reader is not None:
        try:
            await asyncio.wait_for(asyncio.shield(reader), grace_s or 0.0)
        except asyncio.TimeoutError:
            pass
        call.cancel()
        await asyncio.gather(reader, return_exceptions=True)


def _log_crash(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("inference stream reader failed", exc_info=task.exception())
