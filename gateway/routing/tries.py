"""One try of a routed call on one replica, and what its outcome says about that replica.

The router decides where a call goes and when it is tried again
(``gateway.routing.router``, ``gateway.routing.attempts``); a try is what
happens on the replica chosen, the same for a batch and for a stream:

- the call's timeout from its deadline (clamped: gRPC takes a far-off
  deadline as already passed);
- the replica's slot, held from the start of the try to its end (a batch)
  or to the stream's end (a stream): ``worker.inflight`` never leaks,
  cancelled or not;
- the judgement of a failure, one rule for both kinds (:meth:`Tries.judge`):
  a busy refusal (``WorkerBusy``) is load, not a fault, and is retried only
  on a replica not tried yet; an unreachable replica is marked DOWN; a
  replica dropping the model (``ModelNotReady``, ``ModelNotFound``) leaves
  its rotation and the call fails over; other ``Unavailable`` answers are
  the replica's faults, retried; INTERNAL is a suspect, told apart by one
  confirming try elsewhere (``gateway.routing.faults``); any other error is
  the request's own, charged to no one.

A stream's try ends at its first response (:meth:`Tries.open_stream`):
before it, a failure is a failed try like a batch's, retried by the race;
after it, the request cannot be replayed as it is, and a lost replica ends
that try with :class:`StreamLost`, charged to the replica as a failure (the
outlier detector counts it, so a replica that fails streams is ejected as
one that fails batches is). A generation's stream goes on elsewhere from
there (``gateway.routing.resume``); any other stream ends with it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import NoReturn, TypeVar

from tritonclient.grpc import service_pb2

from gateway.batching.seams import Clock
from gateway.fleet.cluster import Cluster, WorkerState
from gateway.replicas.errors import ModelNotReady, PingsRefused, WorkerBusy, WorkerUnreachable
from gateway.replicas.replica import StreamItem
from gateway.routing.attempts import AttemptFailed
from gateway.routing.capacity import InflightBounds
from gateway.routing.outlier import OutlierDetector
from protos import wire
from protos.errors import DeadlineExceeded, InferGateError, Internal, ModelNotFound, Unavailable

_R = TypeVar("_R")

# The longest timeout one replica call is given; the request's own deadline still holds.
MAX_CALL_TIMEOUT_S = 86_400.0


class StreamLost(Unavailable):
    """The replica serving a stream was lost after it had sent responses: the stream ends here
    (unless it is a generation's, which resumes elsewhere: ``gateway.routing.resume``).

    ``worker``: the replica lost; ``left_rotation``: the loss took it out of the model's
    rotation (marked DOWN, or it dropped the model)."""

    def __init__(self, message: str, worker: WorkerState | None = None, left_rotation: bool = False) -> None:
        super().__init__(message)
        self.worker = worker
        self.left_rotation = left_rotation


def rows_of(request: service_pb2.ModelInferRequest | wire.RawInferRequest) -> int:
    """The rows of a batch: its first input's first dimension (1 when it has none)."""
    inputs = (request.header if isinstance(request, wire.RawInferRequest) else request).inputs
    return inputs[0].shape[0] if inputs and inputs[0].shape else 1


class OpenStream:
    """A stream whose first response has come: the rest of it, on the replica that sent that one.

    It holds the replica's slot until :meth:`close`; a failure while the rest
    is read is charged to the replica and ends the stream (:class:`StreamLost`).
    """

    def __init__(self, tries: "Tries", worker: WorkerState, model: str, request_id: str,
                 responses: AsyncIterator[StreamItem], first: StreamItem, release: Callable[[], None]) -> None:
        self.worker = worker
        self.first = first
        self._tries = tries
        self._model = model
        self._request_id = request_id
        self._responses = responses
        self._release: Callable[[], None] | None = release

    async def rest(self) -> AsyncIterator[StreamItem]:
        """The responses after the first, until the final one (or none: the first was final)."""
        sent = 1
        try:
            async for item in self._responses:
                sent += 1
                yield item
        except (Unavailable, ModelNotFound) as e:
            if isinstance(e, WorkerBusy):
                raise
            self._tries.lost(self.worker, self._model, e)
            raise StreamLost(
                f"worker {self.worker.address} was lost during the stream of request '{self._request_id}' after "
                f"{sent} response(s) were sent: {e}", self.worker,
                isinstance(e, (WorkerUnreachable, ModelNotReady, ModelNotFound))) from None

    async def close(self) -> None:
        """End the stream (cancelling it where it runs when not answered in full) and free its slot."""
        try:
            await self._responses.aclose()  # type: ignore[attr-defined]
        finally:
            release, self._release = self._release, None
            if release is not None:
                release()


class Tries:
    """Runs tries on chosen replicas and judges their outcomes (for the router's calls)."""

    def __init__(self, cluster: Cluster, bounds: InflightBounds, outliers: OutlierDetector, clock: Clock,
                 slot_freed: Callable[[WorkerState], None]) -> None:
        self._cluster = cluster
        self._bounds = bounds
        self._outliers = outliers
        self._clock = clock
        self._slot_freed = slot_freed

    def timeout_s(self, model: str, deadline: float | None) -> float | None:
        """The timeout of a call starting now; ``DeadlineExceeded`` when none is left."""
        if deadline is None:
            return None
        remaining = deadline - self._clock.now()
        if remaining <= 0:
            raise DeadlineExceeded(f"deadline exceeded before model '{model}' was sent to a worker")
        return min(remaining, MAX_CALL_TIMEOUT_S)

    def judge(self, worker: WorkerState, model: str, version: str, error: InferGateError) -> NoReturn:
        """Raise what ``error`` from ``worker`` means for the call: ``AttemptFailed`` when another
        try may serve it (charging ``worker`` where it is at fault), else the error as it is."""
        if isinstance(error, PingsRefused):
            # The connection closed for its keepalive pings: no fault and no load; retried, even there.
            raise AttemptFailed(error, worker_fault=False) from None
        if isinstance(error, WorkerBusy):
            # A full queue is load, not a sick worker: another replica may have room.
            raise AttemptFailed(error, worker_fault=False, busy=True) from None
        if isinstance(error, Unavailable):
            worker.failures += 1
            if isinstance(error, WorkerUnreachable):
                self._cluster.mark_down(worker, str(error))
            elif isinstance(error, ModelNotReady):
                self._cluster.model_gone(worker, model, str(error))
                raise AttemptFailed(error, failover=True) from None  # one model going, not a sick worker
            raise AttemptFailed(error) from None
        if isinstance(error, ModelNotFound):
            worker.failures += 1
            self._cluster.model_gone(worker, model, str(error))
            if not any(w is not worker for w in self._cluster.healthy(model, version)):
                raise error
            raise AttemptFailed(error, failover=True) from None
        if isinstance(error, Internal):
            # The worker's fault or the request's: a confirming try elsewhere tells (gateway.routing.attempts).
            raise AttemptFailed(error, suspect=True) from None
        raise error  # the request's own fault, or its deadline: nothing against the worker

    def lost(self, worker: WorkerState, model: str, error: InferGateError) -> None:
        """``worker`` failed a stream after its first response: a failure of the worker's, as a failed try is."""
        worker.failures += 1
        self._outliers.failed(worker.address, str(error))
        if isinstance(error, WorkerUnreachable):
            self._cluster.mark_down(worker, str(error))
        elif isinstance(error, (ModelNotReady, ModelNotFound)):
            self._cluster.model_gone(worker, model, str(error))

    @contextmanager
    def holding(self, worker: WorkerState, model: str = "") -> Iterator[None]:
        """A call that is no batch (a stream) counts as in flight on ``worker`` while it lasts; a stream of
        a model that batches its own sequences counts against its ``max_sequences`` (``InflightBounds``)."""
        release = self._hold(worker, model)
        try:
            yield
        finally:
            release()

    def _hold(self, worker: WorkerState, model: str) -> Callable[[], None]:
        worker.inflight += 1
        worker.sent += 1
        sequence = bool(model) and self._bounds.stream_started(worker, model)
        released = False

        def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            worker.inflight -= 1
            if sequence:
                self._bounds.stream_ended(worker, model)
            self._slot_freed(worker)

        return release

    async def infer(
        self, worker: WorkerState, model: str, version: str,
        request: service_pb2.ModelInferRequest | wire.RawInferRequest, deadline: float | None,
        slot_taken: Callable[[], None] | None = None,
    ) -> service_pb2.ModelInferResponse:
        """One batch on ``worker``: its answer, ``AttemptFailed`` when another try may serve it, else the error."""
        return await self.call(worker, model, version, lambda timeout_s: worker.client.infer(request, timeout_s),
                               rows_of(request), deadline, slot_taken)

    async def relay(
        self, worker: WorkerState, model: str, version: str, data: bytes, rows: int, deadline: float | None,
        slot_taken: Callable[[], None] | None = None,
    ) -> bytes:
        """One relayed call on ``worker`` (``Relays.relay``): its answer's bytes, judged as a batch's try."""
        relay: Callable[[bytes, float | None], Awaitable[bytes]] | None = getattr(worker.client, "relay", None)
        if relay is None:  # the lane is decided on the model's replicas (``Relays``); one may have joined since
            raise AttemptFailed(Unavailable(f"worker {worker.address} cannot relay calls"), worker_fault=False)
        return await self.call(worker, model, version, lambda timeout_s: relay(data, timeout_s), rows,
                               deadline, slot_taken)

    async def call(
        self, worker: WorkerState, model: str, version: str, send: Callable[[float | None], Awaitable[_R]],
        rows: int, deadline: float | None, slot_taken: Callable[[], None] | None = None,
    ) -> _R:
        """One call on ``worker`` (``send(timeout_s)``), holding its slot while it runs; its failure judged."""
        timeout_s = self.timeout_s(model, deadline)
        # The slot is held from here to the `finally`: inflight never leaks,
        # even when the try is cancelled mid-call.
        worker.inflight += 1
        worker.sent += 1
        apart = self._bounds.call_started(worker, model)  # a relayed model's calls count apart
        if slot_taken is not None:
            slot_taken()
        try:
            costs = self._bounds.row_costs  # the light-model rule's cost per row
            started = costs.timer()
            response = await send(timeout_s)
            costs.observe(model, costs.timer() - started, rows)
            return response
        except InferGateError as e:
            self.judge(worker, model, version, e)
        finally:
            worker.inflight -= 1
            if apart:
                self._bounds.call_ended(worker, model)
            self._slot_freed(worker)

    async def open_stream(
        self, worker: WorkerState, model: str, version: str, request: service_pb2.ModelInferRequest,
        deadline: float | None,
    ) -> OpenStream:
        """One try of a stream on ``worker``: open, up to its first response (then the stream is the caller's)."""
        timeout_s = self.timeout_s(model, deadline)
        release = self._hold(worker, model)
        responses: AsyncIterator[StreamItem] | None = None
        try:
            responses = worker.client.stream(request, timeout_s)
            first = await anext(responses)
        except BaseException as e:
            try:
                if responses is not None:
                    await responses.aclose()  # type: ignore[attr-defined]
            finally:
                release()
            if isinstance(e, StopAsyncIteration):
                raise Unavailable(f"worker {worker.address} ended the stream of request '{request.id}' "
                                  "without a response") from None
            if isinstance(e, InferGateError):
                self.judge(worker, model, version, e)
            raise
        return OpenStream(self, worker, model, request.id, responses, first, release)
