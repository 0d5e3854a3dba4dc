"""One streamed request on the gateway's local replica, shaped as the gRPC
call that ``gateway.fleet.stream_call`` drives for a remote worker
(``write``, ``done_writing``, ``read`` until ``grpc.aio.EOF``, ``code``,
``cancel``), so a decoupled model streams in-process by the same path.

``done_writing`` starts the model's execution as a task (the execution
package's ``serve_decoupled``, as the worker's ``ModelStreamInfer`` runs
it); each response it sends lands in a queue ``read`` takes from. An error
comes as an in-stream ``error_message``, as a worker sends it. The deadline
bounds the whole call: past it ``read`` raises ``DeadlineExceeded``, and
``cancel`` (the client went away, the answer is complete) cancels the task,
which cancels the request at the model.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

import grpc
from tritonclient.grpc import service_pb2

from execution.answers import as_error
from execution.decoupled import serve_decoupled, stream_error_response
from execution.model import LoadedModel
from protos.errors import DeadlineExceeded, InvalidArgument

_Message = service_pb2.ModelStreamInferResponse | Any  # or grpc.aio.EOF


class ModelLookup(Protocol):
    """Where a local call finds its model: the local replica's model manager, or a gateway's split decoders."""

    def get(self, name: str, version: str = "") -> LoadedModel: ...


class LocalStreamCall:
    """The in-process counterpart of one ``ModelStreamInfer`` call carrying one request."""

    def __init__(self, manager: ModelLookup, timeout_s: float | None, where: str) -> None:
        self._manager = manager
        self._where = where
        loop = asyncio.get_running_loop()
        self._deadline = None if timeout_s is None else loop.time() + timeout_s
        # Bounded by one request's responses: the model's thread cannot wait on it (execution.model).
        self._messages: asyncio.Queue[_Message] = asyncio.Queue()
        self._request: service_pb2.ModelInferRequest | None = None
        self._task: asyncio.Task[None] | None = None

    async def write(self, request: service_pb2.ModelInferRequest) -> None:
        if self._request is not None:
            raise InvalidArgument("one request per local stream call")
        self._request = request

    async def done_writing(self) -> None:
        if self._request is None or self._task is not None:
            return
        self._task = asyncio.get_running_loop().create_task(self._serve(self._request), name="local-stream")

    async def _serve(self, request: service_pb2.ModelInferRequest) -> None:
        try:
            # No await between the lookup and the stream counting itself in flight (execution.model).
            model = self._manager.get(request.model_name, request.model_version)
            await serve_decoupled(model, request, self._put)
        except Exception as exc:
            self._messages.put_nowait(stream_error_response(request, as_error(exc, "ModelStreamInfer", self._where)))
        finally:
            self._messages.put_nowait(grpc.aio.EOF)

    async def _put(self, message: service_pb2.ModelStreamInferResponse) -> None:
        self._messages.put_nowait(message)

    async def read(self) -> _Message:
        if self._deadline is None:
            return await self._messages.get()
        try:
            async with asyncio.timeout_at(self._deadline):
                return await self._messages.get()
        except TimeoutError:
            self.cancel()
            request = self._request
            raise DeadlineExceeded(
                f"deadline exceeded while request '{request.id if request else ''}' of model "
                f"'{request.model_name if request else ''}' was streaming from {self._where}") from None

    async def code(self) -> grpc.StatusCode:
        if self._task is not None:
            await asyncio.wait({self._task})
        return grpc.StatusCode.OK

    def cancel(self) -> bool:
        if self._task is None or self._task.done():
            return False
        return self._task.cancel()
