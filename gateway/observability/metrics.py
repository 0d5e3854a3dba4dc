"""The gateway's Prometheus metrics (``GET /metrics``).

A custom collector reads the gateway's live counters at scrape time -- the
per-model statistics (``GatewayStats``), the batchers' queues and counters,
the router's per-worker counters and the cluster's view -- so nothing is
counted twice. Triton's ``nv_inference_*`` names and labels are used where
they mean the same thing; the gateway's own families start ``infergate_``.

The one thing the live counters cannot give is a latency distribution: the
core observes it into ``gateway.observability.latency``. The batch-size
histogram needs no hook: the statistics already count executions per batch
size.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from gateway.observability.generation_usage import GENERATION_USAGE, GenerationUsagePoller
from gateway.observability.latency import LATENCY_BUCKETS_S
from gateway.observability.streams import FORWARD_BUCKETS_S, RESPONSE_COUNT_BUCKETS, TOKEN_GAP_BUCKETS_S, ModelStreams
from serverkit.prometheus import CONTENT_TYPE, MODEL_LABELS, ModelCounters, TritonCounter, render_text

if TYPE_CHECKING:
    from gateway.observability.observed import ObservedGateway

# Rows per batch sent to a worker.
BATCH_SIZE_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

# Our error classes grouped into Triton's failure reasons; the exact class
# goes in the ``error`` label beside it.
_TRITON_REASONS = {
    "Overloaded": "REJECTED",
    "QuotaExceeded": "REJECTED",
    "DeadlineExceeded": "REJECTED",
    "Cancelled": "CANCELED",
    "Unavailable": "BACKEND",
    "Internal": "BACKEND",
}


def triton_failure_reason(error: str) -> str:
    """Triton's ``reason`` label (REJECTED, CANCELED, BACKEND, OTHER) for one of our error class names."""
    return _TRITON_REASONS.get(error, "OTHER")


def _cumulative(bounds: tuple[float, ...] | tuple[int, ...], counts: list[int]) -> list[tuple[str, float]]:
    buckets, running = [], 0
    for bound, n in zip(bounds, counts):
        running += n
        buckets.append((floatToGoString(bound), running))
    buckets.append(("+Inf", running + sum(counts[len(bounds):])))
    return buckets


def batch_size_counts(batches: dict[int, int]) -> list[int]:
    """Executions per batch size folded into ``BATCH_SIZE_BUCKETS`` (+Inf last)."""
    counts = [0] * (len(BATCH_SIZE_BUCKETS) + 1)
    for size, n in batches.items():
        counts[bisect.bisect_left(BATCH_SIZE_BUCKETS, size)] += n
    return counts


class GatewayCollector(Collector):
    """Every gateway family, read from the live gateway at each scrape."""

    def __init__(self, gateway: ObservedGateway, generation: GenerationUsagePoller | None = None) -> None:
        self._gw = gateway
        self._generation = generation

    def collect(self) -> Iterator[Metric]:
        yield from self._models()
        yield from self._queues()
        yield from self._workers()
        yield from self._cluster()
        yield from self._parallel()
        yield from self._cache()
        yield from self._streams()
        if self._generation is not None:
            yield from self._generation.metrics()

    def _models(self) -> Iterator[Metric]:
        labels = list(MODEL_LABELS)
        counters = ModelCounters.declare(
            failure_labels=("reason", "error"),
            failure="Number of failed inference requests, all batch sizes, by Triton reason and gateway error class",
            count="Number of inferences performed (rows of successful requests)",
            execs="Number of batches sent to workers",
            request_us="Cumulative duration of successful requests in the gateway, in microseconds",
            queue_us="Cumulative time successful requests waited in the gateway's queue, in microseconds",
            infer_us="Cumulative round-trip time of batches to workers, in microseconds (one per batch)",
        )
        batch = HistogramMetricFamily("infergate_batch_size", "Rows per batch sent to a worker", labels=labels)
        latency = HistogramMetricFamily(
            "infergate_request_duration_seconds", "End-to-end time of successful requests in the gateway", labels=labels
        )
        for c in sorted(self._gw.stats.snapshot(), key=lambda c: (c.name, c.version)):
            key = [c.name, c.version]
            counters.success.add_metric(key, c.success.count)
            for error, n in sorted(c.failures_by_reason.items()):
                counters.failure.add_metric([*key, triton_failure_reason(error), error], n)
            counters.count.add_metric(key, c.inference_count)
            counters.execs.add_metric(key, c.execution_count)
            counters.request_us.add_metric(key, c.success.ns // 1000)
            counters.queue_us.add_metric(key, c.queue.ns // 1000)
            counters.infer_us.add_metric(key, c.compute.ns // 1000)
            if c.batches:
                sizes = {size: d.count for size, d in c.batches.items()}
                total_rows = sum(size * n for size, n in sizes.items())
                batch.add_metric(key, _cumulative(BATCH_SIZE_BUCKETS, batch_size_counts(sizes)), total_rows)
        for (model, version), h in self._gw.latency.items():
            latency.add_metric([model, version], _cumulative(self._gw.latency.bounds, h.counts), h.sum)
        yield from (*counters.families(), batch, latency)

    def _queues(self) -> Iterator[Metric]:
        labels = ["model", "version"]
        pending = GaugeMetricFamily(
            "nv_inference_pending_request_count", "Requests waiting in the gateway's queue for a batch", labels=labels
        )
        depth = GaugeMetricFamily("infergate_queue_depth", "Requests queued in the gateway (same as the pending count)", labels=labels)
        limit = GaugeMetricFamily("infergate_queue_capacity", "Most requests the model's queue holds", labels=labels)
        inflight = GaugeMetricFamily("infergate_batches_inflight", "Batches sent to workers and not answered yet", labels=labels)
        rejected = CounterMetricFamily(
            "infergate_rejected_requests",
            "Requests the gateway refused or dropped before sending them (queue_full, displaced, queue_timeout, deadline)",
            labels=[*labels, "reason"],
        )
        at_once = CounterMetricFamily(
            "infergate_batches_sent_at_once",
            "Batches the adaptive batcher sent as they stood to an idle replica, with no burst on (nothing held)",
            labels=labels,
        )
        for (model, version), b in sorted(self._gw.batchers().items()):
            key = [model, version]
            at_once.add_metric(key, b.stats.at_once)
            pending.add_metric(key, b.queue_depth())
            depth.add_metric(key, b.queue_depth())
            limit.add_metric(key, b.policy.max_queue_size)
            inflight.add_metric(key, b.inflight_batches())
            s = b.stats
            for reason, n in (("queue_full", s.rejected_full), ("displaced", s.displaced),
                              ("queue_timeout", s.timed_out), ("deadline", s.expired)):
                rejected.add_metric([*key, reason], n)
        yield from (pending, depth, limit, inflight, rejected, at_once)

    def _workers(self) -> Iterator[Metric]:
        label = ["worker"]
        state = GaugeMetricFamily("infergate_worker_state", "1 for the worker's current state (READY, DOWN, DRAINING)",
                                  labels=["worker", "state"])
        inflight = GaugeMetricFamily("infergate_worker_inflight_batches", "Batches in flight on the worker", labels=label)
        sent = CounterMetricFamily("infergate_worker_batches", "Batches sent to the worker", labels=label)
        failures = CounterMetricFamily("infergate_worker_failures", "Batches that failed on the worker by its own fault", labels=label)
        retries = CounterMetricFamily("infergate_worker_retries", "Batches that failed on the worker and were retried elsewhere",
                                      labels=label)
        models = GaugeMetricFamily("infergate_worker_models", "Models the worker serves", labels=label)
        ejected = GaugeMetricFamily("infergate_worker_ejected", "1 while the worker is ejected (circuit open or on trial)",
                                    labels=label)
        ejections = CounterMetricFamily(
            "infergate_worker_ejections", "Times the worker was ejected, by reason (failures, latency, trial)",
            labels=["worker", "reason"])
        # Every worker and reason, zeros included, so a rate() has a series before the first ejection.
        outliers = self._gw.router.outliers
        counts = outliers.ejections_total()
        for address in sorted({w.address for w in self._gw.cluster.workers()} | {a for a, _ in counts}):
            for reason in outliers.ejection_reasons:
                ejections.add_metric([address, reason], counts.get((address, reason), 0))
        circuits = {h.address: h.state for h in self._gw.router.outliers.snapshot()}
        by_address = {w.address: w for w in self._gw.cluster.workers()}
        for w in self._gw.router.worker_stats():
            for name in ("READY", "DOWN", "DRAINING"):
                state.add_metric([w.address, name], 1 if w.state == name else 0)
            inflight.add_metric([w.address], w.inflight)
            sent.add_metric([w.address], w.sent)
            failures.add_metric([w.address], w.failures)
            retries.add_metric([w.address], w.retries)
            ws = by_address.get(w.address)
            models.add_metric([w.address], len(ws.models) if ws is not None else 0)
            ejected.add_metric([w.address], 0 if circuits.get(w.address, "CLOSED") == "CLOSED" else 1)
        yield from (state, inflight, sent, failures, retries, models, ejected, ejections)

    def _cluster(self) -> Iterator[Metric]:
        replicas = GaugeMetricFamily("infergate_model_replicas", "READY workers serving the model", labels=["model"])
        for name, info in sorted(self._gw.cluster.models().items()):
            replicas.add_metric([name], len(info.replicas))
        yield replicas
        # Placement is optional: without it no model ever moves.
        placement = getattr(self._gw, "placement", None)
        yield CounterMetricFamily(
            "infergate_placement_moves", "Models moved between workers by placement", value=getattr(placement, "moves", 0)
        )
        yield CounterMetricFamily(
            "infergate_placement_loads", "Model replicas placement loaded onto workers", value=getattr(placement, "loads", 0)
        )
        yield CounterMetricFamily(
            "infergate_placement_rounds", "Placement rounds run (plan, load, unload)", value=getattr(placement, "rounds", 0)
        )

    def _parallel(self) -> Iterator[Metric]:
        calls = CounterMetricFamily(
            "infergate_parallel_worker_calls",
            "Gateway to worker calls made for split models (per request: the ranks called, or shard calls on the star path)",
            labels=["model"])
        peer = CounterMetricFamily(
            "infergate_parallel_peer_bytes", "Tensor bytes split models moved between workers (peer collectives, stage hand-offs)",
            labels=["model"])
        batches = CounterMetricFamily("infergate_parallel_batches", "Batches split models ran", labels=["model"])
        groups = GaugeMetricFamily("infergate_parallel_groups_ready",
                                   "Copies of a split model set up as peer groups and serving", labels=["model"])
        parallel = getattr(self._gw, "parallel", None)
        for name, s in sorted((parallel.stats() if parallel is not None else {}).items()):
            calls.add_metric([name], s.shard_calls)
            peer.add_metric([name], s.peer_bytes)
            batches.add_metric([name], s.batches)
            groups.add_metric([name], s.groups_ready)
        yield from (calls, peer, batches, groups)

    def _cache(self) -> Iterator[Metric]:
        """Triton's response-cache families per model, and the cache's own size."""
        labels = ["model", "version"]
        hits = TritonCounter("nv_cache_num_hits_per_model", "Number of response cache hits per model", labels)
        misses = TritonCounter("nv_cache_num_misses_per_model", "Number of response cache misses per model", labels)
        hit_us = TritonCounter("nv_cache_hit_duration_per_model",
                               "Cumulative time of response cache lookups that hit, in microseconds", labels)
        miss_us = TritonCounter("nv_cache_miss_duration_per_model",
                                "Cumulative time of response cache lookups and insertions that missed, in microseconds",
                                labels)
        cache = getattr(self._gw, "cache", None)
        if cache is None:
            return
        for (model, version), c in sorted(cache.counters().items()):
            key = [model, version]
            hits.add_metric(key, c.hits)
            misses.add_metric(key, c.misses)
            hit_us.add_metric(key, c.hit_ns // 1000)
            miss_us.add_metric(key, c.miss_ns // 1000)
        yield from (hits, misses, hit_us, miss_us)
        yield GaugeMetricFamily("infergate_cache_capacity_bytes", "Response cache bound (cache.size_bytes)", value=cache.capacity_bytes)
        yield GaugeMetricFamily("infergate_cache_used_bytes", "Bytes the response cache holds", value=cache.used_bytes)
        yield GaugeMetricFamily("infergate_cache_entries", "Responses the response cache holds", value=len(cache))
        yield CounterMetricFamily("infergate_cache_evictions", "Responses evicted to stay within cache.size_bytes",
                                  value=cache.evictions)

    def _streams(self) -> Iterator[Metric]:
        """Decoupled models' streams (``gateway.observability.streams``)."""
        streams = getattr(self._gw, "streams", None)
        if streams is None:
            return
        labels = ["model", "version"]
        opened = CounterMetricFamily("infergate_streams", "Streamed requests of decoupled models", labels=labels)
        open_now = GaugeMetricFamily("infergate_streams_open", "Streamed requests not ended yet", labels=labels)
        responses = CounterMetricFamily("infergate_stream_responses", "Responses of streamed requests forwarded to clients",
                                        labels=labels)
        per_stream = HistogramMetricFamily("infergate_stream_responses_per_request",
                                           "Responses forwarded per ended streamed request", labels=labels)
        first = HistogramMetricFamily("infergate_stream_first_response_seconds",
                                      "Time from a streamed request's arrival to its first response", labels=labels)
        for (model, version), m in streams.items():
            key = [model, version]
            opened.add_metric(key, m.opened)
            open_now.add_metric(key, m.open)
            responses.add_metric(key, m.responses)
            per_stream.add_metric(key, _cumulative(RESPONSE_COUNT_BUCKETS, m.per_stream.counts), m.per_stream.sum)
            first.add_metric(key, _cumulative(LATENCY_BUCKETS_S, m.first_response.counts), m.first_response.sum)
        yield from _generation(streams.items())
        forward = HistogramMetricFamily(
            "infergate_stream_forward_seconds",
            "Time from a worker's streamed response reaching the gateway to the gateway writing it to its client")
        forward.add_metric([], _cumulative(FORWARD_BUCKETS_S, streams.forward.counts), streams.forward.sum)
        yield from (opened, open_now, responses, per_stream, first, forward)
        yield from self._resumes()

    def _resumes(self) -> Iterator[Metric]:
        """Generations whose replica was lost mid-stream (``gateway.routing.resume``)."""
        resumes = getattr(self._gw.router, "resumes", None)
        if resumes is None:
            return
        resumed = CounterMetricFamily("infergate_stream_resumes",
                                      "Generations whose replica was lost mid-stream, continued on another replica",
                                      labels=["model"])
        failed = CounterMetricFamily("infergate_stream_resumes_failed",
                                     "Generations whose replica was lost mid-stream and that could not be continued",
                                     labels=["model"])
        for family, counts in ((resumed, resumes.resumed), (failed, resumes.not_resumed)):
            for model, n in sorted(counts.items()):
                family.add_metric([model], n)
        yield from (resumed, failed)
        yield from self._prefix_routes()

    def _prefix_routes(self) -> Iterator[Metric]:
        """Generative prompts routed by their prefix (``gateway.routing.prefix``), where that is on."""
        affinity = getattr(self._gw.router, "prefix_affinity", None)
        if affinity is None:
            return
        routed = CounterMetricFamily(
            "infergate_prefix_routes",
            "Generative prompts by how their prefix routed them: followed (to the worker their prefix went to), "
            "new (a new prefix, or its worker full or gone), diverted (their worker far busier than another)",
            labels=["outcome"])
        for outcome, n in (("followed", affinity.hits), ("new", affinity.misses), ("diverted", affinity.diverted)):
            routed.add_metric([outcome], n)
        remembered = GaugeMetricFamily("infergate_prefix_routes_remembered", "Prefixes the gateway keeps a route for")
        remembered.add_metric([], affinity.remembered)
        yield from (routed, remembered)


def _generation(models: list[tuple[tuple[str, str], ModelStreams]]) -> Iterator[Metric]:
    """Generative streams' tokens, time to first token and inter-token latency, per model that generated."""
    labels = ["model", "version"]
    tokens = CounterMetricFamily("infergate_generation_tokens", "Tokens generated by streamed generations",
                                 labels=labels)
    first = HistogramMetricFamily("infergate_generation_time_to_first_token_seconds",
                                  "Time from a generation request's arrival to its first token", labels=labels)
    gap = HistogramMetricFamily("infergate_generation_inter_token_seconds",
                                "Time between consecutive tokens of one generation", labels=labels)
    for (model, version), m in models:
        if not m.tokens:
            continue
        key = [model, version]
        tokens.add_metric(key, m.tokens)
        first.add_metric(key, _cumulative(LATENCY_BUCKETS_S, m.first_token.counts), m.first_token.sum)
        gap.add_metric(key, _cumulative(TOKEN_GAP_BUCKETS_S, m.token_gap.counts), m.token_gap.sum)
    yield from (tokens, first, gap)


def add_metrics_routes(app: web.Application, gateway: ObservedGateway) -> None:
    """Mount ``GET /metrics`` on the gateway's HTTP app (before the app is set up).

    The workers' generation figures are polled while the app runs; the poller
    is ``app[GENERATION_USAGE]`` for the cluster API.
    """
    generation = GenerationUsagePoller(gateway)
    app[GENERATION_USAGE] = generation
    collectors: list[Collector] = [GatewayCollector(gateway, generation), ProcessCollector(registry=None)]

    async def start(_app: web.Application) -> None:
        generation.start()

    async def stop(_app: web.Application) -> None:
        await generation.stop()

    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(body=render_text(collectors), headers={"Content-Type": CONTENT_TYPE})

    app.router.add_get("/metrics", metrics)
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
