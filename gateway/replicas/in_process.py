"""One streamed request of a decoupled model run in this process: the local
replica's streams, and a gateway's split decoders'.

The model's execution runs as a task (the execution package's
``serve_decoupled``, as a worker's ``ModelStreamInfer`` runs it); each
message it sends lands in a queue the stream reads, and is read as a
worker's streamed message is (``gateway.replicas.grpc_stream.answer_of``:
an error ends the request with the same classes). The deadline bounds the
whole stream: past it the stream raises ``DeadlineExceeded``. Closing the
stream before its end (the client went away, the deadline passed) cancels
the task, which cancels the request at the model.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Protocol

from tritonclient.grpc import service_pb2

from execution.answers import as_error
from execution.decoupled import serve_decoupled, stream_error_response
from execution.model import LoadedModel
from gateway.replicas.grpc_stream import CLOSE_WAIT_S, answer_of, deadline_passed
from gateway.replicas.replica import StreamItem
from protos.errors import Unavailable
from protos.triton_words import ask_empty_final, is_final

_END = object()


class ModelLookup(Protocol):
    """Where an in-process stream finds its model: the local replica's model manager, or a gateway's split decoders."""

    def get(self, name: str, version: str = "") -> LoadedModel: ...


async def in_process_stream(
    models: ModelLookup, request: service_pb2.ModelInferRequest, timeout_s: float | None, where: str,
) -> AsyncIterator[StreamItem]:
    """Each response of ``request``, run on its model in ``models``, with its arrival time; the last one final.

    ``where`` names the place in errors ("the gateway's local replica").
    """
    ask_empty_final(request)
    loop = asyncio.get_running_loop()
    deadline = None if timeout_s is None else loop.time() + timeout_s
    # Bounded by one request's responses: the model's thread cannot wait on it (execution.model).
    messages: asyncio.Queue[service_pb2.ModelStreamInferResponse | object] = asyncio.Queue()

    async def put(message: service_pb2.ModelStreamInferResponse) -> None:
        messages.put_nowait(message)

    async def serve() -> None:
        try:
            # No await between the lookup and the stream counting itself in flight (execution.model).
            model = models.get(request.model_name, request.model_version)
            await serve_decoupled(model, request, put)
        except Exception as exc:
            messages.put_nowait(stream_error_response(request, as_error(exc, "ModelStreamInfer", where)))
        finally:
            messages.put_nowait(_END)

    task = loop.create_task(serve(), name="in-process-stream")
    received = 0
    ended = False
    try:
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    message = await messages.get()
            except TimeoutError:
                raise deadline_passed(request, where, received) from None
            if message is _END:
                raise Unavailable(f"{where} ended the stream of request '{request.id}' without a final response")
            arrived = time.monotonic()
            response = answer_of(message)  # type: ignore[arg-type]
            received += 1
            ended = is_final(response)
            yield response, arrived
            if ended:
                return
    finally:
        if ended:  # answered in full: the model's task ends by itself
            await asyncio.wait({task}, timeout=CLOSE_WAIT_S)
        if not task.done():
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)
