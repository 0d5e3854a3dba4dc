"""Running and waiting sequences and KV cache use of every generation model,
per worker: the gateway's copy of what each worker's schedulers report.

A worker states its generation models' figures in its statistics answer
(``protos.generation_usage``: Triton's ``memory_usage`` entries). The
:class:`GenerationUsagePoller` reads that answer once a second from every
worker of ours that is up (a Triton server's answer has no such figures),
for each decoupled model it serves (the only ones that can generate), and
keeps the latest per (worker, model); a worker that is down, or no longer
serves the model, leaves the table. A gateway that generates itself (split
decoders, ``gateway.parallel.generation``) is read at the moment of asking,
under the worker label :data:`GATEWAY_WORKER`.

``/metrics`` exports the table as ``infergate_generation_*`` gauges labelled
by worker and model; the cluster API lists it per worker for the dashboard.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import Any

from aiohttp import web
from prometheus_client.core import GaugeMetricFamily, Metric

from protos.errors import InferGateError
from protos.generation_usage import GenerationUsage, read_usage

log = logging.getLogger(__name__)

GATEWAY_WORKER = "gateway"
POLL_INTERVAL_S = 1.0

# Where ``add_metrics_routes`` leaves the poller on the app, for the cluster API.
GENERATION_USAGE: web.AppKey[GenerationUsagePoller] = web.AppKey("generation_usage")

Table = dict[tuple[str, str], GenerationUsage]  # (worker, model) -> figures


class GenerationUsagePoller:
    """The latest generation figures of each (worker, model), refreshed in the background."""

    def __init__(self, gateway: Any, interval_s: float = POLL_INTERVAL_S, timeout_s: float = 2.0) -> None:
        self._gw = gateway
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._table: Table = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="generation-usage")
            self._task.add_done_callback(self._loop_done)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def _loop_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("generation usage poll died", exc_info=task.exception())

    async def _loop(self) -> None:
        while True:
            await self.poll()
            await asyncio.sleep(self._interval_s)

    async def poll(self) -> None:
        """Read every up worker's decoupled models once; the table then holds exactly what answered."""
        calls = [(w.address, name, w.client) for w in self._gw.cluster.workers() if w.is_up and w.kind != "triton"
                 for name, model in sorted(w.models.items()) if _decoupled(model)]
        answers = await asyncio.gather(*(self._read(client, name) for _, name, client in calls))
        self._table = {(address, name): usage for (address, name, _), usage in zip(calls, answers)
                       if usage is not None}

    async def _read(self, client: Any, name: str) -> GenerationUsage | None:
        try:
            answer = await client.model_statistics(name, timeout_s=self._timeout_s)
        except (InferGateError, asyncio.TimeoutError) as e:
            # Unloaded meanwhile, a restricted protocol, a worker going down: no figures this round.
            log.debug("statistics of %s at %s unreadable: %s", name, getattr(client, "address", "?"), e)
            return None
        usages = [u for u in (read_usage(s) for s in answer.model_stats) if u is not None]
        return GenerationUsage.total(usages) if usages else None

    def table(self) -> Table:
        """The workers' latest figures and the gateway's own, now."""
        table = dict(self._table)
        decoders = getattr(self._gw, "decoders", None)
        if decoders is not None:
            for name, stats in decoders.generation_stats().items():
                table[(GATEWAY_WORKER, name)] = GenerationUsage.total([stats])
        return table

    def by_worker(self) -> dict[str, dict[str, dict[str, int]]]:
        """The table for the cluster API: worker -> model -> figures."""
        out: dict[str, dict[str, dict[str, int]]] = {}
        for (worker, model), u in sorted(self.table().items()):
            out.setdefault(worker, {})[model] = {
                "running": u.running, "waiting": u.waiting,
                "cache_bytes": u.cache_bytes, "cache_reserved_bytes": u.reserved_cache_bytes}
        return out

    def metrics(self) -> Iterator[Metric]:
        """The ``infergate_generation_*`` gauges labelled by worker and model."""
        labels = ["worker", "model"]
        running = GaugeMetricFamily("infergate_generation_worker_sequences_running",
                                    "Sequences in a worker's running batch", labels=labels)
        waiting = GaugeMetricFamily("infergate_generation_worker_sequences_waiting",
                                    "Sequences admitted by a worker, waiting to join its batch", labels=labels)
        cache = GaugeMetricFamily("infergate_generation_worker_cache_bytes",
                                  "KV cache held by a worker's running sequences, in bytes", labels=labels)
        reserved = GaugeMetricFamily("infergate_generation_worker_cache_reserved_bytes",
                                     "KV cache reserved by a worker's admitted sequences, in bytes", labels=labels)
        table = self.table()
        for (worker, model), u in sorted(table.items()):
            key = [worker, model]
            running.add_metric(key, u.running)
            waiting.add_metric(key, u.waiting)
            cache.add_metric(key, u.cache_bytes)
            reserved.add_metric(key, u.reserved_cache_bytes)
        if table:
            yield from (running, waiting, cache, reserved)


def _decoupled(model: Any) -> bool:
    config = getattr(model, "config", None)
    return bool(config is not None and config.model_transaction_policy.decoupled)
