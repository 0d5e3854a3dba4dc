"""One streamed request on one worker: its ``ModelStreamInfer`` call.

A decoupled model answers one request with any number of responses. The
worker client gives each streamed request a call: a call of its own (a
Triton server; ``worker_streams: per_request``) or its share of the
worker's packed call (``gateway.fleet.worker_packed_streams``), which
behaves the same here. The request is sent with
``triton_enable_empty_final_response`` set, so that the end is always marked
(a response with ``triton_final_response`` true, with or without outputs),
reads until that final response and ends the call. Cancelling the call (the
client went away, the deadline passed) cancels the request on the worker.

Errors: a gRPC failure of the call becomes the ``protos.errors`` class the
worker client maps it to (``WorkerUnreachable`` for a lost worker); an
in-stream ``error_message`` ends the request with ``InvalidArgument`` where
an infergate worker names that status beside it
(``execution.decoupled.stream_error_code``: a prompt longer than the
context; the request's fault, never charged to the worker), or else with
:class:`ModelStreamError`, the worker's own words; a generation backend's
refusal when its sequences or cache are full ("... is at capacity (N
sequences); retry later") is ``WorkerBusy``, retried on another replica
before the first response.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from typing import Protocol

import grpc
from tritonclient.grpc import service_pb2

from execution.decoupled import stream_error_code
from gateway.fleet.worker_client import WorkerBusy
from protos.errors import DeadlineExceeded, InferGateError, Internal, InvalidArgument, Unavailable

EMPTY_FINAL = "triton_enable_empty_final_response"
FINAL_RESPONSE = "triton_final_response"
# How long a call whose final response came may take to close before it is cancelled.
CLOSE_WAIT_S = 1.0
# The generative contract's words for a worker whose generation capacity is full.
_AT_CAPACITY = re.compile(r"is at capacity \(\d+ sequences?\); retry later")


class ModelStreamError(Internal):
    """The worker ended a streamed request with an in-stream error: its words, no status code."""


class StreamingClient(Protocol):
    """What a streamed call needs of a worker client (``gateway.fleet.worker_client.WorkerClient``)."""

    address: str

    def stream_call(self, timeout_s: float | None) -> grpc.aio.StreamStreamCall: ...

    def map_error(self, e: grpc.aio.AioRpcError) -> InferGateError: ...


def is_final(response: service_pb2.ModelInferResponse) -> bool:
    # A parameter set as anything but a bool reads False here (the oneof's other member).
    param = response.parameters.get(FINAL_RESPONSE)
    return param is not None and param.bool_param


async def stream_responses(
    client: StreamingClient, request: service_pb2.ModelInferRequest, timeout_s: float | None,
) -> AsyncIterator[tuple[service_pb2.ModelInferResponse, float]]:
    """Each response of ``request`` with its arrival time (``time.monotonic``), in the worker's order.

    The last one yielded is final. The caller must close the generator
    (``contextlib.aclosing``): closing it early cancels the worker's call.
    """
    request.parameters[EMPTY_FINAL].bool_param = True
    call = client.stream_call(timeout_s)
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
                        f"worker {client.address} ended the stream of request '{request.id}' without a final response")
                arrived = time.monotonic()
                if message.error_message:
                    if _AT_CAPACITY.search(message.error_message):
                        raise WorkerBusy(message.error_message)
                    if stream_error_code(message) is grpc.StatusCode.INVALID_ARGUMENT:
                        raise InvalidArgument(message.error_message)  # the request's fault, as the worker judged it
                    raise ModelStreamError(message.error_message)
                response = message.infer_response
                ended = is_final(response)
                received += 1
                yield response, arrived
                if ended:
                    return
        except grpc.aio.AioRpcError as e:
            if e.code() is grpc.StatusCode.DEADLINE_EXCEEDED:  # gRPC's own words here are "Stream removed"
                raise DeadlineExceeded(
                    f"deadline exceeded while request '{request.id}' of model '{request.model_name}' was "
                    f"streaming from worker {client.address}, after {received} response(s)") from None
            raise client.map_error(e) from None
        except grpc.aio.UsageError as e:  # the channel was closed under the call
            raise Unavailable(f"worker {client.address}: {e}") from None
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
