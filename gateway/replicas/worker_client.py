"""The gateway's client for one KServe v2 gRPC server: an infergate worker or a
real Triton Inference Server, spoken to through the same generated stubs; a
``gateway.replicas.replica.Replica``.

It owns two channels to the worker, each its own HTTP/2 connection: the data
channel carries inference and model loads (tensors and files, up to
gigabytes), the control channel the small calls (health, metadata, index,
config, statistics). A probe never waits behind a bulk transfer on a
connection's flow-control window and write queue, so a worker busy receiving
a large request still answers its probe in time. It also owns the
per-call metadata and the one place where a worker's gRPC status becomes a
``protos.errors`` exception. Transport failures (refused, reset, closed
connection) become ``WorkerUnreachable``, an ``Unavailable`` the router
retries elsewhere and that lets it mark the worker down at once. Three answers
of a live Triton server get classes of their own, still ``Unavailable`` (the
code passes through unchanged): ``RestrictedProtocol`` (a protocol group
its headers do not unlock), ``ModelNotReady`` (a model unloading) and
``ModelControlDisabled`` (no explicit model control, so no load or unload);
a worker whose queue is full answers ``WorkerBusy``, an ``Overloaded``
(all in ``gateway.replicas.errors``).

A streamed request (``stream``) goes on a ``ModelStreamInfer`` call of its
own (``gateway.replicas.grpc_stream``), or, to an infergate worker with
``packed_streams``, on the worker's one packed call
(``gateway.replicas.packed_streams``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import TypeVar

import grpc
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

from gateway.replicas.errors import (ModelControlDisabled, ModelNotReady, PingsRefused, RestrictedProtocol,
                                     WorkerBusy, WorkerUnreachable)
from gateway.replicas.grpc_stream import call_responses
from gateway.replicas.packed_streams import PackedStreams
from gateway.replicas.replica import StreamItem
from gateway.replicas.unary_stream import InferStream
from protos import collective_pb2, wire
from protos.collective_pb2_grpc import CollectiveStub
from protos.errors import InferGateError, from_grpc_code
from serverkit import tracing
from serverkit.grpc_server import is_ping_refusal, keepalive_channel_options, keepalive_time_ms

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 2**31 - 1
# The two channels of a client: bulk calls, and the small calls probes make.
_DATA = "data"
_SERVICE = "inference.GRPCInferenceService"
_CONTROL = "control"

# Codes a broken connection surfaces as. UNAVAILABLE is the usual one; a
# connection torn down mid-call can also end as INTERNAL/UNKNOWN/CANCELLED.
# They only count as transport failures when the channel has lost its
# connection too (see WorkerClient._map_error).
_TRANSPORT_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED}
)

_Resp = TypeVar("_Resp")


def _retry_after_s(e: grpc.aio.AioRpcError) -> float | None:
    """The retry hint a worker sent with a refusal (``grpc-retry-pushback-ms`` or ``retry-after``), if any."""
    trailing = dict(e.trailing_metadata() or ())
    try:
        if "grpc-retry-pushback-ms" in trailing:
            return max(0.001, int(trailing["grpc-retry-pushback-ms"]) / 1000)
        if "retry-after" in trailing:
            return max(0.001, float(trailing["retry-after"]))
    except (TypeError, ValueError):
        pass  # a malformed hint is no hint
    return None


class WorkerClient:
    """Async client for one worker at ``address`` (``HOST:PORT``).

    ``headers`` go out as gRPC metadata on every call: Triton's restricted
    protocols (``--grpc-restricted-protocol``) check them on statistics and
    repository calls, and they cost nothing elsewhere. ``credentials`` makes
    the channel TLS (mTLS when it carries a client key and certificate).
    """

    def __init__(
        self,
        address: str,
        *,
        kind: str = "infergate",
        headers: Mapping[str, str] | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        reconnect_backoff_max_ms: int = 1000,
        keepalive_ms: int | None = None,
        stream_calls: bool = False,
        packed_streams: bool = False,
    ) -> None:
        self.address = address
        self.kind = kind
        # gRPC metadata keys must be lower case.
        self._metadata: tuple[tuple[str, str], ...] = tuple((k.lower(), v) for k, v in (headers or {}).items())
        # Built once: from a tuple, grpc.aio would build one on every call (it only reads it).
        self._call_metadata = grpc.aio.Metadata(*self._metadata)
        self._credentials = credentials
        self._options = [
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            # gRPC's default reconnect backoff grows to two minutes; a worker
            # that restarts must be reachable again by the next probe.
            ("grpc.initial_reconnect_backoff_ms", min(100, reconnect_backoff_max_ms)),
            ("grpc.max_reconnect_backoff_ms", reconnect_backoff_max_ms),
            # A connection whose peer went silent (a cut link: no reset, no
            # refusal) is closed when a ping goes unanswered, and the channel
            # reconnects; without it, calls queue on the dead connection until
            # TCP's retransmission timer, backed off to minutes, fires again.
            # Pings go only while calls are open, no more often than the worker's kind accepts.
            *keepalive_channel_options(keepalive_ms or keepalive_time_ms(kind)),
        ]
        # Made on first use: a grpc.aio channel belongs to the event loop it is
        # created on, and clients may be built before the gateway's loop runs.
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, service_pb2_grpc.GRPCInferenceServiceStub] = {}
        # ModelInfer on the data channel, serializing requests whose large tensors are kept aside (protos.wire).
        self._model_infer: grpc.aio.UnaryUnaryMultiCallable | None = None
        self._relayed: grpc.aio.UnaryUnaryMultiCallable | None = None  # ModelInfer on bytes (relay)
        # With stream_calls, small inference calls to an infergate worker go as
        # messages of one stream (gateway.replicas.unary_stream); large ones stay
        # unary, so a big tensor never holds up the stream's other messages.
        self._stream_calls = stream_calls and kind == "infergate"
        self._stream: InferStream | None = None
        # With packed_streams, every streamed request to an infergate worker shares
        # one call whose responses come packed (gateway.replicas.packed_streams).
        self._packed: PackedStreams | None = None
        if packed_streams and kind == "infergate":
            self._packed = PackedStreams(lambda md: self._service(_DATA).ModelStreamInfer(metadata=md),
                                         self._call_metadata, address, self._packed_call_lost)
        self._collective: CollectiveStub | None = None
        self._closed = False

    def _service(self, lane: str = _DATA) -> service_pb2_grpc.GRPCInferenceServiceStub:
        if self._closed:
            raise WorkerUnreachable(f"worker {self.address}: client closed")
        stub = self._stubs.get(lane)
        if stub is None:
            # A channel of its own subchannel pool opens its own connection: two
            # channels to one address would otherwise share one.
            options = [*self._options, ("grpc.use_local_subchannel_pool", 1)]
            if self._credentials is None:
                channel = grpc.aio.insecure_channel(self.address, options=options)
            else:
                channel = grpc.aio.secure_channel(self.address, self._credentials, options=options)
            self._channels[lane] = channel
            stub = self._stubs[lane] = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        return stub

    def _control(self) -> service_pb2_grpc.GRPCInferenceServiceStub:
        return self._service(_CONTROL)

    def __repr__(self) -> str:
        return f"WorkerClient({self.address!r}, kind={self.kind!r})"

    @property
    def closed(self) -> bool:
        return self._closed

    def connected(self, lane: str = _DATA) -> bool:
        """Whether the lane's channel holds a live connection right now (no I/O)."""
        channel = self._channels.get(lane)
        if channel is None:
            return False
        return channel.get_state(try_to_connect=False) == grpc.ChannelConnectivity.READY

    async def _call(
        self, method: Callable[..., Awaitable[_Resp]], request: object, timeout_s: float | None, lane: str = _CONTROL,
        metadata: grpc.aio.Metadata | None = None,
    ) -> _Resp:
        try:
            return await method(request, timeout=timeout_s, metadata=metadata or self._call_metadata)
        except grpc.aio.AioRpcError as e:
            raise self._map_error(e, lane) from None
        except grpc.aio.UsageError as e:
            # Raised when the channel was closed under a pending call.
            raise WorkerUnreachable(f"worker {self.address}: {e}") from None

    def _map_error(self, e: grpc.aio.AioRpcError, lane: str = _DATA) -> InferGateError:
        code = e.code()
        details = e.details() or code.name
        if code is grpc.StatusCode.UNAVAILABLE and is_ping_refusal(details):
            return PingsRefused(f"worker {self.address}: {details}")
        # A worker that answers UNAVAILABLE itself (model not ready, shutting
        # down) keeps its connection; a dead or unreachable one does not. The
        # channel leaves READY before the failed call is reported, so its
        # state tells the two apart without parsing messages.
        if code in _TRANSPORT_CODES and (self._closed or not self.connected(lane)):
            return WorkerUnreachable(f"worker {self.address} unreachable: {details}")
        if code is grpc.StatusCode.CANCELLED:
            # Our own cancellations surface as asyncio.CancelledError, never as a
            # status: a CANCELLED status is the worker's doing (a server that is
            # stopping cancels the calls it holds), so it is retried elsewhere.
            return WorkerUnreachable(f"worker {self.address} cancelled the call: {details}")
        if code is grpc.StatusCode.UNAVAILABLE:
            # Triton answers each of these with UNAVAILABLE on a live connection,
            # like a server that is not ready; only its message tells them apart.
            lowered = details.lower()
            hint = _retry_after_s(e)
            if hint is not None or "exceeds maximum queue size" in lowered:
                return WorkerBusy(details, retry_after_s=hint or 1.0)
            if "protocol is restricted" in lowered:
                return RestrictedProtocol(details)
            if "load / unload is not allowed" in lowered:
                return ModelControlDisabled(details)
            if "is not at ready state" in lowered or "server is stopping" in lowered:
                return ModelNotReady(details)  # the second: a Triton server shutting down
        return from_grpc_code(code, details)

    # ---- inference --------------------------------------------------------

    async def data_lane_ready(self, timeout_s: float) -> None:
        """Wait until the inference connection is up (a worker back from DOWN gets traffic only then).

        The probes ride the control connection; without this a restarted worker
        would be READY while the data connection still waits out its reconnect
        backoff, and the first batches sent to it would fail.
        """
        self._service(_DATA)
        channel = self._channels[_DATA]
        if channel.get_state(try_to_connect=True) == grpc.ChannelConnectivity.READY:
            return
        try:
            await asyncio.wait_for(channel.channel_ready(), timeout_s)
        except asyncio.TimeoutError:
            raise WorkerUnreachable(f"worker {self.address}: inference connection not ready") from None

    async def infer(
        self, request: service_pb2.ModelInferRequest | wire.RawInferRequest, timeout_s: float | None = None
    ) -> service_pb2.ModelInferResponse:
        if tracing.tracer is not None:
            # Under a traced batch: a span for this call, and its traceparent to the worker (W3C trace context).
            pb = request.header if isinstance(request, wire.RawInferRequest) else request
            with tracing.client_span(f"worker call {pb.model_name}", {"infergate.worker": self.address}) as extra:
                if extra:  # a unary call: the stream has no per-request metadata
                    metadata = grpc.aio.Metadata(*self._metadata, *extra)
                    return await self._call(self._unary_infer(), request, timeout_s, _DATA, metadata)
                return await self._infer(request, timeout_s)
        return await self._infer(request, timeout_s)

    async def _infer(
        self, request: service_pb2.ModelInferRequest | wire.RawInferRequest, timeout_s: float | None
    ) -> service_pb2.ModelInferResponse:
        if self._stream_calls and not isinstance(request, wire.RawInferRequest):
            answer = await self._streamed(request, timeout_s)
            if not answer.error_message:
                return answer.infer_response
            # A stream message carries no status code: the same request once
            # more as a unary call answers with the worker's own status.
        return await self._call(self._unary_infer(), request, timeout_s, _DATA)

    async def relay(self, data: bytes, timeout_s: float | None = None) -> bytes:
        """The worker's answer to a ``ModelInfer`` call's bytes, as bytes: nothing is parsed either way
        (``Relays``). Always a unary call: only a status carries the worker's code beside its words."""
        return await self._call(self._relayed_infer(), data, timeout_s, _DATA)

    def _relayed_infer(self) -> Callable[..., Awaitable[bytes]]:
        self._service(_DATA)  # opens the data channel (or raises when closed)
        if self._relayed is None:
            # No serializers: the bytes go out and come back as they are.
            self._relayed = self._channels[_DATA].unary_unary(f"/{_SERVICE}/ModelInfer")
        return self._relayed

    def _unary_infer(self) -> Callable[..., Awaitable[service_pb2.ModelInferResponse]]:
        self._service(_DATA)  # opens the data channel (or raises when closed)
        if self._model_infer is None:
            self._model_infer = self._channels[_DATA].unary_unary(
                f"/{_SERVICE}/ModelInfer",
                request_serializer=wire.serialize,
                response_deserializer=service_pb2.ModelInferResponse.FromString,
            )
        return self._model_infer

    async def _streamed(
        self, request: service_pb2.ModelInferRequest, timeout_s: float | None
    ) -> service_pb2.ModelStreamInferResponse:
        self._service(_DATA)  # opens the data channel (or raises when closed)
        if self._stream is None:
            method = self._channels[_DATA].stream_stream(
                f"/{_SERVICE}/ModelStreamInfer",
                request_serializer=None,  # InferStream sends serialized messages
                response_deserializer=service_pb2.ModelStreamInferResponse.FromString,
            )
            self._stream = InferStream(lambda: method(metadata=self._call_metadata), self.address)
        try:
            answer = await self._stream.infer(request, timeout_s)
        except WorkerUnreachable as e:
            if is_ping_refusal(e.message):
                raise PingsRefused(e.message) from None
            raise
        # The worker echoed the stream's own id; the caller sees its request's, as from a unary call.
        answer.infer_response.id = request.id
        return answer

    def _packed_call_lost(self, e: grpc.aio.AioRpcError) -> InferGateError:
        # The packed call is long-lived: it fails with its connection or its worker (a worker
        # stopping cancels it), whatever state the channel reports at that moment.
        if e.code() not in _TRANSPORT_CODES or is_ping_refusal(e.details() or ""):
            return self.map_error(e)
        return WorkerUnreachable(f"worker {self.address}: streamed requests' call lost "
                                 f"({e.code().name}: {e.details() or ''})")

    def stream(self, request: service_pb2.ModelInferRequest, timeout_s: float | None) -> AsyncIterator[StreamItem]:
        """Each response of a streamed request with its arrival time, the last one final (``Replica.stream``):
        on the worker's packed call, or on a call of its own; closing it early cancels the request."""
        stub = self._service(_DATA)  # raises when the client is closed
        if self._packed is not None:
            return self._packed.stream(request, timeout_s)
        return call_responses(lambda: stub.ModelStreamInfer(timeout=timeout_s, metadata=self._call_metadata),
                              request, self.address, self.map_error)

    def map_error(self, e: grpc.aio.AioRpcError) -> InferGateError:
        """A data-channel call's gRPC failure as the ``protos.errors`` class it means."""
        return self._map_error(e, _DATA)

    # ---- collective groups (infergate workers only) ---------------------------

    def _collective_stub(self) -> CollectiveStub:
        self._service(_DATA)  # opens the data channel (or raises when closed)
        if self._collective is None:
            self._collective = CollectiveStub(self._channels[_DATA])
        return self._collective

    async def setup_group(self, request: collective_pb2.SetupGroupRequest, timeout_s: float | None = None) -> None:
        await self._call(self._collective_stub().SetupGroup, request, timeout_s, _DATA)

    async def teardown_group(self, request: collective_pb2.TeardownGroupRequest, timeout_s: float | None = None) -> bool:
        response = await self._call(self._collective_stub().TeardownGroup, request, timeout_s, _DATA)
        return response.known

    async def run_group(self, request: collective_pb2.RunRequest, timeout_s: float | None = None) -> collective_pb2.RunResponse:
        """One rank's share of one batch (rank 0, or a pipeline's first stage, answers with the outputs)."""
        return await self._call(self._collective_stub().Run, request, timeout_s, _DATA)

    # ---- health and metadata ------------------------------------------------

    async def server_live(self, timeout_s: float | None = None) -> bool:
        response = await self._call(self._control().ServerLive, service_pb2.ServerLiveRequest(), timeout_s)
        return response.live

    async def server_ready(self, timeout_s: float | None = None) -> bool:
        response = await self._call(self._control().ServerReady, service_pb2.ServerReadyRequest(), timeout_s)
        return response.ready

    async def server_metadata(self, timeout_s: float | None = None) -> service_pb2.ServerMetadataResponse:
        return await self._call(self._control().ServerMetadata, service_pb2.ServerMetadataRequest(), timeout_s)

    async def model_ready(self, name: str, version: str = "", timeout_s: float | None = None) -> bool:
        request = service_pb2.ModelReadyRequest(name=name, version=version)
        response = await self._call(self._control().ModelReady, request, timeout_s)
        return response.ready

    async def model_config(
        self, name: str, version: str = "", timeout_s: float | None = None
    ) -> model_config_pb2.ModelConfig:
        request = service_pb2.ModelConfigRequest(name=name, version=version)
        response = await self._call(self._control().ModelConfig, request, timeout_s)
        return response.config

    async def model_metadata(
        self, name: str, version: str = "", timeout_s: float | None = None
    ) -> service_pb2.ModelMetadataResponse:
        request = service_pb2.ModelMetadataRequest(name=name, version=version)
        return await self._call(self._control().ModelMetadata, request, timeout_s)

    async def model_statistics(
        self, name: str = "", version: str = "", timeout_s: float | None = None
    ) -> service_pb2.ModelStatisticsResponse:
        request = service_pb2.ModelStatisticsRequest(name=name, version=version)
        return await self._call(self._control().ModelStatistics, request, timeout_s)

    # ---- repository -----------------------------------------------------------

    async def repository_index(
        self, ready: bool = False, timeout_s: float | None = None
    ) -> list[service_pb2.RepositoryIndexResponse.ModelIndex]:
        request = service_pb2.RepositoryIndexRequest(ready=ready)
        response = await self._call(self._control().RepositoryIndex, request, timeout_s)
        return list(response.models)

    async def load(
        self,
        name: str,
        parameters: Mapping[str, service_pb2.ModelRepositoryParameter] | None = None,
        timeout_s: float | None = None,
    ) -> None:
        request = service_pb2.RepositoryModelLoadRequest(model_name=name)
        for key, value in (parameters or {}).items():
            request.parameters[key].CopyFrom(value)
        await self._call(self._service().RepositoryModelLoad, request, timeout_s, _DATA)

    async def unload(
        self,
        name: str,
        parameters: Mapping[str, service_pb2.ModelRepositoryParameter] | None = None,
        timeout_s: float | None = None,
    ) -> None:
        request = service_pb2.RepositoryModelUnloadRequest(model_name=name)
        for key, value in (parameters or {}).items():
            request.parameters[key].CopyFrom(value)
        await self._call(self._service().RepositoryModelUnload, request, timeout_s, _DATA)

    # ---- lifecycle ------------------------------------------------------------

    async def close(self, grace_s: float | None = None) -> None:
        """Close the channel; with ``grace_s``, pending calls get that long to finish."""
        if self._closed:
            return
        self._closed = True
        stream, self._stream = self._stream, None
        if stream is not None:
            await stream.close(grace_s)
        if self._packed is not None:
            await self._packed.close(grace_s)
        channels, self._channels, self._stubs = list(self._channels.values()), {}, {}
        self._collective = self._model_infer = self._relayed = None
        await asyncio.gather(*(c.close(grace=grace_s) for c in channels))
