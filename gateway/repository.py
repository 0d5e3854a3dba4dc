"""The repository extension at the gateway: index, load and unload, forwarded
to the workers.

The index is the union of the healthy workers' indexes (READY wins over other
states of the same model version). Load goes to the workers that list the
model, or to every healthy worker when none does (a load-with-override that
creates the model); unload goes to every worker that lists it. After either,
the cluster re-probes so the model map changes before the call returns.
"""

from __future__ import annotations

import asyncio
import logging

from tritonclient.grpc import service_pb2

from protos.errors import InferGateError, ModelNotFound, Unavailable

from .cluster import Cluster

log = logging.getLogger(__name__)


async def _indexes(cluster: Cluster) -> list[tuple[object, list[service_pb2.RepositoryIndexResponse.ModelIndex]]]:
    workers = [w for w in cluster.workers() if w.is_up]
    results = await asyncio.gather(*(w.client.repository_index() for w in workers), return_exceptions=True)
    out = []
    for worker, result in zip(workers, results):
        if isinstance(result, BaseException):
            log.warning("repository index of worker %s failed: %s", worker.address, result)
            continue
        out.append((worker, list(result)))
    return out


async def merged_index(cluster: Cluster, ready_only: bool = False) -> service_pb2.RepositoryIndexResponse:
    merged: dict[tuple[str, str], service_pb2.RepositoryIndexResponse.ModelIndex] = {}
    for _, entries in await _indexes(cluster):
        for entry in entries:
            key = (entry.name, entry.version)
            if key not in merged or entry.state == "READY":
                merged[key] = entry
    response = service_pb2.RepositoryIndexResponse()
    for key in sorted(merged):
        entry = merged[key]
        if ready_only and entry.state != "READY":
            continue
        response.models.append(entry)
    return response


async def load(cluster: Cluster, name: str, parameters: dict[str, service_pb2.ModelRepositoryParameter]) -> None:
    listed = [w for w, entries in await _indexes(cluster) if any(e.name == name for e in entries)]
    targets = listed or [w for w in cluster.workers() if w.is_up]
    if not targets:
        raise Unavailable("no healthy worker to load the model on")
    results = await asyncio.gather(*(w.client.load(name, parameters) for w in targets), return_exceptions=True)
    await cluster.refresh()
    errors = [r for r in results if isinstance(r, BaseException)]
    if len(errors) == len(results):
        first = errors[0]
        if isinstance(first, InferGateError):
            raise first
        raise Unavailable(f"failed to load model '{name}' on any worker")
    for worker, result in zip(targets, results):
        if isinstance(result, BaseException):
            log.warning("loading model %s on worker %s failed: %s", name, worker.address, result)


async def unload(cluster: Cluster, name: str, unload_dependents: bool = False) -> None:
    listed = [w for w, entries in await _indexes(cluster) if any(e.name == name for e in entries)]
    if not listed:
        raise ModelNotFound(f"failed to unload '{name}', no version is available")
    results = await asyncio.gather(*(w.client.unload(name) for w in listed), return_exceptions=True)
    await cluster.refresh()
    for worker, result in zip(listed, results):
        if isinstance(result, BaseException):
            log.warning("unloading model %s on worker %s failed: %s", name, worker.address, result)
