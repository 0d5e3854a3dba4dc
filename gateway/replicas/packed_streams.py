"""Streamed requests to one infergate worker as requests of one long-lived packed call.

A decoupled model answers one request with many responses (a generation,
one a token). With a ``ModelStreamInfer`` call per request, each response is
a gRPC message read on its own call; with sixteen generations decoding
together, a decode step is sixteen messages from the worker, each read by
the gateway on its own. Here every streamed request to a worker shares one
call, opened with ``protos.stream_pack``'s packing asked for: the worker
sends a step's responses as one message, and the gateway hands each to its
request.

:class:`PackedCall` is one request's view of that call, with the methods of a
``grpc.aio`` stream call that ``gateway.fleet.stream_call`` uses (``write``,
``done_writing``, ``read``, ``code``, ``cancel``), so a request is streamed
the same way on a call of its own, a packed one or in process:

- its key on the call is one the call gives it (unique there), sent beside
  its own id (which the model sees unchanged); the worker answers under
  that key, so the responses come back to this request alone;
- ``read`` returns its next response, ``grpc.aio.EOF`` if the worker ended
  the call cleanly, raises the error the worker client makes of the call's
  failure (``lost``: the call ends only with its connection or its worker,
  so the client's "unreachable", retried elsewhere as for a call of its
  own), and raises ``DeadlineExceeded`` at the request's timeout,
  cancelling it;
- ``cancel`` before its final response sends the worker a cancel for it
  (the request's model stops, as when a call of its own is cancelled);
- responses are kept per request until it reads them: the call is read
  without pause, so a client that reads slowly holds back no other
  request (Triton's frontend also queues a decoupled model's responses).

The call is opened on first use and opened again after it ends; an ended
call fails the requests on it, which a request that has sent nothing yet
retries elsewhere (``gateway.routing.streams``).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
from collections.abc import Callable

import grpc
from tritonclient.grpc import service_pb2

from execution.decoupled import FINAL_RESPONSE
from gateway.fleet.worker_stream import end_call
from protos.errors import DeadlineExceeded, InferGateError
from protos.stream_pack import PACK_METADATA, cancel_request, unpack, with_key

log = logging.getLogger(__name__)

OpenCall = Callable[[grpc.aio.Metadata], grpc.aio.StreamStreamCall]
_Item = service_pb2.ModelStreamInferResponse | InferGateError | object
# What the worker client makes of the packed call's failure: the error each request on it gets.
Lost = Callable[[grpc.aio.AioRpcError], InferGateError]


_TIMED_OUT = object()


class _Inbox:
    """One request's responses until it reads them; fewer steps a response than ``asyncio.Queue``'s."""

    __slots__ = ("items", "waiter")

    def __init__(self) -> None:
        self.items: collections.deque[_Item] = collections.deque()
        self.waiter: asyncio.Future[None] | None = None

    def put(self, item: _Item) -> None:
        self.items.append(item)
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> _Item:
        while not self.items:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        return self.items.popleft()


class _Lane:
    """One open packed call, the requests reading from it and the task reading its messages."""

    def __init__(self, call: grpc.aio.StreamStreamCall) -> None:
        self.call = call
        self.inboxes: dict[str, _Inbox] = {}
        self.reader: asyncio.Task[None] | None = None
        self.open = True
        self.ended: _Item = grpc.aio.EOF  # what every later read gets: EOF or the call's failure


class PackedStreams:
    """The packed call of one worker connection."""

    def __init__(self, open_call: OpenCall, metadata: grpc.aio.Metadata, address: str, lost: Lost) -> None:
        self._open_call = open_call
        self._lost = lost
        self._metadata = grpc.aio.Metadata(*metadata, (PACK_METADATA, "1"))
        self.address = address
        self._lane: _Lane | None = None
        self._ids = itertools.count()
        self._writing = asyncio.Lock()  # grpc.aio allows one write in flight per call
        self._cancels: set[asyncio.Task[None]] = set()

    def call(self, timeout_s: float | None) -> PackedCall:
        """One request's call; the caller writes the request, then reads until its final response."""
        return PackedCall(self, timeout_s)

    def _current(self) -> _Lane:
        lane = self._lane
        if lane is None or not lane.open:
            lane = self._lane = _Lane(self._open_call(self._metadata))
            lane.reader = asyncio.get_running_loop().create_task(self._read(lane))
            lane.reader.add_done_callback(_log_crash)
        return lane

    async def _read(self, lane: _Lane) -> None:
        ended: _Item = grpc.aio.EOF
        try:
            async for message in lane.call:
                for response in unpack(message):
                    inbox = lane.inboxes.get(response.infer_response.id)
                    if inbox is not None:
                        inbox.put(response)
        except grpc.aio.AioRpcError as e:
            ended = self._lost(e)
        finally:
            lane.open = False
            lane.ended = ended
            inboxes, lane.inboxes = lane.inboxes, {}
            for inbox in inboxes.values():
                inbox.put(ended)

    async def _send(self, lane: _Lane, request: service_pb2.ModelInferRequest) -> None:
        async with self._writing:
            if not lane.open:
                raise _ended(lane)
            try:
                await lane.call.write(request)
            except grpc.aio.AioRpcError as e:
                lane.open = False
                raise self._lost(e) from None

    def _cancel(self, lane: _Lane, key: str) -> None:
        lane.inboxes.pop(key, None)
        if not lane.open:
            return  # the call is gone, and with it the request on the worker
        task = asyncio.get_running_loop().create_task(self._send_cancel(lane, key))
        self._cancels.add(task)
        task.add_done_callback(self._cancels.discard)

    async def _send_cancel(self, lane: _Lane, key: str) -> None:
        try:
            await self._send(lane, cancel_request(key))
        except (InferGateError, grpc.aio.UsageError, asyncio.InvalidStateError) as e:
            log.debug("worker %s: cancel of stream request %s not sent: %s", self.address, key, e)

    async def close(self, grace_s: float | None = None) -> None:
        """End the call: half-close it, give what is in flight ``grace_s`` to be answered, cancel the rest."""
        lane, self._lane = self._lane, None
        if lane is not None:
            await end_call(lane.call, lane.open, self._writing, lane.reader, grace_s)
        await asyncio.gather(*self._cancels, return_exceptions=True)


class PackedCall:
    """One streamed request on its worker's packed call."""

    def __init__(self, streams: PackedStreams, timeout_s: float | None) -> None:
        self._streams = streams
        self._timeout_s = timeout_s
        self._timer: asyncio.TimerHandle | None = None
        self._lane: _Lane | None = None
        self._key = ""
        self._inbox = _Inbox()
        self._request: service_pb2.ModelInferRequest | None = None
        self._over = False  # answered in full, failed, or cancelled: nothing to cancel on the worker

    async def write(self, request: service_pb2.ModelInferRequest) -> None:
        if self._request is not None:
            raise RuntimeError("one request per packed stream call")
        streams = self._streams
        lane = self._lane = streams._current()
        self._key = key = str(next(streams._ids))
        self._request = request
        lane.inboxes[key] = self._inbox
        if self._timeout_s is not None:  # one timer for the request, not one a read
            self._timer = asyncio.get_running_loop().call_later(self._timeout_s, self._inbox.put, _TIMED_OUT)
        try:
            await streams._send(lane, with_key(request, key))
        except BaseException:
            self._end()
            lane.inboxes.pop(key, None)
            raise

    async def done_writing(self) -> None:
        """The request is written; the shared call stays open."""

    async def read(self) -> service_pb2.ModelStreamInferResponse | object:
        item = await self._inbox.get()
        if isinstance(item, service_pb2.ModelStreamInferResponse):
            if item.error_message or _final(item.infer_response):
                self._end()  # the worker ended the request itself
            return item
        if item is _TIMED_OUT:
            self.cancel()
            request = self._request
            raise DeadlineExceeded(
                f"deadline exceeded while request '{request.id if request else ''}' of model "
                f"'{request.model_name if request else ''}' was streaming from worker {self._streams.address}")
        self._end()
        if isinstance(item, InferGateError):
            raise item
        return item  # EOF

    async def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.OK

    def cancel(self) -> bool:
        if self._over or self._lane is None:
            return False
        self._end()
        self._streams._cancel(self._lane, self._key)
        return True

    def _end(self) -> None:
        self._over = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def _final(response: service_pb2.ModelInferResponse) -> bool:
    param = response.parameters.get(FINAL_RESPONSE)
    return param is not None and param.bool_param


def _ended(lane: _Lane) -> grpc.aio.UsageError | InferGateError:
    if isinstance(lane.ended, InferGateError):
        return lane.ended
    return grpc.aio.UsageError("the worker's packed stream call has ended")


def _log_crash(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("packed stream reader failed", exc_info=task.exception())
