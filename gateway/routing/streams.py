"""Where a streamed request runs: the router's replicas, or the gateway itself.

A stream of a decoupled model goes through the router's one path
(``Router.stream``: the replica choice, retries before the first response
under the retry budget, the outlier detector's verdicts, a slot held until
the stream ends), except for the models the gateway serves itself
(``in_process``: split decoders, whose decoding loop runs here). A lost
replica after the first response ends that stream alone with
``gateway.routing.tries.StreamLost`` (UNAVAILABLE), naming the replica and
the responses already sent, unless the stream is a generation's, which
goes on on another replica (``gateway.routing.resume``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Protocol

from tritonclient.grpc import service_pb2

from gateway.replicas.replica import StreamItem, StreamSource
from gateway.routing.router import Router
from gateway.routing.tries import StreamLost

__all__ = ["InProcessStreams", "StreamLost", "StreamRouting"]


class InProcessStreams(StreamSource, Protocol):
    """Models whose streams the gateway serves itself, not on a replica (split decoders)."""

    def serves(self, name: str) -> bool: ...


class StreamRouting:
    """Streams of decoupled models over the router's replicas (or ``in_process``, for the models it serves)."""

    def __init__(self, router: Router, in_process: InProcessStreams | None = None) -> None:
        self._router = router
        self._in_process = in_process

    async def stream(
        self, model: str, version: str, request: service_pb2.ModelInferRequest, deadline: float | None,
    ) -> AsyncIterator[StreamItem]:
        """Each response of ``request`` with its arrival time; the last one is final. Close it when done."""
        if self._in_process is not None and self._in_process.serves(model):
            responses = self._in_process.stream(request, self._router.tries.timeout_s(model, deadline))
        else:
            responses = self._router.stream(model, version, request, deadline)
        async with aclosing(responses):
            async for item in responses:
                yield item
