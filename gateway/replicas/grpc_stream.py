"""One streamed request on a ``ModelStreamInfer`` call of its own, and the
reading of a streamed answer that every replica shares.

A decoupled model answers one request with any number of responses. The
request goes with ``triton_enable_empty_final_response`` set, so the end is
always marked (a response with ``triton_final_response`` true, with or
without outputs); :func:`call_responses` reads until that final response and
ends the call. Closing it early (the client went away, the deadline passed)
cancels the call, and with it the request on the server.

:func:`answer_of` reads one streamed message as every replica's stream does:
an in-stream ``error_message`` ends the request with ``InvalidArgument``
where an infergate server names that status beside it
(``execution.decoupled.stream_error_code``: a prompt longer than the
context; the request's fault, never charged to the replica), with
``WorkerBusy`` for a generation backend at capacity ("... is at capacity
(N sequences); retry later", retried on another replica before the first
response), or else with :class:`~gateway.replicas.errors.ModelStreamError`,
the server's own words.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Callable

import grpc
from tritonclient.grpc import service_pb2

from execution.decoupled import stream_error_code
from gateway.replicas.errors import ModelStreamError, WorkerBusy, WorkerUnreachable
from gateway.replicas.replica import StreamItem
from protos.errors import DeadlineExceeded, InferGateError, InvalidArgument, Unavailable
from protos.triton_words import ask_empty_final, is_final

# How long a call whose final response came may take to close before it is cancelled.
CLOSE_WAIT_S = 1.0
# The generative contract's words for a server whose generation capacity is full.
_AT_CAPACITY = re.compile(r"is at capacity \(\d+ sequences?\); retry later")


def answer_of(message: service_pb2.ModelStreamInferResponse) -> service_pb2.ModelInferResponse:
    """The response a streamed message carries, or the error it ends its request with."""
    if message.error_message:
        if _AT_CAPACITY.search(message.error_message):
            raise WorkerBusy(message.error_message)
        if stream_error_code(message) is grpc.StatusCode.INVALID_ARGUMENT:
            raise InvalidArgument(message.error_message)  # the request's fault, as the server judged it
        raise ModelStreamError(message.error_message)
    return message.infer_response


def deadline_passed(request: service_pb2.ModelInferRequest, where: str, received: int) -> DeadlineExceeded:
    return DeadlineExceeded(f"deadline exceeded while request '{request.id}' of model '{request.model_name}' was "
                            f"streaming from {where}, after {received} response(s)")


async def call_responses(
    open_call: Callable[[], grpc.aio.StreamStreamCall], request: service_pb2.ModelInferRequest, address: str,
    map_error: Callable[[grpc.aio.AioRpcError], InferGateError],
) -> AsyncIterator[StreamItem]:
    """Each response of ``request`` on a call of its own (``open_call`` opens it, on the first read) with its
    arrival time; the last one is final.

    ``map_error`` turns the call's gRPC failure into the error it means (the
    worker client's). The caller must close the generator
    (``contextlib.aclosing``): closing it early cancels the call.
    """
    ask_empty_final(request)
    call = open_call()
    ended = False
    received = 0
    try:
        try:
            await call.write(request)
            await call.done_writing()
            while True:
                message = await call.read()
                if message is grpc.aio.EOF:
                    raise Unavailable(
                        f"worker {address} ended the stream of request '{request.id}' without a final response")
                arrived = time.monotonic()
                response = answer_of(message)
                ended = is_final(response)
                received += 1
                yield response, arrived
                if ended:
                    return
        except grpc.aio.AioRpcError as e:
            if e.code() is grpc.StatusCode.DEADLINE_EXCEEDED:  # gRPC's own words here are "Stream removed"
                raise deadline_passed(request, f"worker {address}", received) from None
            raise map_error(e) from None
        except grpc.aio.UsageError as e:  # the channel was closed under the call
            raise WorkerUnreachable(f"worker {address}: {e}") from None
    finally:
        # Answered in full: the worker closes the call itself (its status follows the final
        # response at once); a server's handler cancelled after its last response may hold the
        # request's state (Triton then cannot unload the model). Abandoned: the call is
        # cancelled, and with it the request on the worker.
        if ended:
            try:
                await asyncio.wait_for(call.code(), CLOSE_WAIT_S)
            except (asyncio.TimeoutError, grpc.aio.AioRpcError):
                pass
        call.cancel()
