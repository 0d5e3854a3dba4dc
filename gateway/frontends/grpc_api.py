"""The gateway's gRPC frontend: KServe v2 ``inference.GRPCInferenceService``
plus the standard gRPC health service, in front of an ``InferenceCore``.

Owns the client deadline and cancellation hand-off to the core; the
bidirectional inference stream is ``gateway.frontends.grpc_streams``. The wire <-> ``InferRequest``/``InferResponse``
conversion is ``gateway.frontends.grpc_wire``; the one place where errors
become gRPC statuses ``gateway.frontends.grpc_errors``; the health service
``gateway.frontends.grpc_health``.

The ``grpc.aio.Server`` itself (ports, message size limits, TLS, start and
stop) belongs to the application, which calls :func:`add_grpc_services`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from gateway.frontends.grpc_errors import unary_edge
from gateway.frontends.grpc_health import HealthServicer
from gateway.frontends.grpc_streams import StreamSession
from gateway.frontends.grpc_wire import apply_client_deadline, decode_infer_request, encode_infer_response, relay_call
from gateway.frontends.log_settings import LogSettings
from gateway.observability.tracing import RequestTracing
from gateway.requests.shared_memory import SharedMemoryRegistry, advertise
from gateway.types import InferenceCore, NotRelayed, single_response_endpoint
from protos import wire

SERVICE_NAME = "inference.GRPCInferenceService"


def _setting_value(value: Any) -> Any:
    which = value.WhichOneof("parameter_choice")
    return None if which is None else getattr(value, which)


# ---- the service ----------------------------------------------------------------


class _InferenceServicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(
        self, core: InferenceCore, *, max_stream_inflight: int, shm: SharedMemoryRegistry, logs: LogSettings,
        tracing: RequestTracing,
    ) -> None:
        self._core = core
        self._shm = shm
        self._logs = logs
        self._tracing = tracing
        self._max_stream_inflight = max_stream_inflight
        self.serving = False  # ServerReady follows GrpcFrontend.set_serving

    # -- health and metadata

    @unary_edge
    async def ServerLive(self, request: Any, context: Any) -> service_pb2.ServerLiveResponse:
        return service_pb2.ServerLiveResponse(live=self._core.server_live())

    @unary_edge
    async def ServerReady(self, request: Any, context: Any) -> service_pb2.ServerReadyResponse:
        return service_pb2.ServerReadyResponse(ready=self.serving and self._core.server_ready())

    @unary_edge
    async def ServerMetadata(self, request: Any, context: Any) -> service_pb2.ServerMetadataResponse:
        return advertise(self._core.server_metadata(), self._shm)

    @unary_edge
    async def ModelReady(self, request: Any, context: Any) -> service_pb2.ModelReadyResponse:
        return service_pb2.ModelReadyResponse(ready=self._core.model_ready(request.name, request.version))

    @unary_edge
    async def ModelMetadata(self, request: Any, context: Any) -> service_pb2.ModelMetadataResponse:
        return self._core.model_metadata(request.name, request.version)

    @unary_edge
    async def ModelConfig(self, request: Any, context: Any) -> service_pb2.ModelConfigResponse:
        return service_pb2.ModelConfigResponse(config=self._core.model_config(request.name, request.version))

    @unary_edge
    async def ModelStatistics(self, request: Any, context: Any) -> service_pb2.ModelStatisticsResponse:
        return await self._core.model_statistics(request.name, request.version)

    # -- repository

    @unary_edge
    async def RepositoryIndex(self, request: Any, context: Any) -> service_pb2.RepositoryIndexResponse:
        return await self._core.repository_index(ready_only=request.ready)

    @unary_edge
    async def RepositoryModelLoad(self, request: Any, context: Any) -> service_pb2.RepositoryModelLoadResponse:
        await self._core.load_model(request.model_name, dict(request.parameters))
        return service_pb2.RepositoryModelLoadResponse()

    @unary_edge
    async def RepositoryModelUnload(self, request: Any, context: Any) -> service_pb2.RepositoryModelUnloadResponse:
        param = request.parameters.get("unload_dependents")
        dependents = param is not None and param.WhichOneof("parameter_choice") == "bool_param" and param.bool_param
        await self._core.unload_model(request.model_name, unload_dependents=dependents)
        return service_pb2.RepositoryModelUnloadResponse()

    # -- inference

    @unary_edge
    async def ModelInfer(
        self, received: wire.ReceivedInferRequest, context: Any
    ) -> service_pb2.ModelInferResponse | wire.RawInferResponse | bytes:
        # The call's bytes come with it (see add_grpc_services): a call no gateway feature needs to read
        # goes on as those bytes, and its answer comes back as the replica's (gateway.core.relay).
        header = received.header
        if self._core.relays(header.model_name, header.model_version) and not self._tracing.settings.active:
            call = relay_call(received)
            if call is not None:
                apply_client_deadline(call, context)
                try:
                    return await self._core.relay(call)
                except NotRelayed:
                    pass  # the model left the lane meanwhile: the call is read after all
        # A large message arrives with its tensors kept aside.
        request = received.message
        if isinstance(request, wire.RawInferRequest):
            req = decode_infer_request(request.header, raw=request.raw, shm=self._shm)
        else:
            req = decode_infer_request(request, shm=self._shm)
        apply_client_deadline(req, context)
        single_response_endpoint.set("ModelInfer RPC")  # Triton's words for a decoupled model here
        # Awaited in the RPC's own task: a client cancel or an expired deadline
        # cancels this task, and with it everything the core awaits for us.
        with self._tracing.request(req, context.invocation_metadata, "GRPC"):  # a no-op unless traced
            return encode_infer_response(await self._core.infer(req), req, raw_aside=True)

    async def ModelStreamInfer(
        self, request_iterator: AsyncIterator[service_pb2.ModelInferRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[service_pb2.ModelStreamInferResponse]:
        """Requests of one stream run concurrently; each response goes out as it comes (``grpc_streams``)."""
        session = StreamSession(self._core, context, max_inflight=self._max_stream_inflight, shm=self._shm,
                                tracing=self._tracing)
        async with aclosing(session.run(request_iterator)) as responses:
            async for response in responses:
                yield response

    # -- shared memory (gateway.requests.shared_memory; the registry is the HTTP frontend's too)

    @unary_edge
    async def SystemSharedMemoryStatus(self, request: Any, context: Any) -> Any:
        out = service_pb2.SystemSharedMemoryStatusResponse
        return out(regions={r.name: out.RegionStatus(name=r.name, key=r.key, offset=r.offset, byte_size=r.byte_size)
                            for r in self._shm.status(request.name)})

    @unary_edge
    async def SystemSharedMemoryRegister(self, request: Any, context: Any) -> Any:
        await self._shm.apply_register(request.name, request.key, request.offset, request.byte_size)
        return service_pb2.SystemSharedMemoryRegisterResponse()

    @unary_edge
    async def SystemSharedMemoryUnregister(self, request: Any, context: Any) -> Any:
        await self._shm.apply_unregister(request.name)
        return service_pb2.SystemSharedMemoryUnregisterResponse()

    @unary_edge
    async def CudaSharedMemoryStatus(self, request: Any, context: Any) -> Any:
        out = service_pb2.CudaSharedMemoryStatusResponse
        return out(regions={r.name: out.RegionStatus(name=r.name, device_id=r.device_id, byte_size=r.byte_size)
                            for r in self._shm.cuda_status(request.name)})

    @unary_edge
    async def CudaSharedMemoryRegister(self, request: Any, context: Any) -> Any:
        await self._shm.apply_register_cuda(request.name, request.raw_handle, request.device_id, request.byte_size)
        return service_pb2.CudaSharedMemoryRegisterResponse()

    @unary_edge
    async def CudaSharedMemoryUnregister(self, request: Any, context: Any) -> Any:
        await self._shm.apply_unregister_cuda(request.name)
        return service_pb2.CudaSharedMemoryUnregisterResponse()

    # -- logging (gateway.frontends.log_settings; shared with the HTTP frontend)

    @unary_edge
    async def LogSettings(self, request: Any, context: Any) -> service_pb2.LogSettingsResponse:
        wanted = {key: _setting_value(v) for key, v in request.settings.items()}
        current = await self._logs.apply(wanted) if wanted else self._logs.current()
        response = service_pb2.LogSettingsResponse()
        for key, value in current.items():
            slot = response.settings[key]
            if isinstance(value, bool):
                slot.bool_param = value
            elif isinstance(value, int):
                slot.uint32_param = value
            else:
                slot.string_param = value
        return response

    # -- trace settings (gateway.observability.trace_settings; shared with the HTTP frontend)

    @unary_edge
    async def TraceSetting(self, request: Any, context: Any) -> service_pb2.TraceSettingResponse:
        settings = self._tracing.settings
        wanted = {key: list(v.value) for key, v in request.settings.items()}
        current = await settings.apply(request.model_name, wanted) if wanted else settings.current(request.model_name)
        response = service_pb2.TraceSettingResponse()
        for key, value in current.items():
            response.settings[key].value.extend(value if isinstance(value, list) else [value])
        return response


# ---- wiring ---------------------------------------------------------------------


class GrpcFrontend:
    """Handle on the registered services, for the application's start/stop sequence."""

    def __init__(self, servicer: _InferenceServicer, health: HealthServicer) -> None:
        self._servicer = servicer
        self._health = health

    @property
    def serving(self) -> bool:
        return self._servicer.serving

    def set_serving(self, serving: bool) -> None:
        """Flip the health status ("" and the inference service) and ServerReady.

        Call on the server's event loop: True once the whole application
        serves, False first thing on shutdown so balancers stop sending while
        in-flight requests drain.
        """
        self._servicer.serving = serving
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", SERVICE_NAME):
            self._health.set(service, status)


def add_grpc_services(
    server: grpc.aio.Server,
    core: InferenceCore,
    *,
    serving: bool = False,
    max_stream_inflight: int = 256,
    shm: SharedMemoryRegistry | None = None,
    logs: LogSettings | None = None,
    tracing: RequestTracing | None = None,
) -> GrpcFrontend:
    """Register the KServe v2 inference service and the health service on ``server``.

    Health (and ServerReady) start as ``serving``: by default NOT_SERVING
    until the application calls ``set_serving(True)``. ``max_stream_inflight``
    bounds the requests of one ModelStreamInfer stream that run or wait to be
    written at the same time. ``shm`` is the shared-memory region registry
    and ``logs`` the log settings (give the HTTP frontend's; fresh ones when
    not given); ``tracing`` the core's request tracing (off when not given).
    """
    if max_stream_inflight < 1:
        raise ValueError("max_stream_inflight must be at least 1")
    servicer = _InferenceServicer(
        core,
        max_stream_inflight=max_stream_inflight,
        shm=shm if shm is not None else SharedMemoryRegistry(),
        logs=logs if logs is not None else LogSettings(),
        tracing=tracing if tracing is not None else RequestTracing.off(),
    )
    servicer.serving = serving
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    health = HealthServicer(("", SERVICE_NAME), status)
    # ModelInfer with the large-message codec (protos.wire): tensors of a large
    # request stay views of the received bytes and large outputs are written
    # without a copy into protobuf; the bytes are kept for the relay lane, whose
    # answers are bytes and go out as they are. Registered first, so it is the one found.
    infer = grpc.unary_unary_rpc_method_handler(
        servicer.ModelInfer, request_deserializer=wire.receive_infer_request, response_serializer=wire.serialize
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, {"ModelInfer": infer}),))
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    return GrpcFrontend(servicer, health)
