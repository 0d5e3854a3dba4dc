"""The worker's ``inference.GRPCInferenceService``: the KServe v2 RPCs with
Triton's extensions (model configuration, repository, statistics), on
grpc.aio, over the :class:`~execution.manager.ModelManager`.

This module is the worker's one error edge: handlers raise
``protos.errors.InferGateError`` subclasses and :func:`_rpc` turns them into
gRPC statuses (``ModelStreamInfer`` into in-stream ``error_message``s).
Anything else is logged with its traceback and answered with an INTERNAL
naming the exception (its message cleaned of paths). It also counts the
requests in progress (a decoupled model's until its final response) so
shutdown can wait for them before cancelling idle streams. A decoupled
model's request on ``ModelStreamInfer`` is served by ``execution.decoupled``;
``ModelInfer`` refuses it (UNIMPLEMENTED, Triton's words).
"""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from protos.errors import retry_metadata
from serverkit import tracing
from execution.answers import as_error, load_arguments, model_metadata
from execution.decoupled import serve_decoupled, stream_error_response
from execution.manager import ModelManager
from protos.stream_pack import asks_packing, cancels, take_key
from workers.stream_writers import DirectWriter, PackedWriter

logger = logging.getLogger(__name__)

SERVER_NAME = "infergate-worker"
EXTENSIONS = ("model_configuration", "model_repository", "model_repository(unload_dependents)", "statistics")
# Requests of one ModelStreamInfer call that may run at once; reading the
# stream pauses beyond it, so a fast client meets gRPC flow control, not memory growth.
STREAM_CONCURRENCY = 64
# On a gateway's packed call: every stream the gateway sends this worker (its router bounds them).
PACKED_STREAM_CONCURRENCY = 4096

_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")
_Handler = Callable[[Any, _Req, grpc.aio.ServicerContext], Awaitable[_Resp]]


def _package_version() -> str:
    try:
        return importlib.metadata.version("infergate")
    except importlib.metadata.PackageNotFoundError:
        return "0.0.0"


def _rpc(handler: _Handler[_Req, _Resp]) -> _Handler[_Req, _Resp]:
    """Count the call as in progress and map errors to a gRPC status."""

    @functools.wraps(handler)
    async def wrapper(self: InferenceService, request: _Req, context: grpc.aio.ServicerContext) -> _Resp:
        self.begin_request()
        try:
            return await handler(self, request, context)
        except Exception as exc:
            error = as_error(exc, handler.__name__)
        finally:
            self.end_request()
        # A refusal (the model's queue is full) carries its retry hint, as the gateway's do.
        await context.abort(error.grpc_code, error.message, trailing_metadata=retry_metadata(error))
        raise AssertionError("unreachable: abort raises")

    return wrapper


async def _write_keyed(write: Callable[[service_pb2.ModelStreamInferResponse], Awaitable[None]], key: str,
                       response: service_pb2.ModelStreamInferResponse) -> None:
    """A packed call's response goes out under its request's key (``protos.stream_pack``)."""
    response.infer_response.id = key
    await write(response)


class InferenceService(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, manager: ModelManager) -> None:
        self.manager = manager
        self._version = _package_version()
        self._shutting_down = False
        self._active = 0
        self._started = 0  # requests ever begun: shutdown watches it for late arrivals
        self._idle = asyncio.Event()
        self._idle.set()

    # --- in-progress accounting (event loop thread only) -------------------------

    def begin_request(self) -> None:
        self._active += 1
        self._started += 1
        self._idle.clear()

    def end_request(self) -> None:
        self._active -= 1
        if self._active == 0:
            self._idle.set()

    def begin_shutdown(self) -> None:
        """ServerReady turns false; requests still arriving are served until the listener closes."""
        self._shutting_down = True

    @property
    def requests_started(self) -> int:
        return self._started

    @property
    def idle(self) -> bool:
        return self._active == 0

    async def wait_idle(self) -> None:
        """Return once no request (unary call, or request read from a stream) is in progress."""
        await self._idle.wait()

    # --- health and metadata --------------------------------------------------------

    @_rpc
    async def ServerLive(self, request: service_pb2.ServerLiveRequest, context: Any) -> service_pb2.ServerLiveResponse:
        return service_pb2.ServerLiveResponse(live=True)

    @_rpc
    async def ServerReady(self, request: service_pb2.ServerReadyRequest, context: Any) -> service_pb2.ServerReadyResponse:
        return service_pb2.ServerReadyResponse(ready=not self._shutting_down)

    @_rpc
    async def ServerMetadata(
        self, request: service_pb2.ServerMetadataRequest, context: Any
    ) -> service_pb2.ServerMetadataResponse:
        return service_pb2.ServerMetadataResponse(name=SERVER_NAME, version=self._version, extensions=list(EXTENSIONS))

    @_rpc
    async def ModelReady(self, request: service_pb2.ModelReadyRequest, context: Any) -> service_pb2.ModelReadyResponse:
        return service_pb2.ModelReadyResponse(ready=self.manager.is_ready(request.name, request.version))

    @_rpc
    async def ModelMetadata(
        self, request: service_pb2.ModelMetadataRequest, context: Any
    ) -> service_pb2.ModelMetadataResponse:
        return model_metadata(self.manager, request.name, request.version)

    @_rpc
    async def ModelConfig(self, request: service_pb2.ModelConfigRequest, context: Any) -> service_pb2.ModelConfigResponse:
        model = self.manager.get(request.name, request.version)
        return service_pb2.ModelConfigResponse(config=model.config)

    @_rpc
    async def ModelStatistics(
        self, request: service_pb2.ModelStatisticsRequest, context: Any
    ) -> service_pb2.ModelStatisticsResponse:
        return service_pb2.ModelStatisticsResponse(model_stats=self.manager.statistics(request.name, request.version))

    # --- inference ----------------------------------------------------------------------

    @_rpc
    async def ModelInfer(self, request: service_pb2.ModelInferRequest, context: Any) -> service_pb2.ModelInferResponse:
        # No await between the lookup and infer() counting itself in flight: see execution.model.
        if tracing.tracer is None:  # tracing off: this one check
            return await self.manager.get(request.model_name, request.model_version).infer(request)
        # The compute span, a child of the caller's span when its traceparent says so.
        with tracing.server_span(f"compute {request.model_name}", context.invocation_metadata() or (),
                                 {"infergate.model": request.model_name, "infergate.model_version": request.model_version}):
            return await self.manager.get(request.model_name, request.model_version).infer(request)

    async def ModelStreamInfer(
        self,
        request_iterator: AsyncIterator[service_pb2.ModelInferRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
        """Each request runs concurrently; responses go out as they complete, errors in-stream.

        A decoupled model's request holds its slot until its last response.
        A gateway's packed call (``protos.stream_pack``) gets its responses
        packed, each request's under its key, and may cancel a request by its key.
        """
        packed = asks_packing(context.invocation_metadata())
        tasks: set[asyncio.Task[None]] = set()
        writer = PackedWriter(context, lone=lambda: len(tasks) == 1) if packed else DirectWriter(context)
        slots = asyncio.Semaphore(PACKED_STREAM_CONCURRENCY if packed else STREAM_CONCURRENCY)
        running: dict[str, asyncio.Task[None]] = {}  # a packed call's requests, by key, for their cancel

        def done(task: asyncio.Task[None], key: str | None) -> None:
            tasks.discard(task)
            if key is not None and running.get(key) is task:
                del running[key]
            slots.release()
            self.end_request()

        async def serve(request: service_pb2.ModelInferRequest, key: str | None) -> None:
            write = writer.write if key is None else functools.partial(_write_keyed, writer.write, key)
            try:
                model = self.manager.get(request.model_name, request.model_version)
                if model.decoupled:
                    await serve_decoupled(model, request, write)
                    return
                response = service_pb2.ModelStreamInferResponse(infer_response=await model.infer(request))
            except Exception as exc:
                response = stream_error_response(request, as_error(exc, "ModelStreamInfer"))
            await write(response)

        try:
            async for request in request_iterator:
                if packed and cancels(request):
                    task = running.pop(request.id, None)
                    if task is not None:
                        task.cancel()  # closes its model's stream: the request ends on the worker
                    continue
                key = take_key(request) if packed else None
                await slots.acquire()
                self.begin_request()
                task = asyncio.get_running_loop().create_task(serve(request, key))
                tasks.add(task)
                if key is not None:
                    running[key] = task
                # A done-callback, not a finally in serve(): it runs even for a
                # task cancelled before its first step.
                task.add_done_callback(functools.partial(done, key=key))
            # The client half-closed: answer what is still running, then end the call.
            while tasks:
                await asyncio.gather(*tasks, return_exceptions=packed)
            await writer.close()
        finally:
            # Reached with tasks left only when the call is cancelled (client gone).
            for task in tasks:
                task.cancel()
            writer.cancel()

    # --- repository ---------------------------------------------------------------------

    @_rpc
    async def RepositoryIndex(
        self, request: service_pb2.RepositoryIndexRequest, context: Any
    ) -> service_pb2.RepositoryIndexResponse:
        return service_pb2.RepositoryIndexResponse(models=await self.manager.index(request.ready))

    @_rpc
    async def RepositoryModelLoad(
        self, request: service_pb2.RepositoryModelLoadRequest, context: Any
    ) -> service_pb2.RepositoryModelLoadResponse:
        config_json, files = load_arguments(request.parameters)
        logger.info("load model %s%s", request.model_name, " with override" if config_json or files else "")
        await self.manager.load(request.model_name, config_json=config_json, files=files)
        return service_pb2.RepositoryModelLoadResponse()

    @_rpc
    async def RepositoryModelUnload(
        self, request: service_pb2.RepositoryModelUnloadRequest, context: Any
    ) -> service_pb2.RepositoryModelUnloadResponse:
        # unload_dependents is accepted and moot: this worker has no ensembles.
        await self.manager.unload(request.model_name)
        return service_pb2.RepositoryModelUnloadResponse()
