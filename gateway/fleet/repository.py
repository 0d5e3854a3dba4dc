"""The management calls the gateway forwards to its workers: the repository
extension (index, load, unload) and the workers' own statistics.

The index is the union of the healthy workers' indexes (READY wins over other
states of the same model version); a worker whose index is restricted
contributes the models the cluster found on it. Load goes to the workers that
list the model, or to every healthy worker when none does (a load-with-override
that creates the model); unload goes to every worker that lists it. After
either, the cluster re-probes so the model map changes before the call returns.
A Triton server without explicit model control refuses both; the gateway
notes it on the worker, says so in its log and, when no worker could do it, in
the error (whose code passes through unchanged).

``worker_statistics`` reads each worker's own statistics (Triton's, or an
infergate worker's) for the statistics page's per-worker section; a worker
that refuses (a restricted protocol) is listed with the reason.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from tritonclient.grpc import service_pb2

from gateway.fleet.cluster import Cluster, WorkerState
from gateway.replicas.errors import ModelControlDisabled
from protos.errors import InferGateError, ModelNotFound, Unavailable

_NO_MODEL_CONTROL = (
    "runs without explicit model control (start it with --model-control-mode=explicit to allow this) "
    "and serves the models it loaded at start"
)

log = logging.getLogger(__name__)


Index = list[service_pb2.RepositoryIndexResponse.ModelIndex]


async def _indexes(cluster: Cluster) -> list[tuple[WorkerState, Index]]:
    """(worker, its index) for every up worker.

    Completed with the READY versions the cluster found on the worker that its
    index lacks: models a Triton server loaded with an override, or every model
    of one whose index is restricted.
    """
    workers = [w for w in cluster.workers() if w.is_up]
    results = await asyncio.gather(*(w.client.repository_index() for w in workers), return_exceptions=True)
    out = []
    for worker, result in zip(workers, results):
        entries: Index = []
        if isinstance(result, BaseException):
            log.warning("repository index of worker %s failed: %s", worker.address, result)
        else:
            entries = list(result)
        listed = {(e.name, e.version) for e in entries}
        for model in worker.models.values():
            for version in model.versions:
                if (model.name, version) not in listed:
                    entries.append(service_pb2.RepositoryIndexResponse.ModelIndex(
                        name=model.name, version=version, state="READY"
                    ))
        out.append((worker, entries))
    return out


def _refused(worker: WorkerState, action: str, name: str, error: BaseException) -> BaseException:
    """Note a worker's refusal; a clearer error (same class and code) when it has no model control."""
    if isinstance(error, ModelControlDisabled):
        worker.model_control = "none"
        log.warning("worker %s cannot %s model %s: it %s", worker.address, action, name, _NO_MODEL_CONTROL)
        return ModelControlDisabled(f"cannot {action} model '{name}': the worker {_NO_MODEL_CONTROL} ({error})")
    log.warning("%s of model %s on worker %s failed: %s", action, name, worker.address, error)
    return error


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


def _outcome(targets: list[WorkerState], results: list[object], action: str, name: str) -> None:
    """Note successes and refusals; raise when no worker did it."""
    errors = []
    for worker, result in zip(targets, results):
        if isinstance(result, BaseException):
            errors.append(_refused(worker, action, name, result))
            continue
        worker.model_control = "explicit"
    if errors and len(errors) == len(results):
        first = errors[0]
        if isinstance(first, InferGateError):
            raise first
        raise Unavailable(f"failed to {action} model '{name}' on any worker")


async def load(cluster: Cluster, name: str, parameters: dict[str, service_pb2.ModelRepositoryParameter]) -> None:
    listed = [w for w, entries in await _indexes(cluster) if any(e.name == name for e in entries)]
    targets = listed or [w for w in cluster.workers() if w.is_up]
    if not targets:
        raise Unavailable(f"failed to load '{name}': no healthy worker to load the model on")
    results = await asyncio.gather(*(w.client.load(name, parameters) for w in targets), return_exceptions=True)
    for worker, result in zip(targets, results):
        if not isinstance(result, BaseException):
            worker.loaded.add(name)  # before the refresh, which may look it up by name
    await cluster.refresh()
    try:
        _outcome(targets, results, "load", name)
    except InferGateError as exc:
        raise _as_load_failure(exc, name) from None


# Triton's words for a refused load that say why themselves: passed on as they are.
_TRITON_LOAD_WORDS = ("explicit model load / unload is not allowed",)
# What Triton writes only to its log when override files come without a config;
# its client sees that the model could not be polled.
_NO_CONFIG = "Load parameter 'config' must be specified for model file override"


def _as_load_failure(exc: InferGateError, name: str) -> InferGateError:
    """``exc`` reworded as Triton words a failed load, same class.

    A model Triton cannot poll is "failed to load 'M', failed to poll from
    model repository" (also for override files without a config, whose reason
    goes to the log); a model that fails to load is "load failed for model
    'M': ", then the cause, as Triton's model repository manager words it.
    """
    message = exc.message
    if message.startswith(_TRITON_LOAD_WORDS) or message.startswith(f"failed to load '{name}', "):
        return exc
    if message.startswith(_NO_CONFIG):
        log.warning("load of model %s refused: %s", name, message)
        message = f"failed to load '{name}', failed to poll from model repository"
    else:
        for ours in (f"failed to load '{name}': ", f"load failed for model '{name}': "):
            if message.startswith(ours):
                message = message[len(ours):]
        log.warning("load failed for model %s: %s", name, message)
        message = f"load failed for model '{name}': {message}"
    exc.message = message
    exc.args = (message,)
    return exc


async def unload(cluster: Cluster, name: str, unload_dependents: bool = False) -> None:
    listed = [w for w, entries in await _indexes(cluster) if any(e.name == name for e in entries)]
    if not listed:
        raise ModelNotFound(f"failed to unload '{name}', no version is available")
    results = await asyncio.gather(*(w.client.unload(name) for w in listed), return_exceptions=True)
    for worker, result in zip(listed, results):
        if not isinstance(result, BaseException):
            worker.loaded.discard(name)
    await cluster.refresh()
    _outcome(listed, results, "unload", name)


@dataclass(frozen=True, slots=True)
class WorkerStatistics:
    """One worker's own statistics, or why it would not give them."""

    address: str
    kind: str
    state: str
    model_control: str
    statistics: service_pb2.ModelStatisticsResponse | None
    error: str = ""
    unreadable: Mapping[str, str] = field(default_factory=dict)


async def worker_statistics(cluster: Cluster, name: str = "", version: str = "") -> list[WorkerStatistics]:
    """Statistics of ``name`` (every model when empty) from each up worker that serves it."""
    workers = [w for w in cluster.workers() if w.is_up and (not name or name in w.models)]
    results = await asyncio.gather(
        *(w.client.model_statistics(name, version) for w in workers), return_exceptions=True
    )
    out = []
    for worker, result in zip(workers, results):
        stats, error = (None, str(result)) if isinstance(result, BaseException) else (result, "")
        if isinstance(result, InferGateError):
            worker.unreadable["statistics"] = error
        elif isinstance(result, BaseException):
            log.warning("statistics of worker %s failed", worker.address, exc_info=result)
        else:
            worker.unreadable.pop("statistics", None)
        out.append(
            WorkerStatistics(
                worker.address, worker.kind, worker.state.name, worker.model_control or "unknown",
                stats, error, dict(worker.unreadable),
            )
        )
    return out
