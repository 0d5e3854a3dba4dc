"""The gRPC frontend's ``ModelStreamInfer``: many requests on one bidirectional stream,
each answered by one response (an ordinary model) or by a stream of them (a decoupled model).

Requests of one stream run concurrently, each through ``InferenceCore.stream``;
each response goes out as soon as it comes, in order within its request,
interleaved across requests. A decoupled model's responses carry
``triton_final_response`` as Triton's do (true on the last); an ordinary
model's one response carries it only when the client asked for
``triton_enable_empty_final_response``. A failure ends its own request with
one in-stream ``error_message`` (request id kept); the stream goes on.

Bounds: at most ``max_inflight`` requests run or wait to be written at once
(a request's slot is freed when its last response is written), and at most
``max_inflight`` responses wait to be written (a request whose client stops
reading waits; its worker's responses wait in the gateway, on a packed call,
or through gRPC flow control, on a call of its own). Each
response handed to gRPC is reported to the core (``stream_written``), which
measures the gap between its arrival from the worker and its write.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any, NamedTuple

import grpc
from tritonclient.grpc import service_pb2

from gateway.frontends.grpc_errors import abort, as_error, stream_error
from gateway.frontends.grpc_wire import apply_client_deadline, decode_infer_request, encode_infer_response, param_value
from protos.triton_words import ENABLE_EMPTY_FINAL as EMPTY_FINAL, set_final
from gateway.observability.tracing import RequestTracing
from gateway.requests.shared_memory import SharedMemoryRegistry
from gateway.types import InferenceCore, InferRequest, InferResponse
from protos.errors import Cancelled


class _Out(NamedTuple):
    """One item for the writer: a message (None: nothing to write), the core's response it
    encodes (None for errors), and whether it ends its request (frees the request's slot)."""

    message: service_pb2.ModelStreamInferResponse | None
    response: InferResponse | None
    last: bool


def _message(resp: InferResponse, req: InferRequest, asked: bool, plain: bool
             ) -> service_pb2.ModelStreamInferResponse:
    """The stream message of one response. A decoupled model's response (a generation's every
    token) is written straight into the message when nothing needs the general encoding (no
    output into shared memory, no parameters): the same fields as ``encode_infer_response``'s."""
    message = service_pb2.ModelStreamInferResponse()
    if resp.arrived and plain and not resp.parameters:
        out = message.infer_response
        out.model_name = resp.model or req.model
        out.model_version = resp.version
        out.id = req.id
        raws = out.raw_output_contents
        for tensor in resp.outputs:
            if tensor.parameters:
                message.Clear()
                break
            out.outputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
            data = tensor.data
            raws.append(data if isinstance(data, bytes) else bytes(data))
        else:
            set_final(out, resp.final)
            return message
    out = encode_infer_response(resp, req)
    if resp.arrived:  # a decoupled model's response: flagged on every one, as Triton's
        set_final(out, resp.final)
    elif asked:
        set_final(out, True)  # one response: it is the final one
    message.infer_response.CopyFrom(out)
    return message


class StreamSession:
    """One ``ModelStreamInfer`` call: reads its requests, runs each, writes every response."""

    def __init__(self, core: InferenceCore, context: grpc.aio.ServicerContext, *, max_inflight: int,
                 shm: SharedMemoryRegistry, tracing: RequestTracing) -> None:
        self._core = core
        self._context = context
        self._shm = shm
        self._tracing = tracing
        self._done: asyncio.Queue[Any] = asyncio.Queue()
        self._slots = asyncio.Semaphore(max_inflight)  # requests running or not yet fully written
        self._room = asyncio.Semaphore(max_inflight)  # responses waiting to be written

    async def _put(self, item: _Out) -> None:
        if item.response is not None:
            await self._room.acquire()  # the writer gives it back once the response is written
        self._done.put_nowait(item)

    async def _answer(self, pb: service_pb2.ModelInferRequest) -> None:
        """Every response of one request; failures become one in-stream error_message."""
        sent = 0
        try:
            req = decode_infer_request(pb, allowed_reserved=frozenset({EMPTY_FINAL}), shm=self._shm)
            apply_client_deadline(req, self._context)
            asked = EMPTY_FINAL in pb.parameters and param_value(pb.parameters[EMPTY_FINAL]) is True
            if asked:
                req.parameters[EMPTY_FINAL] = True  # the core keeps the empty final response for this client
            with self._tracing.request(req, self._context.invocation_metadata, "GRPC"):
                async with aclosing(self._core.stream(req)) as responses:
                    plain = not any(o.region is not None for o in req.outputs)
                    async for resp in responses:
                        sent += 1
                        await self._put(_Out(_message(resp, req, asked, plain), resp, resp.final))
                        if resp.final:
                            return
            await self._put(_Out(None, None, True))  # ended without a final response to write (it was dropped)
        except Exception as exc:  # the in-stream error edge: the stream goes on
            await self._put(_Out(stream_error(pb, as_error(exc, pb.id)), None, True))

    async def run(self, requests: AsyncIterator[service_pb2.ModelInferRequest]
                  ) -> AsyncIterator[service_pb2.ModelStreamInferResponse]:
        """The responses to write, in the order they come.

        Invariants: the reader spawns one task per request after taking a
        slot; every request task ends with exactly one item marked ``last``;
        the writer frees the slot on it. The stream ends once the client has
        half-closed and every spawned request has ended.
        """
        loop = asyncio.get_running_loop()
        tasks: set[asyncio.Task[None]] = set()
        end = object()
        spawned = 0

        def answered(task: asyncio.Task[None], pb: service_pb2.ModelInferRequest) -> None:
            tasks.discard(task)
            # _answer turns every Exception into an item; only a cancel coming
            # from below (not from this stream's teardown, after which nobody
            # reads ``done``) ends a task without its last one. Stand in for it.
            if task.cancelled():
                self._done.put_nowait(_Out(stream_error(pb, Cancelled("the request was cancelled")), None, True))

        async def read_all() -> None:
            nonlocal spawned
            try:
                async for pb in requests:
                    await self._slots.acquire()
                    task = loop.create_task(self._answer(pb))
                    tasks.add(task)
                    task.add_done_callback(functools.partial(answered, pb=pb))
                    spawned += 1
                self._done.put_nowait(end)
            except Exception as exc:  # surfaced to the writer, which ends the stream with it
                self._done.put_nowait(exc)

        reader = loop.create_task(read_all())
        ended_requests = 0
        ended = False
        try:
            while not ended or ended_requests < spawned:
                item = await self._done.get()
                if item is end:
                    ended = True
                    continue
                if isinstance(item, Exception):
                    raise item
                if item.message is not None:
                    yield item.message  # resumes once gRPC has taken the message
                if item.response is not None:
                    self._room.release()
                    self._core.stream_written(item.response)
                if item.last:
                    ended_requests += 1
                    self._slots.release()
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # the error-mapping edge for the stream as a whole
            await abort(self._context, exc)
        finally:
            # Cancel what is left (client gone, stream aborted) and wait for it, so no task outlives its
            # stream; cancelling a request's task closes its core stream, which cancels its worker call.
            pending = [reader, *tasks]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
