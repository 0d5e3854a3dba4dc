"""The streaming path: one request to a decoupled model, its responses forwarded as they come.

``Gateway.stream`` hands each request to ``RequestPipeline.stream``, which
admits, resolves and validates it as the request path does
(``gateway.core.pipeline``), then, for a decoupled model (its config's
``model_transaction_policy { decoupled: true }``, as the workers report it),
runs it here: no batching (a stream is one request's), no response cache,
one replica picked by the router's replica choice and the
stream on it (``gateway.routing.streams``, ``Router.stream``). Each
worker response becomes an ``InferResponse`` and is yielded at once; the
last one carries ``final``. The worker always marks the end with an empty
final response; it is dropped here unless the client asked for it
(``triton_enable_empty_final_response`` in the request's parameters, as
the frontends pass it on).

A single-response call (``Gateway.infer``: gRPC ``ModelInfer``, HTTP
``/infer``) to a decoupled model is refused in Triton's words and code
(``gateway.types.DecoupledRefused``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from tritonclient.grpc import model_config_pb2, service_pb2

from execution.decoupled import set_parameter
from gateway.batching.assembly import build_batch_request
from gateway.observability.latency import LatencyHistograms
from gateway.observability.stats import GatewayStats
from gateway.observability.streams import StreamStats
from gateway.routing.streams import StreamRouting
from gateway.types import InferRequest, InferResponse, Tensor
from protos.triton_words import ENABLE_EMPTY_FINAL, FINAL_RESPONSE, is_final
from protos.errors import InferGateError, Internal

log = logging.getLogger(__name__)

def is_decoupled(config: model_config_pb2.ModelConfig) -> bool:
    """Whether the model answers a request with a stream of responses (Triton's decoupled transaction policy)."""
    return config.HasField("model_transaction_policy") and config.model_transaction_policy.decoupled


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def worker_request(request: InferRequest, version: str) -> service_pb2.ModelInferRequest:
    """The one message a worker gets for a streamed request: its inputs, outputs and own parameters."""
    pb = build_batch_request(request.model, version, [request], [request.rows], False, raw_aside=False)
    for key, value in request.parameters.items():
        if key.startswith(("triton_", "_")):
            continue  # reserved: the stream call sets the one it needs
        set_parameter(pb.parameters[key], value)
    return pb


def _response(request: InferRequest, pb: service_pb2.ModelInferResponse, final: bool,
              arrived: float) -> InferResponse:
    # Once per streamed response (a generation's every token): read each repeated field once.
    meta, raws = pb.outputs, pb.raw_output_contents
    if len(raws) != len(meta):
        raise Internal(f"worker answered model '{pb.model_name}' with {len(meta)} outputs "
                       f"but {len(raws)} raw contents")
    outputs = [Tensor(o.name, o.datatype, tuple(o.shape), raw) for o, raw in zip(meta, raws)]
    return InferResponse(request.model, pb.model_version or request.version, request.id, outputs,
                         _parameters(pb), final, arrived)


def _models_parameters(pb: service_pb2.ModelInferResponse) -> bool:
    return any(key != FINAL_RESPONSE for key in pb.parameters)


def _parameters(pb: service_pb2.ModelInferResponse) -> dict[str, object]:
    """The model's response parameters (a generative model's ``finish_reason`` and token counts);
    the final flag is the response's ``final``, not a parameter."""
    params = pb.parameters
    if len(params) <= 1 and (not params or FINAL_RESPONSE in params):
        return {}  # the common case: the final flag alone
    out: dict[str, object] = {}
    for key, param in params.items():
        which = param.WhichOneof("parameter_choice")
        if key != FINAL_RESPONSE and which is not None:
            out[key] = getattr(param, which)
    return out


class OpenStreams:
    """How many streams are open, and a wait (for shutdown) until none is."""

    def __init__(self) -> None:
        self._count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def opened(self) -> None:
        self._count += 1
        self._idle.clear()

    def closed(self) -> None:
        self._count -= 1
        if not self._count:
            self._idle.set()

    async def wait_closed(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` for every open stream to end; how many are still open.

        With none open it returns at once, whatever the time left: a shutdown
        whose grace the batchers spent must not wait, nor warn, for nothing.
        """
        if not self._count:
            return 0
        try:
            await asyncio.wait_for(self._idle.wait(), max(0.0, timeout_s))
        except asyncio.TimeoutError:
            if self._count:
                log.warning("%d stream(s) still open after %.1f s", self._count, max(0.0, timeout_s))
        return self._count


class StreamPath:
    """Runs validated requests of decoupled models: routing, statistics, stream metrics."""

    def __init__(self, routing: StreamRouting, streams: StreamStats, *, stats: GatewayStats,
                 latency: LatencyHistograms) -> None:
        self._routing = routing
        self._stats = stats
        self._latency = latency
        self.streams = streams
        # Open streams, for shutdown: it waits (within its grace) until none is.
        self._open = OpenStreams()

    async def run(self, request: InferRequest, version: str, started: float) -> AsyncIterator[InferResponse]:
        """The responses of a validated, admitted request, as its worker sends them."""
        model = request.model
        want_empty_final = request.parameters.get(ENABLE_EMPTY_FINAL) is True
        pb = worker_request(request, version)
        request.dispatched = started
        sent = 0
        last = started  # the previous response's arrival: a generation's inter-token gap
        outcome: str | None = "Cancelled"  # until the stream ends one way or the other
        self.streams.opened(model, version)
        self._open.opened()
        try:
            async with aclosing(self._routing.stream(model, version, pb, request.deadline)) as responses:
                async for response, arrived in responses:
                    final = is_final(response)
                    if final and not response.outputs and not want_empty_final and not _models_parameters(response):
                        # The end marker the gateway asked for, not the client; a final response
                        # with parameters of the model's (a generation's counts) is the client's.
                        continue
                    out = _response(request, response, final, arrived)
                    self.streams.response(model, version, arrived - started, sent, arrived - last, out.outputs)
                    last = arrived
                    sent += 1
                    if final:
                        outcome = None  # answered in full, whether or not the caller asks for more
                    yield out
            outcome = None
        except InferGateError as e:
            outcome = type(e).__name__
            raise
        finally:
            self._open.closed()
            self.streams.closed(model, version, sent)
            total_s = time.monotonic() - started
            if outcome is None:
                self._stats.record_execution(model, version, request.rows, _ns(total_s))
                self._stats.record_success(model, version, request.rows, _ns(total_s), 0)
                self._latency.observe(model, version, total_s)
            else:
                self._stats.record_failure(model, version, _ns(total_s), outcome)
                log.debug("stream of request '%s' ended after %d response(s): %s", request.id, sent, outcome)

    async def wait_closed(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` for every open stream to end; how many are still open."""
        return await self._open.wait_closed(timeout_s)

    def forwarded(self, response: InferResponse) -> None:
        """A frontend wrote ``response`` to its client: the gap since its worker's response arrived."""
        if response.arrived:
            self.streams.forwarded(time.monotonic() - response.arrived)

