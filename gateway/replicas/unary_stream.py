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
  every call waiting on it fails with ``WorkerUnreachable``, retried
  elsewhere like a unary call's transport failure, and the next call opens a
  fresh stream.

Answers are matched to calls by id: each message goes out under an id unique
on its stream (the worker echoes it). The request message itself is not
changed: it is serialized here with that id, and the shared message may be
sent by other attempts at the same time. The call's lifecycle (open, read,
write in turn, close) is ``gateway.replicas.long_call``'s.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable

import grpc
from tritonclient.grpc import service_pb2

from gateway.replicas.errors import WorkerUnreachable
from gateway.replicas.long_call import Lane, LongCall
from protos import wire
from protos.errors import from_grpc_code

OpenStream = Callable[[], grpc.aio.StreamStreamCall]


class _Lane(Lane):
    def __init__(self, call: grpc.aio.StreamStreamCall) -> None:
        super().__init__(call)
        self.waiting: dict[str, asyncio.Future[service_pb2.ModelStreamInferResponse]] = {}


class InferStream(LongCall[_Lane]):
    """The unary calls' stream of one worker connection."""

    def __init__(self, open_stream: OpenStream, address: str) -> None:
        super().__init__(address, "inference stream")
        self._open_stream = open_stream
        self._ids = itertools.count()

    def new_lane(self) -> _Lane:
        return _Lane(self._open_stream())

    def _lost(self, reason: object) -> WorkerUnreachable:
        return WorkerUnreachable(f"worker {self.address}: inference stream lost ({reason})")

    async def read(self, lane: _Lane) -> None:
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
                    future.set_exception(self._lost(reason))

    async def infer(
        self, request: service_pb2.ModelInferRequest | wire.RawInferRequest, timeout_s: float | None
    ) -> service_pb2.ModelStreamInferResponse:
        """The worker's answer to ``request`` (an in-stream error included); raises on a lost stream or deadline."""
        lane = self.current()
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
            await self.write(lane, data, self._lost)
            if timeout_s is None:
                return await future
            try:
                return await asyncio.wait_for(future, timeout_s)
            except asyncio.TimeoutError:
                raise from_grpc_code(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        finally:
            lane.waiting.pop(key, None)
