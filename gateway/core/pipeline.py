"""The request path: one inference request from the frontend's call to its answer.

``Gateway.infer`` hands each request to ``RequestPipeline.infer``. Step by
step, each step a named method here, the module doing the work in brackets:

1. decode: a frontend turns the wire message into an ``InferRequest``
   (``frontends.http_codec`` / ``frontends.grpc_wire``; inputs in a client's
   shared-memory region are read by ``requests.shared_memory``), then calls
   ``Gateway.infer`` (``gateway.core.gateway``);
2. admit: the gateway-wide bounds on requests and bytes in flight
   (``limits.Admission``), in ``infer``; the rest is ``run_request``;
3. resolve: the model and version from the cluster's view, placed first when
   it may be placed on request (``core.models``, ``fleet.placement``);
4. validate: names, datatypes, shapes and batch size against the model's
   metadata (``requests.validation``), in ``_validate``; the deadline is set;
5. cache: a hit in Triton's response cache is answered at once
   (``caching.response_cache``), in ``_cached``; a stateful model's request
   goes alone to the worker holding its sequence instead
   (``routing.sequences``), an ensemble's through its steps, each a request of
   its own (``ensembles.runner``);
6. batch: the model's batcher queues it and forms a batch
   (``batching.batcher``, one per model in ``batching.registry``), in ``_batch``;
7. route: the batcher hands the batch to ``_dispatch``, which joins
   it into one worker call (``batching.assembly``) and ``_route`` sends it to a
   replica (``routing.router``) or through a split model's plan
   (``parallel.serving``);
8. split back: the reply is cut into one response per request
   (``batching.assembly``), still in ``_dispatch``;
9. classify: Triton's classification extension, where asked for
   (``requests.classification``), in ``_classify``; the statistics and the
   latency are recorded (``observability``), and the frontend encodes the answer
   (shared-memory outputs written by ``requests.shared_memory``).

A call no gateway feature needs to read takes ``relay`` instead: its bytes
go to a replica the router picks and the answer's bytes come back, unread
(``gateway.core.relay``: which models, and what the lane keeps).

A decoupled model's request takes ``stream`` instead: admitted, resolved and
validated here, then run by ``gateway.core.streaming`` (no cache, no batch,
one replica, each response forwarded as it comes); ``infer`` refuses it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from functools import partial
from typing import Any

from tritonclient.grpc import model_config_pb2, service_pb2

from gateway.batching.assembly import build_batch_request, split_batch_response
from gateway.batching.batcher import Batcher
from gateway.batching.registry import Batchers
from gateway.caching.response_cache import Lookup, ResponseCache, cache_enabled
from gateway.core.models import ModelCatalog
from gateway.core.relay import RelayPath
from gateway.core.streaming import StreamPath, is_decoupled
from gateway.ensembles.plan import is_ensemble
from gateway.ensembles.runner import Ensembles, StepRun
from gateway.fleet.cluster import Cluster
from gateway.fleet.placement import PlacementController
from gateway.limits import Admission
from gateway.observability.latency import LatencyHistograms
from gateway.observability.stats import GatewayStats
from gateway.observability.tracing import RequestTracing
from gateway.parallel.serving import ParallelModels
from gateway.requests.classification import LabelFiles, apply_classification
from gateway.requests.validation import validate_request
from gateway.routing.router import Router
from gateway.routing.sequences import SequenceRoutes, is_stateful
from gateway.types import DecoupledRefused, InferRequest, InferResponse, RelayCall
from protos.errors import InferGateError, Internal, InvalidArgument, Unavailable


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


@dataclass(frozen=True, slots=True)
class _Resolved:
    """A request's model as step 3 found it, and when the request started (both clocks)."""

    info: Any
    version: str
    now: float  # the loop's clock: deadlines
    started: float  # time.monotonic(): durations for the statistics


class RequestPipeline:
    """The request path over the parts it is handed; ``accepting`` is false before start and from shutdown on."""

    def __init__(self, models: ModelCatalog, streaming: StreamPath, *, admission: Admission, cluster: Cluster,
                 router: Router, parallel: ParallelModels, placement: PlacementController, batchers: Batchers,
                 sequences: SequenceRoutes, cache: ResponseCache, ensembles: Ensembles, labels: LabelFiles,
                 tracing: RequestTracing, stats: GatewayStats, latency: LatencyHistograms,
                 default_timeout_s: float, relaying: RelayPath) -> None:
        self._models = models
        self._admission = admission  # gateway-wide bounds on admitted requests (requests and bytes in flight)
        self._cluster = cluster
        self._router = router
        self._parallel = parallel  # logical models split across workers: their batches run through plans
        self._placement = placement  # the fleet's: idle TTL, LRU and request rate; models placed on request
        self._batchers = batchers  # one batcher per (model, version), made on its first request
        self._sequences = sequences  # stateful models: each sequence pinned to the worker holding its state
        self._cache = cache  # Triton's response cache (off at cache_size 0)
        self._ensembles = ensembles  # each step runs as a request of its own through ``run_request``
        self._labels = labels  # label files of the classification extension
        self._tracing = tracing
        self._stats = stats
        self._latency = latency
        self._default_timeout_s = default_timeout_s
        self.accepting = False
        self.streaming = streaming  # decoupled models' path (``core.streaming``), built by the composition root
        self.relaying = relaying  # calls that need no reading (``core.relay``), built there too

    def relays(self, model: str, version: str = "") -> bool:
        """Whether the model's calls take the relay lane (``gateway.core.relay``) when nothing in them asks
        to be read."""
        return self.accepting and self.relaying.relays(model, version)

    async def relay(self, call: RelayCall) -> bytes:
        """A call on the relay lane: admitted, resolved and routed, its bytes unread (``gateway.core.relay``)."""
        if not self.accepting:
            raise Unavailable("the gateway is shutting down")
        return await self.relaying.run(call)

    async def infer(self, request: InferRequest) -> InferResponse:
        """Step 2, admit: the gateway-wide bounds come first; beyond them a request is refused at once."""
        with self._admission.admit(request):
            return await self.run_request(request)

    async def stream(self, request: InferRequest) -> AsyncIterator[InferResponse]:
        """Steps 2 to 4, then the streaming path (``gateway.core.streaming``); an ordinary model's
        request goes on along the request path and yields its one response, final. Close it when done."""
        with self._admission.admit(request):
            model = await self._resolve(request)
            if not is_decoupled(model.info.config):
                response = await self._answer(request, model)
                response.final = True
                yield response
                return
            rows = self._validate(request, model.info, model.version, model.now)
            self._placement.touch(request.model, rows)  # idle TTL, LRU and request rate
            async with aclosing(self.streaming.run(request, model.version, model.started)) as responses:
                async for response in responses:
                    yield response

    async def run_request(self, request: InferRequest) -> InferResponse:
        """An admitted request, from resolving its model to its answer (an ensemble's steps enter here too)."""
        model = await self._resolve(request)
        if is_decoupled(model.info.config):
            raise DecoupledRefused()  # Triton's words: a decoupled model answers through a stream only
        return await self._answer(request, model)

    async def _resolve(self, request: InferRequest) -> _Resolved:
        """Step 3: the request's model and version, once, whichever way it answers."""
        # Durations for the statistics come from time.monotonic(): the same clock
        # as loop.time() under asyncio and uvloop, but uvloop's loop.time() is
        # cached per loop turn in whole milliseconds, too coarse for latencies.
        now = asyncio.get_running_loop().time()
        started = request.arrival = time.monotonic()
        if not self.accepting:
            raise Unavailable("the gateway is shutting down")
        info, version = await self._models.resolve(request.model, request.version, request.timeout_us)
        return _Resolved(info, version, now, started)

    async def _answer(self, request: InferRequest, model: _Resolved) -> InferResponse:
        """Steps 4 to 9 of a request with one answer."""
        info, version, started = model.info, model.version, model.started
        rows = self._validate(request, info, version, model.now)
        ensemble = is_ensemble(info.config)
        if not ensemble:  # an ensemble is placed through its steps
            self._placement.touch(request.model, rows)  # idle TTL, LRU and request rate
        if is_stateful(info.config):
            return await self._infer_in_sequence(request, info.config, version, rows, started)
        miss: Lookup | None = None
        if self._cache.enabled and cache_enabled(info.config):
            found = self._cached(request, version, started)
            if isinstance(found, InferResponse):
                return self._classify(request, found, info.config)
            miss = found
        try:
            if ensemble:
                response = await self._run_ensemble(request, info.config, version, rows, started)
            else:
                response = await self._batch(request, version, info.config)
        except InferGateError as e:
            self._cache_failed(miss)
            self._stats.record_failure(request.model, version, _ns(time.monotonic() - started), type(e).__name__)
            raise
        except asyncio.CancelledError:
            self._cache_failed(miss)
            self._stats.record_failure(request.model, version, _ns(time.monotonic() - started), "Cancelled")
            raise
        if miss is not None:
            self._cache.insert(miss, response)
        # After the cache: it holds the model's outputs, whatever form each request asks for.
        response = self._classify(request, response, info.config)
        queue_ns = _ns(max(0.0, request.dispatched - started))
        total_s = time.monotonic() - started
        self._stats.record_success(request.model, version, rows, _ns(total_s), queue_ns)
        self._latency.observe(request.model, version, total_s)
        return response

    def _validate(self, request: InferRequest, info: Any, version: str, now: float) -> int:
        """Step 4: the request against its model (``gateway.requests.validation``); its version, rows and deadline."""
        try:
            rows = validate_request(request, info.metadata, info.config)
        except InferGateError as e:
            self._stats.record_failure(request.model, version, 0, type(e).__name__)
            raise
        request.version = version
        timeout_s = request.timeout_us / 1e6 if request.timeout_us else self._default_timeout_s
        deadline = now + timeout_s
        request.deadline = deadline if request.deadline is None else min(deadline, request.deadline)
        request.rows = rows
        return rows

    def _cached(self, request: InferRequest, version: str, started: float) -> InferResponse | Lookup:
        """Step 5: a hit is answered here (it never reaches a batcher, so batches hold only misses)."""
        found = self._cache.lookup(request)
        if isinstance(found, InferResponse):
            total_s = time.monotonic() - started
            self._stats.record_cache_hit(request.model, version, _ns(total_s))
            self._latency.observe(request.model, version, total_s)
        return found

    async def _run_ensemble(self, request: InferRequest, config: model_config_pb2.ModelConfig, version: str,
                            rows: int, started: float) -> InferResponse:
        """Each step is a request of its own through ``run_request``; the deadline set above covers them all."""
        runs: list[StepRun] = []
        try:
            return await self._ensembles.run(self._ensembles.plan(config), request, runs)
        finally:  # its queue time is its steps' (Triton's counts; see observability.stats)
            request.dispatched = started + self._stats.record_ensemble(request.model, version, rows, runs) / 1e9

    async def _batch(self, request: InferRequest, version: str, config: model_config_pb2.ModelConfig) -> InferResponse:
        """Step 6: queue the request in its model's batcher (``gateway.batching``) and wait for its answer.

        However long its batch runs for others, a request is answered by its deadline:
        the batcher keeps each request's deadline on its one timer heap, queued or running.
        """
        batcher = self._batchers.get(request.model, version) or await self._start_batcher(request.model, version, config)
        return await batcher.submit(request)

    async def _start_batcher(self, name: str, version: str, config: model_config_pb2.ModelConfig) -> Batcher:
        info = self._cluster.model(name)
        # Triton servers run the config's dynamic batcher themselves.
        policy = self._batchers.policy(
            name, config, backend_batches=info is not None and all(w.kind == "triton" for w in info.replicas))
        # Under a queue timeout a batch never waits for a replica outside the batcher (see Batcher).
        dispatch = partial(self._dispatch, name, version, batched=policy.max_batch_size > 0,
                           wait_for_slot=not policy.has_queue_timeouts)
        capacity = self._parallel.capacity(name) if self._parallel.serves(name) else self._router.capacity(name, version)
        return await self._batchers.start(name, version, policy, dispatch, capacity)

    def _classify(self, request: InferRequest, response: InferResponse,
                  config: model_config_pb2.ModelConfig) -> InferResponse:
        """Step 9: Triton's classification extension, for the outputs that ask for it (``gateway.requests``)."""
        return apply_classification(request, response, config, self._labels)

    async def _infer_in_sequence(
        self, request: InferRequest, config: model_config_pb2.ModelConfig, version: str, rows: int, started: float
    ) -> InferResponse:
        """A request of a stateful sequence: alone, in order, on the worker holding the sequence (no cache, no batch)."""
        request.dispatched = started
        try:
            response = await self._sequences.infer(request, config)
        except InferGateError as e:
            self._stats.record_failure(request.model, version, _ns(time.monotonic() - started), type(e).__name__)
            raise
        total_s = time.monotonic() - started
        self._stats.record_execution(request.model, version, rows, _ns(total_s))
        self._stats.record_success(request.model, version, rows, _ns(total_s), 0)
        self._latency.observe(request.model, version, total_s)
        return response

    def _cache_failed(self, miss: Lookup | None) -> None:
        if miss is not None:
            self._cache.record_miss(miss)

    async def _dispatch(
        self, name: str, version: str, batch: list[InferRequest], *, batched: bool, wait_for_slot: bool = True
    ) -> list[InferResponse]:
        """Steps 7 and 8, what a batcher calls with a formed batch: join it into one worker
        call (``gateway.batching.assembly``), route it, split the reply back by rows."""
        start = time.monotonic()
        for r in batch:
            r.dispatched = start
        rows = [r.rows for r in batch]
        # Split models read the message's contents: they get them inside it.
        pb = build_batch_request(name, version, batch, rows, batched, raw_aside=not self._parallel.serves(name))
        deadlines = [r.deadline for r in batch if r.deadline is not None]
        # The batch may live as long as its most patient member; members whose
        # deadline passes while queued were dropped by the batcher already.
        deadline = max(deadlines) if deadlines else None
        try:
            with self._tracing.batch(batch, name):
                response = await self._route(name, version, pb, deadline, wait_for_slot)
        except (InvalidArgument, Internal):
            if len(batch) == 1:
                raise
            # The worker refused the batch for something in its rows (e.g. a
            # token id out of range): run each request alone so one client's
            # bad row does not fail its batch-mates.
            return await self._run_alone(name, version, batch, batched)
        self._stats.record_execution(name, version, sum(rows), _ns(time.monotonic() - start), len(batch))
        responses = split_batch_response(response, batch, rows, batched)
        if len(responses) != len(batch):
            raise Internal(f"batch of {len(batch)} requests produced {len(responses)} responses")
        return responses

    async def _route(self, name: str, version: str, pb: service_pb2.ModelInferRequest, deadline: float | None,
                     wait_for_slot: bool) -> service_pb2.ModelInferResponse:
        """Step 7: one worker call, to a replica the router picks (``gateway.routing.router``)
        or through a split model's plan (``gateway.parallel.serving``)."""
        if self._parallel.serves(name):
            return await self._parallel.infer(name, version, pb, deadline)
        return await self._router.infer(name, version, pb, deadline, wait_for_slot=wait_for_slot)

    async def _run_alone(
        self, name: str, version: str, batch: list[InferRequest], batched: bool
    ) -> list[InferResponse | BaseException]:
        """Each request of a refused batch on its own; the batcher answers each with its outcome."""
        outcomes = await asyncio.gather(
            *(self._dispatch(name, version, [r], batched=batched) for r in batch), return_exceptions=True
        )
        return [o if isinstance(o, BaseException) else o[0] for o in outcomes]
