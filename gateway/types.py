"""The gateway's internal request and response: what both frontends decode
into and encode from, and what the batcher, router and parallel plans move.

Tensors stay as raw row-major bytes (BYTES tensors in the KServe
4-byte-length-prefixed form) from the wire to the worker and back; numpy only
appears where math is done.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import AsyncIterator
from contextvars import ContextVar
from typing import Any, Protocol

from tritonclient.grpc import model_config_pb2, service_pb2

from protos.errors import Unsupported


@dataclass(slots=True)
class Tensor:
    """One named tensor as raw row-major bytes."""

    name: str
    datatype: str  # KServe datatype: "FP32", "INT64", "BYTES", ...
    shape: tuple[int, ...]
    data: bytes | memoryview
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class RequestedOutput:
    name: str
    # HTTP only: send this output in the binary extension rather than as JSON.
    binary_data: bool | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    # Frontend-only, never sent to a worker: the client's shared-memory window
    # the output is written into (``gateway.requests.shared_memory.RegionSlice``),
    # and the top-K of Triton's classification extension (0 = the tensor itself).
    region: Any = None
    classification: int = 0


@dataclass(slots=True)
class InferRequest:
    """One client request, after decoding and before validation against the model."""

    model: str
    version: str  # "" means the model's default version
    id: str
    inputs: list[Tensor]
    outputs: list[RequestedOutput]  # empty means all outputs
    parameters: dict[str, Any] = field(default_factory=dict)
    priority: int = 0  # 0 = the model's default priority level
    timeout_us: int = 0  # 0 = none; from the request's `timeout` parameter
    # Absolute time on the gateway's event-loop clock (loop.time()); None = no deadline.
    deadline: float | None = None
    # Filled in by the gateway: accept time, rows (dim 0, 1 for unbatched
    # models) and the time its batch was dispatched (loop clock).
    arrival: float = 0.0
    rows: int = 1
    dispatched: float = 0.0
    # The request's trace while it is traced (gateway.observability.tracing); None otherwise.
    trace: Any = None


@dataclass(slots=True)
class RelayCall:
    """A call on the relay lane (``gateway.core.relay``): its bytes as they came, and what routing reads.

    ``batch_dim``: the first input's first dimension (the rows, for a model
    that batches), 1 when it has none; ``parameters``: the call's request
    parameters a route reads (a sequence's id and flags).
    """

    model: str
    version: str
    id: str
    data: bytes
    nbytes: int  # the call's size, for the gateway-wide admission bound
    batch_dim: int = 1
    parameters: dict[str, Any] = field(default_factory=dict)
    priority: int = 0
    timeout_us: int = 0
    deadline: float | None = None  # absolute, on the loop clock (the client's); None = none


class NotRelayed(Exception):
    """The model left the relay lane between the frontend's check and the call (its replicas changed):
    the frontend reads the call and sends it down the full path instead. No error of the request's."""


def request_name(req: InferRequest) -> str:
    """How a message names a request: by its id, or by what it is when it has none."""
    return f"request '{req.id}'" if req.id else f"a request of model '{req.model}'"


@dataclass(slots=True)
class InferResponse:
    model: str
    version: str
    id: str
    outputs: list[Tensor]
    parameters: dict[str, Any] = field(default_factory=dict)
    # The last response of its request: always for an ordinary model; for a
    # decoupled model's stream, the worker's ``triton_final_response``.
    final: bool = True
    # When the worker's response reached the gateway (time.monotonic()), 0 when
    # not streamed: the frontend reports the gap to its write (``stream_written``).
    arrived: float = 0.0


# How Triton names the endpoint that refuses a decoupled model: the gRPC
# frontend sets "ModelInfer RPC" in its call's context; HTTP's /infer is the default.
single_response_endpoint: ContextVar[str] = ContextVar("single_response_endpoint", default="HTTP end point")


class DecoupledRefused(Unsupported):
    """Triton's refusal of a single-response call (``InferenceCore.infer``) to a decoupled model
    (UNIMPLEMENTED / 501): such a model answers through ``InferenceCore.stream`` only."""

    def __init__(self, endpoint: str | None = None) -> None:
        endpoint = endpoint or single_response_endpoint.get()
        super().__init__(f"{endpoint} doesn't support models with decoupled transaction policy")


class InferenceCore(Protocol):
    """What the frontends call. Everything behind it is shared by HTTP and gRPC.

    Errors are raised as ``protos.errors.InferGateError`` subclasses; the
    frontends convert them at their one error edge.
    """

    async def infer(self, request: InferRequest) -> InferResponse: ...

    def relays(self, model: str, version: str = "") -> bool:
        """Whether ``model``'s calls take the relay lane (``relay``) when nothing in the call asks to be read."""

    async def relay(self, call: RelayCall) -> bytes:
        """A call's answer as the replica's bytes, unread (``gateway.core.relay``); ``NotRelayed`` when the
        model no longer takes the lane."""

    def stream(self, request: InferRequest) -> AsyncIterator[InferResponse]:
        """The request's responses as they come (one, final, for an ordinary model); close it when done."""

    def stream_written(self, response: InferResponse) -> None:
        """A frontend wrote a streamed ``response`` to its client (the forwarding gap is measured)."""

    def server_live(self) -> bool: ...

    def server_ready(self) -> bool: ...

    def server_metadata(self) -> service_pb2.ServerMetadataResponse: ...

    def model_ready(self, name: str, version: str = "") -> bool: ...

    def model_metadata(self, name: str, version: str = "") -> service_pb2.ModelMetadataResponse: ...

    def model_config(self, name: str, version: str = "") -> model_config_pb2.ModelConfig: ...

    async def model_statistics(self, name: str = "", version: str = "") -> service_pb2.ModelStatisticsResponse: ...

    async def repository_index(self, ready_only: bool = False) -> service_pb2.RepositoryIndexResponse: ...

    async def load_model(self, name: str, parameters: dict[str, service_pb2.ModelRepositoryParameter]) -> None: ...

    async def unload_model(self, name: str, unload_dependents: bool = False) -> None: ...
