"""The relay lane: ``ModelInfer`` calls the gateway need not read go on as their bytes.

Most of the gateway's work per request is reading it: decoding the tensors,
validating them, batching, writing a new request for the worker, and
reading and re-writing the answer. Where no gateway feature needs any of
that, the lane skips it: the frontend reads only the call's header (model,
version, id, sequence parameters, priority, timeout) and hands the core a
``RelayCall``, its bytes unchanged; the router chooses the replica and runs
the call's race as for a batch (retries before the answer, the deadline,
cancellation, hedges, hang detection, outlier verdicts,
``Router.relay``); the replica forwards the bytes on a method with no
serializers (``Relays.relay``) and the answer's bytes go back to the client
unread. A failure is the server's status, its code and its words (a Triton
server's own), as on the full path.

Which models take it is decided once per model and kept until the cluster's
view of the model changes (:class:`RelayLanes`). A model takes the lane when
the gateway's ``relay`` setting (or ``models.<name>.relay``) is ``auto`` (the
default is ``off``: under load the lane is no faster than the full path,
bench/results.md) and

- every replica relays (a gRPC server: an infergate worker or Triton; the
  local replica and OpenAI-protocol servers do not);
- the gateway need not batch its calls: the servers batch them themselves
  (every replica a Triton server and a ``dynamic_batching`` config, with no
  batching keys of the gateway's for the model), or the model batches
  nothing here (``max_batch_size`` 0, batching ``off``, or a stateful
  model, whose sequence goes by its correlation id read from the header);
- nothing else of the gateway reads it: no response cache, no
  classification labels in its config, not decoupled (streams), not an
  ensemble (its steps are read), not split across workers.

A model whose servers batch it takes the lane only while a call of it would
start at once: a replica has a free execution slot (``ModelCapacity.has_capacity``)
and none of its requests waits in the gateway's batcher
(:attr:`RelayVerdict.while_idle`). Beyond that its calls take the full path
and are batched here. The reason is the second gRPC call: a relayed call is
one call to the server per request, and in Python one call costs the gateway
more CPU than reading, batching and writing a request costs it once batches
hold several (measured in bench/results.md: 0.5-0.6 against 0.35-0.45 ms of
gateway CPU a request at 16 and 64 clients). A call the lane takes while a
slot is free is one the adaptive batcher would have sent at once (alone, or
with the calls arriving in the same turn of the event loop), and it counts
as a batch of one (``worker.inflight``); the models that are always
on the lane (stateful, or not batched here) count their calls apart
(``InflightBounds.relayed``).

A call of such a model still takes the full path when it asks for what only
the gateway does (``frontends.grpc_wire.relay_call``: shared-memory tensors,
classification, parameters the gateway consumes), or while requests are
traced.

What the lane keeps: the gateway-wide admission bound, request counts, rows
(the first input's first dimension), failures by reason, end-to-end latency
in the statistics and ``/metrics``. What it cannot: queue and compute times
of its own (the server queues and batches, so the gateway's statistics count
each call as one execution of its rows, with no queue time), the gateway's
validation (the server's does it, in its words), and a call's trace.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway.caching.response_cache import ResponseCache, cache_enabled
from gateway.core.models import ModelCatalog
from gateway.core.streaming import is_decoupled
from gateway.ensembles.plan import is_ensemble
from gateway.batching.registry import Batchers
from gateway.fleet.cluster import Cluster
from gateway.fleet.placement import PlacementController
from gateway.limits import Admission
from gateway.observability.latency import LatencyHistograms
from gateway.observability.stats import GatewayStats
from gateway.parallel.serving import ParallelModels
from gateway.replicas.replica import Relays
from gateway.routing.router import Router
from gateway.routing.sequences import SequenceRoutes, is_stateful
from gateway.types import NotRelayed, RelayCall
from protos.errors import InferGateError


@dataclass(frozen=True, slots=True)
class RelayVerdict:
    """Whether a model's calls take the relay lane, and why (shown in ``/v2/cluster``)."""

    on: bool
    why: str
    # On the lane only while a call would start at once (a free execution slot, nothing queued in
    # the batcher); else batched here. False: every call of the model takes the lane.
    while_idle: bool = False


class RelayLanes:
    """Each model's verdict, decided on its first call and again whenever the cluster's view of it changes.

    ``mode_for(name)``: the model's relay setting (``auto`` or ``off``).
    The router's in-flight bounds learn which models are always on the lane
    (``InflightBounds.relayed``): their calls are counted apart, in calls. A
    model on it only while idle is not among them: its relayed calls are
    batches of one to the bounds.
    """

    def __init__(self, mode_for: Callable[[str], str], *, router: Router, batchers: Batchers,
                 cache: ResponseCache, parallel: ParallelModels, gateway_batching: Callable[[str], bool]) -> None:
        self._mode_for = mode_for
        self._router = router
        self._batchers = batchers
        self._cache = cache
        self._parallel = parallel
        self._gateway_batching = gateway_batching  # whether the gateway config sets batching keys for the model
        self._verdicts: dict[str, tuple[Any, RelayVerdict]] = {}

    def verdict(self, name: str, info: Any) -> RelayVerdict:
        """The verdict for the model as ``info`` (the cluster's ``ModelInfo``) describes it."""
        known = self._verdicts.get(name)
        if known is not None and known[0] is info:
            return known[1]
        verdict = self._decide(name, info)
        self._verdicts[name] = (info, verdict)
        if verdict.on and not verdict.while_idle:
            self._router.bounds.relayed.add(name)
        else:
            self._router.bounds.relayed.discard(name)
        return verdict

    def _decide(self, name: str, info: Any) -> RelayVerdict:
        config = info.config
        if self._mode_for(name) == "off":
            return RelayVerdict(False, "relay is off")
        if self._parallel.serves(name):
            return RelayVerdict(False, "split across workers")
        if not info.replicas or not all(isinstance(w.client, Relays) for w in info.replicas):
            return RelayVerdict(False, "a replica cannot relay (the local replica, an OpenAI-protocol server)")
        if is_decoupled(config):
            return RelayVerdict(False, "decoupled: its streams are read")
        if is_ensemble(config):
            return RelayVerdict(False, "an ensemble: its steps are read")
        if self._cache.enabled and cache_enabled(config):
            return RelayVerdict(False, "its answers are cached here (response_cache)")
        if any(o.label_filename for o in config.output):
            return RelayVerdict(False, "classification labels: the gateway classifies")
        if is_stateful(config):
            return RelayVerdict(True, "a stateful model: each sequence routed by its correlation id")
        triton = all(w.kind == "triton" for w in info.replicas)
        policy = self._batchers.policy(name, config, backend_batches=triton)
        if policy.max_batch_size == 0 or policy.mode == "off":
            return RelayVerdict(True, "not batched by the gateway")
        if triton and config.HasField("dynamic_batching") and not self._gateway_batching(name):
            return RelayVerdict(True, "its Triton servers batch it (dynamic_batching): relayed while a replica "
                                "has a free execution slot, batched here beyond", while_idle=True)
        return RelayVerdict(False, "the gateway batches it")


class RelayPath:
    """Runs the calls of the relay lane: admitted, resolved, routed, counted (see the module docstring)."""

    def __init__(self, lanes: RelayLanes, models: ModelCatalog, *, admission: Admission, cluster: Cluster,
                 router: Router, batchers: Batchers, sequences: SequenceRoutes, placement: PlacementController,
                 stats: GatewayStats, latency: LatencyHistograms, default_timeout_s: float) -> None:
        self.lanes = lanes
        self.calls: dict[str, int] = {}  # each model's calls routed on the lane (``/v2/cluster``)
        self._batchers = batchers
        self._models = models
        self._admission = admission
        self._cluster = cluster
        self._router = router
        self._sequences = sequences
        self._placement = placement
        self._stats = stats
        self._latency = latency
        self._default_timeout_s = default_timeout_s

    def relays(self, name: str, version: str = "") -> bool:
        """Whether the model's next call takes the lane now; a model not servable now takes the full path,
        which answers it as ever (placed on request, or refused in Triton's words). A model on the lane
        only while idle (:attr:`RelayVerdict.while_idle`) takes it while the call would start at once."""
        info = self._cluster.model(name)
        if info is None or (version and version not in info.versions):
            return False
        verdict = self.lanes.verdict(name, info)
        if not verdict.while_idle:
            return verdict.on
        version = version or self._models.latest(name)  # the batcher and capacity of the version served
        batcher = self._batchers.get(name, version)
        if batcher is not None and batcher.queue_depth():
            return False  # requests wait for a batch: this one joins them rather than passing them
        # Nothing suspends from here to the call taking its slot (``Router.relay``; ``resolve`` answers at once
        # for a model the cluster serves): the next call sees the slot taken.
        return self._router.capacity(name, version).has_capacity()

    async def run(self, call: RelayCall) -> bytes:
        """The call's answer, as its replica's bytes; ``NotRelayed`` when the model left the lane."""
        with self._admission.admit_bytes(call.nbytes, call.priority):
            now = asyncio.get_running_loop().time()
            started = time.monotonic()
            info, version = await self._models.resolve(call.model, call.version, call.timeout_us)
            if not self.lanes.verdict(call.model, info).on:
                raise NotRelayed(call.model)
            self.calls[call.model] = self.calls.get(call.model, 0) + 1
            config = info.config
            timeout_s = call.timeout_us / 1e6 if call.timeout_us else self._default_timeout_s
            deadline = now + timeout_s if call.deadline is None else min(now + timeout_s, call.deadline)
            rows = call.batch_dim if config.max_batch_size > 0 else 1
            self._placement.touch(call.model, rows)  # idle TTL, LRU and request rate
            try:
                if is_stateful(config):
                    answer = await self._sequences.relay(call.model, version, call.parameters, call.data, rows,
                                                         deadline, config)
                else:
                    answer = await self._router.relay(call.model, version, call.data, rows, deadline)
            except InferGateError as e:
                self._stats.record_failure(call.model, version, _ns(time.monotonic() - started), type(e).__name__)
                raise
            except asyncio.CancelledError:
                self._stats.record_failure(call.model, version, _ns(time.monotonic() - started), "Cancelled")
                raise
            total_s = time.monotonic() - started
            # One call is one execution of its rows here; the server's own batches are its statistics'.
            self._stats.record_execution(call.model, version, rows, _ns(total_s))
            self._stats.record_success(call.model, version, rows, _ns(total_s), 0)
            self._latency.observe(call.model, version, total_s)
            return answer


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)
