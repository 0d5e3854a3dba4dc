"""Where a streamed request runs: one replica, its responses forwarded as they come.

A stream is not a batch and is never hedged: the router's replica choice
picks one replica with a free slot (``Router.acquire``: waiting streams take
freed slots in arrival order; a model that batches its own sequences on the
worker takes up to its ``max_sequences`` per replica), the stream counts as
in flight there until it ends (``Router.holding``: capacity, drain and
shutdown see it), and its ``ModelStreamInfer`` call carries it
(``gateway.fleet.stream_call``).

Failures: a worker that fails before the first response is a failed attempt
like any other: retried on a replica not tried yet, within the deadline and
the router's retry limit. Once a response has gone to the client, the
request cannot be replayed: a lost worker ends that stream alone with
:class:`StreamLost` (UNAVAILABLE), naming the worker and the responses
already sent. In-stream errors are the request's own answer and are never
retried.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Protocol

from tritonclient.grpc import service_pb2

from gateway.fleet.cluster import WorkerState
from gateway.fleet.stream_call import StreamingClient, stream_responses
from gateway.fleet.worker_client import ModelNotReady, WorkerBusy, WorkerUnreachable
from gateway.routing.router import MAX_CALL_TIMEOUT_S, Router
from protos.errors import DeadlineExceeded, ModelNotFound, Unavailable

log = logging.getLogger(__name__)


class StreamLost(Unavailable):
    """The worker serving a stream was lost after it had sent responses: the stream ends here."""


class InProcessStreams(StreamingClient, Protocol):
    """Models whose streams the gateway serves itself, not on a replica (split decoders)."""

    def serves(self, name: str) -> bool: ...


class StreamRouting:
    """Streams of decoupled models over the router's replicas (or ``in_process``, for the models it serves)."""

    def __init__(self, router: Router, in_process: InProcessStreams | None = None) -> None:
        self._router = router
        self._in_process = in_process

    async def stream(
        self, model: str, version: str, request: service_pb2.ModelInferRequest, deadline: float | None,
    ) -> AsyncIterator[tuple[service_pb2.ModelInferResponse, float]]:
        """Each response of ``request`` with its arrival time; the last one is final. Close it when done."""
        if self._in_process is not None and self._in_process.serves(model):
            async with aclosing(stream_responses(self._in_process, request, self._timeout(model, deadline))) as rs:
                async for item in rs:
                    yield item
            return
        router = self._router
        tried: set[WorkerState] = set()
        attempts = 0
        while True:
            worker = await router.acquire(model, version, deadline, tried)
            attempts += 1
            sent = 0
            with router.holding(worker, model):
                try:
                    async with aclosing(stream_responses(worker.client, request, self._timeout(model, deadline))) as rs:
                        async for item in rs:
                            sent += 1
                            yield item
                    return
                except (Unavailable, ModelNotFound) as e:
                    if not isinstance(e, WorkerBusy):
                        self._charge(worker, model, e)
                    if sent:
                        raise StreamLost(
                            f"worker {worker.address} was lost during the stream of request '{request.id}' after "
                            f"{sent} response(s) were sent: {e}") from None
                    if attempts > router.attempts.retry_limit or not self._others(model, version, tried | {worker}):
                        raise
                    log.info("stream of request '%s' retried elsewhere: worker %s failed before its first "
                             "response: %s", request.id, worker.address, e)
                    worker.retries += 1
                    tried.add(worker)

    def _timeout(self, model: str, deadline: float | None) -> float | None:
        if deadline is None:
            return None
        remaining = self._router.remaining(deadline)
        if remaining <= 0:
            raise DeadlineExceeded(f"deadline exceeded before model '{model}' was sent to a worker")
        # gRPC takes a far-off deadline (a client's `timeout` of years) as already passed.
        return min(remaining, MAX_CALL_TIMEOUT_S)

    def _others(self, model: str, version: str, avoid: set[WorkerState]) -> bool:
        return any(w not in avoid for w in self._router.cluster.healthy(model, version))

    def _charge(self, worker: WorkerState, model: str, error: Exception) -> None:
        """A worker's failure, as the router counts one: down when unreachable, out of rotation when unloading."""
        worker.failures += 1
        if isinstance(error, WorkerUnreachable):
            self._router.cluster.mark_down(worker, str(error))
        elif isinstance(error, (ModelNotReady, ModelNotFound)):
            self._router.cluster.model_gone(worker, model, str(error))

