"""Streamed requests to one infergate worker as requests of one long-lived packed call.

A decoupled model answers one request with many responses (a generation,
one a token). With a ``ModelStreamInfer`` call per request, each response is
a gRPC message read on its own call; with sixteen generations decoding
together, a decode step is sixteen messages from the worker, each read by
the gateway on its own. Here every streamed request to a worker shares one
call, opened with ``protos.stream_pack``'s packing asked for: the worker
sends a step's responses as one message, and the gateway hands each to its
request.

Each request's :meth:`PackedStreams.stream` is its share of that call:

- its key on the call is one the call gives it (unique there), sent beside
  its own id (which the model sees unchanged); the worker answers under
  that key, so the responses come back to this request alone;
- it yields the request's responses until the final one; the call's failure
  is the error the worker client makes of it (``lost``: the call ends only
  with its connection or its worker, so the client's "unreachable", retried
  elsewhere by the router before the first response), and the request's
  timeout ends it with ``DeadlineExceeded``;
- closed before its final response, it sends the worker a cancel for it
  (the request's model stops, as when a call of its own is cancelled);
- responses are kept per request until it reads them: the call is read
  without pause, so a client that reads slowly holds back no other
  request (Triton's frontend also queues a decoupled model's responses).

The call is opened on first use and opened again after it ends
(``gateway.replicas.long_call``).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable

import grpc
from tritonclient.grpc import service_pb2

from gateway.replicas.grpc_stream import answer_of, deadline_passed
from gateway.replicas.long_call import Lane, LongCall
from gateway.replicas.replica import StreamItem
from protos.errors import InferGateError, Unavailable
from protos.stream_pack import PACK_METADATA, cancel_request, unpack, with_key
from protos.triton_words import ask_empty_final, is_final

log = logging.getLogger(__name__)

OpenCall = Callable[[grpc.aio.Metadata], grpc.aio.StreamStreamCall]
_Item = service_pb2.ModelStreamInferResponse | InferGateError | object
# What the worker client makes of the packed call's failure: the error each request on it gets.
Lost = Callable[[grpc.aio.AioRpcError], InferGateError]

_TIMED_OUT = object()
_ENDED = object()  # the worker ended the call cleanly


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


class _Lane(Lane):
    """One open packed call and the requests reading from it."""

    def __init__(self, call: grpc.aio.StreamStreamCall) -> None:
        super().__init__(call)
        self.inboxes: dict[str, _Inbox] = {}
        self.ended: _Item = _ENDED  # what every later read gets: the clean end or the call's failure


class PackedStreams(LongCall[_Lane]):
    """The packed call of one worker connection."""

    def __init__(self, open_call: OpenCall, metadata: grpc.aio.Metadata, address: str, lost: Lost) -> None:
        super().__init__(address, "packed stream")
        self._open_call = open_call
        self._lost = lost
        self._metadata = grpc.aio.Metadata(*metadata, (PACK_METADATA, "1"))
        self._ids = itertools.count()
        self._cancels: set[asyncio.Task[None]] = set()

    def new_lane(self) -> _Lane:
        return _Lane(self._open_call(self._metadata))

    async def read(self, lane: _Lane) -> None:
        ended: _Item = _ENDED
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

    def _write_lost(self, lane: _Lane) -> Callable[[Exception], Exception]:
        def lost(e: Exception) -> Exception:
            if isinstance(e, grpc.aio.AioRpcError):
                return self._lost(e)
            if isinstance(lane.ended, InferGateError):
                return lane.ended
            return Unavailable(f"worker {self.address}: the packed stream call has ended ({e})")
        return lost

    async def stream(self, request: service_pb2.ModelInferRequest, timeout_s: float | None) -> AsyncIterator[StreamItem]:
        """Each response of ``request`` with its arrival time, the last one final (``Replica.stream``)."""
        ask_empty_final(request)
        lane = self.current()
        key = str(next(self._ids))
        inbox = lane.inboxes[key] = _Inbox()
        timer = None
        if timeout_s is not None:  # one timer for the request, not one a read
            timer = asyncio.get_running_loop().call_later(timeout_s, inbox.put, _TIMED_OUT)
        over = False  # answered in full, failed, or cancelled: nothing to cancel on the worker
        received = 0
        try:
            try:
                await self.write(lane, with_key(request, key), self._write_lost(lane))
            except BaseException:
                over = True
                raise
            while True:
                item = await inbox.get()
                if isinstance(item, service_pb2.ModelStreamInferResponse):
                    arrived = time.monotonic()
                    if item.error_message:
                        over = True  # the worker ended the request itself
                    response = answer_of(item)
                    final = over = is_final(response)
                    received += 1
                    yield response, arrived
                    if final:
                        return
                    continue
                if item is _TIMED_OUT:
                    raise deadline_passed(request, f"worker {self.address}", received)
                over = True
                if isinstance(item, InferGateError):
                    raise item
                raise Unavailable(f"worker {self.address} ended the stream of request '{request.id}' "
                                  "without a final response")
        finally:
            if timer is not None:
                timer.cancel()
            lane.inboxes.pop(key, None)
            if not over and lane.open:
                self._send_cancel(lane, key)

    def _send_cancel(self, lane: _Lane, key: str) -> None:
        task = asyncio.get_running_loop().create_task(self._cancel(lane, key))
        self._cancels.add(task)
        task.add_done_callback(self._cancels.discard)

    async def _cancel(self, lane: _Lane, key: str) -> None:
        try:
            await self.write(lane, cancel_request(key), self._write_lost(lane))
        except (InferGateError, grpc.aio.UsageError, asyncio.InvalidStateError) as e:
            log.debug("worker %s: cancel of stream request %s not sent: %s", self.address, key, e)

    async def close(self, grace_s: float | None = None) -> None:
        """End the call: half-close it, give what is in flight ``grace_s`` to be answered, cancel the rest."""
        await super().close(grace_s)
        await asyncio.gather(*self._cancels, return_exceptions=True)
