"""Sticky routing of stateful sequences (Triton's ``sequence_batching``).

A sequence's state lives on the worker that ran its START request, so every
later request of the sequence must go there. :class:`SequenceRoutes` keeps
one route per (model, sequence id): the START request picks a replica as
the router does (least outstanding work) and pins the sequence to it; later
requests go to the pinned worker whatever other workers join or leave, and
the END request unpins it. A route idle for the model's
``max_sequence_idle_microseconds`` (the worker releases the sequence then)
is forgotten too.

Each request of a sequence is sent alone, never batched with others, and
the requests of one sequence are sent one at a time in arrival order (a
FIFO lock per route): the worker's state advances once per request, in
order. A request is never retried on another worker: the state would not
be there.

A sequence whose worker goes DOWN or leaves the cluster is *lost*: its next
request fails with UNAVAILABLE naming the sequence, the model and the
worker, and asks for a new START. A DRAINING worker keeps serving the
sequences pinned to it (it only refuses new ones) as long as the model has
a READY replica somewhere (requests resolve the model first);
``gateway.fleet.drain`` waits for them to end and never moves them.

Routes are this gateway's: with several gateways behind a load balancer,
send all requests of a sequence through one of them (session affinity).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tritonclient.grpc import model_config_pb2, service_pb2

from gateway.batching.assembly import build_batch_request, split_batch_response
from gateway.fleet.cluster import Cluster, WorkerState, WorkerStatus
from gateway.routing.router import Router
from gateway.types import InferRequest, InferResponse
from protos.errors import InvalidArgument, Unavailable

_R = TypeVar("_R")

SEQUENCE_ID = "sequence_id"
SEQUENCE_START = "sequence_start"
SEQUENCE_END = "sequence_end"
DEFAULT_IDLE_US = 1_000_000  # Triton's default max_sequence_idle_microseconds


def is_stateful(config: model_config_pb2.ModelConfig) -> bool:
    return config.HasField("sequence_batching")


@dataclass(slots=True)
class _Route:
    worker: WorkerState | None
    last_used: float
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    pending: int = 0
    lost: str = ""  # why the sequence is gone, once its worker is


class SequenceRoutes:
    """The open sequences this gateway routes, by (model, sequence id)."""

    def __init__(self, cluster: Cluster, router: Router, clock: Callable[[], float] = time.monotonic) -> None:
        self._cluster = cluster
        self._router = router
        self._clock = clock
        self._routes: dict[tuple[str, int | str], _Route] = {}
        self._unsubscribe = cluster.on_change(self._cluster_changed)

    def close(self) -> None:
        self._unsubscribe()

    def open_on(self, address: str) -> int:
        """Sequences pinned to the worker at ``address`` (drain waits for them)."""
        return sum(1 for r in self._routes.values() if r.worker is not None and r.worker.address == address and not r.lost)

    async def infer(self, request: InferRequest, config: model_config_pb2.ModelConfig) -> InferResponse:
        model, batched = request.model, config.max_batch_size > 0
        corrid, start, end = _flags(model, request.parameters)

        async def send(worker: WorkerState) -> InferResponse:
            pb = build_batch_request(model, request.version, [request], [request.rows], batched)
            _set_flags(pb, corrid, start, end)
            response = await self._router.send_to(worker, model, request.version, pb, request.deadline)
            return split_batch_response(response, [request], [request.rows], batched)[0]

        return await self._pinned(model, request.version, corrid, start, end, request.deadline, config, send)

    async def relay(self, model: str, version: str, parameters: dict[str, Any], data: bytes, rows: int,
                    deadline: float | None, config: model_config_pb2.ModelConfig) -> bytes:
        """A relayed call of a sequence (the relay lane): its bytes, which carry the sequence's flags as the
        client set them, to the worker holding the sequence; ``parameters``: the call's, read from its header."""
        corrid, start, end = _flags(model, parameters)

        def send(worker: WorkerState) -> Awaitable[bytes]:
            return self._router.relay_to(worker, model, version, data, rows, deadline)

        return await self._pinned(model, version, corrid, start, end, deadline, config, send)

    async def _pinned(self, model: str, version: str, corrid: int | str, start: bool, end: bool,
                      deadline: float | None, config: model_config_pb2.ModelConfig,
                      send: Callable[[WorkerState], Awaitable[_R]]) -> _R:
        """``send(worker)`` on the worker holding the sequence (picked at its START), in arrival order."""
        key = (model, corrid)
        now = self._clock()
        self._sweep(now, config)
        route = self._routes.get(key)
        if route is None:
            if not start:
                raise InvalidArgument(
                    f"inference request for sequence {corrid} to model '{model}' "
                    "must specify the START flag on the first request of the sequence"
                )
            route = self._routes[key] = _Route(None, now)
        route.pending += 1
        route.last_used = now
        try:
            async with route.lock:  # no await before this since the call began: arrival order is send order
                if route.lost and not start:
                    raise Unavailable(route.lost)
                if start:
                    route.lost = ""
                    route.worker = await self._router.acquire(model, version, deadline)
                worker = route.worker
                assert worker is not None
                try:
                    return await send(worker)
                except Unavailable as e:
                    route.lost = _lost(corrid, model, worker, str(e))
                    raise Unavailable(route.lost) from None
        finally:
            route.pending -= 1
            route.last_used = self._clock()
            if (end or route.lost) and route.pending == 0 and self._routes.get(key) is route:
                del self._routes[key]

    def _sweep(self, now: float, config: model_config_pb2.ModelConfig) -> None:
        idle_s = (config.sequence_batching.max_sequence_idle_microseconds or DEFAULT_IDLE_US) / 1e6
        idle = [
            k for k, r in self._routes.items()
            if k[0] == config.name and r.pending == 0 and now - r.last_used >= idle_s
        ]
        for key in idle:
            del self._routes[key]

    def _cluster_changed(self) -> None:
        for (model, corrid), route in self._routes.items():
            worker = route.worker
            if worker is None or route.lost:
                continue
            if self._cluster.worker(worker.address) is not worker:
                route.lost = _lost(corrid, model, worker, "left the cluster")
            elif worker.state is WorkerStatus.DOWN:
                route.lost = _lost(corrid, model, worker, "is down")


def _lost(corrid: int | str, model: str, worker: WorkerState, why: str) -> str:
    return (
        f"sequence {corrid} of model '{model}' was lost: its worker {worker.address} {why}; "
        "its state is gone, start the sequence again (sequence_start)"
    )


def _flags(model: str, parameters: dict[str, Any]) -> tuple[int | str, bool, bool]:
    corrid = parameters.get(SEQUENCE_ID)
    if isinstance(corrid, bool) or not isinstance(corrid, (int, str)) or corrid == 0 or corrid == "":
        raise InvalidArgument(f"inference request to model '{model}' must specify a non-zero or non-empty correlation ID")
    if isinstance(corrid, int) and not 0 < corrid < 2**64:
        raise InvalidArgument(f"inference request to model '{model}': sequence_id must be an unsigned 64-bit integer")
    flags = []
    for key in (SEQUENCE_START, SEQUENCE_END):
        value = parameters.get(key, False)
        if not isinstance(value, bool):
            raise InvalidArgument(f"inference request to model '{model}': parameter '{key}' must be a boolean")
        flags.append(value)
    return corrid, flags[0], flags[1]


def _set_flags(pb: service_pb2.ModelInferRequest, corrid: int | str, start: bool, end: bool) -> None:
    if isinstance(corrid, str):
        pb.parameters[SEQUENCE_ID].string_param = corrid
    elif corrid >= 2**63:
        pb.parameters[SEQUENCE_ID].uint64_param = corrid
    else:
        pb.parameters[SEQUENCE_ID].int64_param = corrid
    pb.parameters[SEQUENCE_START].bool_param = start
    pb.parameters[SEQUENCE_END].bool_param = end

