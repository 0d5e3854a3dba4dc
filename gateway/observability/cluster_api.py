"""The cluster API: what the gateway knows about its workers and models, as JSON.

- ``GET /v2/cluster``: every worker (address, kind, state ``ready`` /
  ``ejected`` / ``down`` / ``draining``, devices with memory, models, routing
  load; an ejected worker's ``ejection``: since and until when, as Unix
  times, why, and its circuit ``OPEN`` or ``HALF_OPEN`` on trial) and
  every model (versions, READY replicas, queue depth). Polled every few
  seconds by the dashboard.
- ``GET /v2/cluster/stats``: the live per-model counters (requests, failures,
  rows, batches, queue depth, the end-to-end latency histogram) and per-worker
  routing counters, compact, polled every second; a generative model adds
  its tokens and time-to-first-token and inter-token histograms. Counters are cumulative;
  rates and percentiles are differences between two polls, so the gateway
  keeps no history and no sampling task.

Devices come from each worker's own ``/metrics`` (``nv_gpu_*``, ``nv_cpu_*``),
for workers whose metrics address the gateway was given. They are read in
the background when a ``/v2/cluster`` request finds them older than
``max_age_s``, never on the request's critical path except the first one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from gateway import __version__
from gateway.observability.generation_usage import GATEWAY_WORKER, GENERATION_USAGE, GenerationUsagePoller
from gateway.observability.streams import TOKEN_GAP_BUCKETS_S, ModelStreams

if TYPE_CHECKING:
    from gateway.observability.observed import ObservedGateway

log = logging.getLogger(__name__)

_DEVICE_PREFIXES = ("nv_gpu_", "nv_cpu_", "infergate_gpu_info")


def parse_devices(text: str) -> list[dict[str, Any]]:
    """The devices a worker's ``/metrics`` text describes: its GPUs, then the host."""
    # Only the device lines: a worker with many models writes far more than these.
    lines = "\n".join(line for line in text.splitlines() if line.startswith(_DEVICE_PREFIXES))
    gpus: dict[str, dict[str, Any]] = {}
    host: dict[str, Any] = {}
    fields = {
        "nv_gpu_memory_total_bytes": "memory_total_bytes",
        "nv_gpu_memory_used_bytes": "memory_used_bytes",
        "nv_gpu_utilization": "utilization",
        "nv_cpu_memory_total_bytes": "memory_total_bytes",
        "nv_cpu_memory_used_bytes": "memory_used_bytes",
        "nv_cpu_utilization": "utilization",
    }
    for family in text_string_to_metric_families(lines + "\n"):
        for sample in family.samples:
            if sample.name.startswith("nv_gpu_") or sample.name == "infergate_gpu_info":
                uuid = sample.labels.get("gpu_uuid", "")
                gpu = gpus.setdefault(uuid, {"kind": "gpu", "uuid": uuid, "name": "GPU"})
                if sample.name == "infergate_gpu_info":
                    gpu["name"] = sample.labels.get("name", "GPU")
                    gpu["index"] = int(sample.labels.get("index", "0") or 0)
                elif sample.name in fields:
                    gpu[fields[sample.name]] = sample.value
            elif sample.name in fields:
                host[fields[sample.name]] = sample.value
    devices = sorted(gpus.values(), key=lambda g: (g.get("index", 0), g["uuid"]))
    if host:
        devices.append({"kind": "cpu", "name": "host", **host})
    return devices


class DeviceMonitor:
    """The devices of each worker, scraped from its metrics endpoint and cached."""

    def __init__(
        self,
        metrics_urls: Mapping[str, str] | None = None,
        *,
        max_age_s: float = 5.0,
        timeout_s: float = 2.0,
        first_wait_s: float = 1.0,
    ) -> None:
        self._urls: dict[str, str] = dict(metrics_urls or {})
        self._devices: dict[str, list[dict[str, Any]]] = {}
        self._max_age_s = max_age_s
        self._timeout_s = timeout_s
        self._first_wait_s = first_wait_s
        self._refreshed_at: float | None = None
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None

    def set_metrics_url(self, address: str, url: str | None) -> None:
        """Where worker ``address`` serves its metrics (None: unknown, no devices shown)."""
        if url is None:
            self._urls.pop(address, None)
            self._devices.pop(address, None)
        else:
            self._urls[address] = url

    def devices(self, address: str) -> list[dict[str, Any]]:
        return self._devices.get(address, [])

    async def refresh(self, addresses: Iterable[str]) -> None:
        """Start a background refresh if the data is stale; the very first one is awaited (bounded)."""
        targets = {a: self._urls[a] for a in addresses if a in self._urls}
        if not targets:
            return
        now = time.monotonic()
        stale = self._refreshed_at is None or now - self._refreshed_at >= self._max_age_s
        if stale and self._task is None:
            # One refresh at a time; the task is owned here and awaited or cancelled in close().
            self._task = asyncio.create_task(self._refresh(targets), name="cluster-device-refresh")
            self._task.add_done_callback(self._refresh_done)
        if self._refreshed_at is None and self._task is not None:
            await asyncio.wait({self._task}, timeout=self._first_wait_s)

    def _refresh_done(self, task: asyncio.Task[None]) -> None:
        self._task = None
        if not task.cancelled() and task.exception() is not None:
            log.error("reading worker devices failed", exc_info=task.exception())

    async def _refresh(self, targets: dict[str, str]) -> None:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self._timeout_s),
                connector=aiohttp.TCPConnector(limit=16),
            )
        results = await asyncio.gather(*(self._scrape(self._session, a, u) for a, u in targets.items()))
        for address, devices in zip(targets, results):
            self._devices[address] = devices
        self._refreshed_at = time.monotonic()

    async def _scrape(self, session: aiohttp.ClientSession, address: str, url: str) -> list[dict[str, Any]]:
        try:
            async with session.get(url) as response:
                response.raise_for_status()
                text = await response.text()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            # A worker that is down already shows as down; its devices are unknown, not an error.
            log.debug("metrics of worker %s at %s unreadable: %r", address, url, e)
            return []
        try:
            return parse_devices(text)
        except ValueError as e:
            log.warning("metrics of worker %s at %s do not parse: %s", address, url, e)
            return []

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        session, self._session = self._session, None
        if session is not None:
            await session.close()


def ejections(gateway: ObservedGateway) -> dict[str, dict[str, Any]]:
    """The workers whose circuit is not closed: since and until when (Unix times), why."""
    now = time.time()
    return {
        h.address: {"circuit": h.state, "since": now - h.ejected_ago_s, "until": now + h.ejected_for_s,
                    "reason": h.reason, "ejections": h.ejections}
        for h in gateway.router.outliers.snapshot() if h.state != "CLOSED"
    }


def worker_state(state: str, ejection: dict[str, Any] | None) -> str:
    """``ejected`` for a READY worker out of rotation; else the cluster's state, lower case."""
    return "ejected" if ejection is not None and state == "READY" else state.lower()


def cluster_view(gateway: ObservedGateway, devices: DeviceMonitor,
                 generation: GenerationUsagePoller | None = None) -> dict[str, Any]:
    """The ``/v2/cluster`` document."""
    load = {w.address: w for w in gateway.router.worker_stats()}
    generating = generation.by_worker() if generation is not None else {}
    ejected = ejections(gateway)
    workers = []
    for w in gateway.cluster.workers():
        counters = load.get(w.address)
        ejection = ejected.get(w.address)
        workers.append({
            "address": w.address,
            "kind": w.kind,
            "state": worker_state(w.state.name, ejection),
            "ejection": ejection,
            "devices": devices.devices(w.address),
            "models": sorted(w.models),
            # Batches of each model the worker executes at once (its served config).
            "execution_slots": {name: w.models[name].slots for name in sorted(w.models)},
            "load": {
                "inflight_batches": counters.inflight if counters else w.inflight,
                "batches_sent": counters.sent if counters else w.sent,
                "failures": counters.failures if counters else w.failures,
                "retries": counters.retries if counters else w.retries,
            },
            # The server's own queue and KV cache figures (an OpenAI-protocol server's metrics), when it has them.
            "server_load": None if w.server_load is None else {
                "waiting": w.server_load.waiting, "running": w.server_load.running,
                "cache_usage": w.server_load.cache_usage},
            # Generation models' sequences and KV cache (gateway.observability.generation_usage).
            "generation": generating.pop(w.address, {}),
            "consecutive_probe_failures": w.consecutive_failures,
            "last_error": w.last_error,
        })
    queued: dict[str, int] = {}
    for (name, _version), batcher in gateway.batchers().items():
        queued[name] = queued.get(name, 0) + batcher.queue_depth()
    ready = gateway.cluster.models()
    # Which models' calls go on as their bytes (gateway.core.relay), when the gateway says.
    lanes = gateway.relay_lanes() if hasattr(gateway, "relay_lanes") else {}
    relayed = gateway.relayed_calls() if hasattr(gateway, "relayed_calls") else {}
    models = []
    for name, known in sorted(gateway.cluster.known_models().items()):
        info = ready.get(name)
        config = info.config if info is not None else known.config
        models.append({
            "name": name,
            "state": "ready" if info is not None else "unavailable",
            "versions": list(info.versions if info is not None else known.versions),
            "replicas": [w.address for w in info.replicas] if info is not None else [],
            "max_batch_size": config.max_batch_size,
            "platform": config.platform or config.backend,
            "queue_depth": queued.get(name, 0),
            # The light-model rule (gateway/routing/light.py): recent worker time per row, and the
            # verdict (true light, false heavy, null not judged yet or the rule off).
            "worker_ms_per_row": _ms(gateway.router.row_costs.median_row_s(name)),
            "light": gateway.router.row_costs.verdict(name),
            # The relay lane: on or off, and why (null while the model is not ready); its calls so far.
            "relay": ({"on": lanes[name].on, "why": lanes[name].why, "while_idle": lanes[name].while_idle,
                       "relayed_calls": relayed.get(name, 0)} if name in lanes else None),
        })
    return {
        "gateway": {"version": __version__, "ready": gateway.server_ready(), "time": time.time()},
        "workers": workers,
        "models": models,
        # What the gateway generates itself (split decoders), by the same worker label.
        "gateway_generation": generating.get(GATEWAY_WORKER, {}),
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


def cluster_stats(gateway: ObservedGateway) -> dict[str, Any]:
    """The ``/v2/cluster/stats`` document: cumulative counters, for rates between polls."""
    batchers = gateway.batchers()
    counters = {(c.name, c.version): c for c in gateway.stats.snapshot()}
    streams = getattr(gateway, "streams", None)
    generating = {key: m for key, m in streams.items() if m.tokens} if streams is not None else {}
    models = []
    for key in sorted(set(counters) | set(batchers)):
        c = counters.get(key)
        hist = gateway.latency.get(*key)
        batcher = batchers.get(key)
        models.append({
            "model": key[0],
            "version": key[1],
            "success": c.success.count if c else 0,
            "failure": c.fail.count if c else 0,
            "inferences": c.inference_count if c else 0,
            "executions": c.execution_count if c else 0,
            "batch_rows": sum(size * d.count for size, d in c.batches.items()) if c else 0,
            "queue_depth": batcher.queue_depth() if batcher else 0,
            "latency_counts": hist.counts if hist else [],
            "latency_sum_s": hist.sum if hist else 0.0,
            **_generation(generating.get(key)),
        })
    ejected = ejections(gateway)
    workers = [
        {"address": w.address, "state": worker_state(w.state, ejected.get(w.address)), "inflight": w.inflight,
         "sent": w.sent,
         "failures": w.failures, "retries": w.retries}
        for w in gateway.router.worker_stats()
    ]
    return {"time": time.time(), "latency_bounds_s": list(gateway.latency.bounds),
            "token_gap_bounds_s": list(TOKEN_GAP_BUCKETS_S), "models": models, "workers": workers}


def _generation(streams: ModelStreams | None) -> dict[str, Any]:
    """A generative model's tokens, time-to-first-token and inter-token histograms (latency and
    token-gap bounds); nothing for a model that streamed no tokens."""
    if streams is None:
        return {}
    return {"tokens": streams.tokens, "ttft_counts": list(streams.first_token.counts),
            "itl_counts": list(streams.token_gap.counts)}


def _json(payload: dict[str, Any]) -> web.Response:
    return web.Response(body=orjson.dumps(payload), content_type="application/json",
                        headers={"Cache-Control": "no-store"})


def add_cluster_routes(
    app: web.Application, gateway: ObservedGateway, *, worker_metrics_urls: Mapping[str, str] | None = None
) -> DeviceMonitor:
    """Mount ``/v2/cluster`` and ``/v2/cluster/stats`` (before the app is set up).

    The workers' generation figures are the poller ``add_metrics_routes``
    left on the app, when it did. ``worker_metrics_urls`` maps worker addresses to their ``/metrics`` URLs;
    more can be added later on the returned monitor.
    """
    monitor = DeviceMonitor(worker_metrics_urls)

    async def cluster(request: web.Request) -> web.Response:
        await monitor.refresh(w.address for w in gateway.cluster.workers())
        return _json(cluster_view(gateway, monitor, request.app.get(GENERATION_USAGE)))

    async def stats(_request: web.Request) -> web.Response:
        return _json(cluster_stats(gateway))

    async def close(_app: web.Application) -> None:
        await monitor.close()

    app.router.add_get("/v2/cluster", cluster)
    app.router.add_get("/v2/cluster/stats", stats)
    app.on_cleanup.append(close)
    return monitor
