"""Keeping a logical model's shards placed and loaded on live workers.

``ShardPlacer.reconcile`` makes a model's placement whole -- every
(replica group, slot) pair on a READY worker, chosen by ``placement`` -- and
pushes each pair's shards to its worker with the repository extension's
load-with-override (``config`` JSON + ``file:1/model.onnx``), which Triton
servers accept too. Each pushed config carries the shard's content digest,
so a worker that already holds the same shard (a gateway restart, a second
gateway) is left alone.

When a pair's worker is not READY: ``urgent`` (a request found a shard with
no copy) moves it at once; otherwise it moves at once only if some shard of
its slot has no copy elsewhere, and else after ``REPLACE_AFTER_S`` -- a
restarting worker usually comes back first, and gets its shards again.
A worker that refuses a load (not a transport failure) is excluded from the
model's placement until the next repository load of the model.
"""

from __future__ import annotations

import asyncio
import logging
import time

from google.protobuf import json_format
from tritonclient.grpc import service_pb2

from gateway.fleet.cluster import Cluster, ModelInfo, WorkerState, WorkerStatus
from gateway.replicas.errors import WorkerUnreachable
from gateway.parallel.placement import SlotKey, place
from gateway.parallel.served import ServedModel
from splitter.shards import shard_config

log = logging.getLogger(__name__)

DIGEST_PARAM = "infergate_shard_digest"
REPLACE_AFTER_S = 10.0
LOAD_TIMEOUT_S = 120.0
LOAD_CONCURRENCY = 4


class ShardPlacer:
    def __init__(self, cluster: Cluster) -> None:
        self._cluster = cluster

    def any_host_up(self, served: ServedModel) -> bool:
        workers = (self._cluster.worker(a) for a in served.placement.values())
        return any(w is not None and w.state is WorkerStatus.READY for w in workers)

    def whole(self, served: ServedModel) -> bool:
        """Every shard has at least one healthy copy."""
        return all(self._cluster.healthy(shard.name) for shard in served.layout.plan.shards())

    async def reconcile(self, served: ServedModel, others: list[ServedModel], *, urgent: bool) -> bool:
        """Make the placement whole and push the shards workers lack; True when
        a worker refused shards (the caller should reconcile again soon)."""
        async with served.lock:
            if not served.loaded:
                return False
            now = asyncio.get_running_loop().time()
            usable = [w.address for w in self._cluster.workers()
                      if w.state is WorkerStatus.READY and w.address not in served.excluded]
            keep: dict[SlotKey, str] = {}
            for key, address in served.placement.items():
                if address in usable:
                    served.down_since.pop(key, None)
                    keep[key] = address
                    continue
                since = served.down_since.setdefault(key, now)
                waiting = self._cluster.worker(address) is not None and address not in served.excluded and not urgent
                if waiting and now - since < REPLACE_AFTER_S and self._covered(served, key[1]):
                    keep[key] = address  # copies elsewhere serve; the worker likely returns
            placement = place(served.spec.name, served.spec.replicas, len(served.layout.slots), usable,
                              current=keep, load=_load(served, others))
            moved = [k for k, a in placement.items() if k in served.placement and served.placement[k] != a]
            for key in moved:
                log.warning("logical model %s: slot %s moves from %s to %s", served.spec.name, key,
                            served.placement[key], placement[key])
                served.down_since.pop(key, None)
            served.count("replaced", len(moved))
            served.placement = placement
            served.info = _with_replicas(served.info, self._hosts(placement))
            return await self._push(served, placement)

    async def unload(self, served: ServedModel) -> None:
        """Unload every shard of ``served`` from every worker that lists it; forget the placement."""
        async with served.lock:
            served.loaded = False
            shards = {shard.name for shard in served.layout.plan.shards()}
            calls = [(w, s) for w in self._cluster.workers() if w.is_up for s in shards if s in w.models]
            results = await asyncio.gather(*(w.client.unload(s) for w, s in calls), return_exceptions=True)
            for (worker, shard), result in zip(calls, results):
                if isinstance(result, BaseException):
                    log.warning("unloading shard %s from %s failed: %s", shard, worker.address, result)
            served.placement.clear()
            served.down_since.clear()
            await self._cluster.refresh()

    def _covered(self, served: ServedModel, slot: int) -> bool:
        return all(self._cluster.healthy(shard) for shard in served.layout.slots[slot])

    def _hosts(self, placement: dict[SlotKey, str]) -> tuple[WorkerState, ...]:
        workers = (self._cluster.worker(a) for a in dict.fromkeys(placement.values()))
        return tuple(w for w in workers if w is not None and w.state is WorkerStatus.READY)

    async def _push(self, served: ServedModel, placement: dict[SlotKey, str]) -> bool:
        jobs: list[tuple[WorkerState, str]] = []
        for (_, slot), address in sorted(placement.items()):
            worker = self._cluster.worker(address)
            if worker is None or worker.state is not WorkerStatus.READY:
                continue
            for shard in served.layout.slots[slot]:
                if not _holds(worker, shard, served.digests[shard]) and (worker, shard) not in jobs:
                    jobs.append((worker, shard))
        if not jobs:
            return False
        gate = asyncio.Semaphore(LOAD_CONCURRENCY)
        started = time.perf_counter()

        async def one(worker: WorkerState, shard: str) -> None:
            async with gate:
                await worker.client.load(shard, _load_parameters(served, shard), timeout_s=LOAD_TIMEOUT_S)

        results = await asyncio.gather(*(one(w, s) for w, s in jobs), return_exceptions=True)
        refused: set[str] = set()
        for (worker, shard), result in zip(jobs, results):
            if isinstance(result, asyncio.CancelledError):
                raise result
            if isinstance(result, BaseException):
                log.warning("logical model %s: loading shard %s on %s failed: %s", served.spec.name, shard,
                            worker.address, result)
                if not isinstance(result, WorkerUnreachable):
                    refused.add(worker.address)
        served.excluded |= refused
        touched = {worker.address for worker, _ in jobs}
        await asyncio.gather(*(self._cluster.refresh(a) for a in touched if self._cluster.worker(a) is not None))
        log.info("logical model %s: pushed %d shard(s) to %d worker(s) in %.2fs", served.spec.name,
                 len(jobs) - sum(isinstance(r, BaseException) for r in results), len(touched),
                 time.perf_counter() - started)
        return bool(refused)


def _load(served: ServedModel, others: list[ServedModel]) -> dict[str, int]:
    """Slots each worker carries for the other logical models (placement spreads them)."""
    counts: dict[str, int] = {}
    for other in others:
        if other is not served and other.loaded:
            for address in other.placement.values():
                counts[address] = counts.get(address, 0) + 1
    return counts


def _holds(worker: WorkerState, shard: str, digest: str) -> bool:
    model = worker.models.get(shard)
    if model is None:
        return False
    params = model.config.parameters
    return DIGEST_PARAM in params and params[DIGEST_PARAM].string_value == digest


def _load_parameters(served: ServedModel, shard: str) -> dict[str, service_pb2.ModelRepositoryParameter]:
    config = shard_config(served.layout.plan.shard(shard))
    config.parameters[DIGEST_PARAM].string_value = served.digests[shard]
    text = json_format.MessageToJson(config, preserving_proto_field_name=True, indent=None)
    return {
        "config": service_pb2.ModelRepositoryParameter(string_param=text),
        "file:1/model.onnx": service_pb2.ModelRepositoryParameter(bytes_param=served.files[shard]),
    }


def _with_replicas(info: ModelInfo, replicas: tuple[WorkerState, ...]) -> ModelInfo:
    return ModelInfo(info.name, info.versions, info.config, info.metadata, replicas)
