"""Reading what one worker serves, Triton servers included: its health, its
READY (name, version) index, and each model's config and metadata.

:class:`gateway.fleet.cluster.Cluster` calls these on every probe; this module
owns how a worker is read, the cluster what it makes of the answers.

Triton servers are probed with the same calls as our workers, with two
differences: health is ServerLive (Triton's ServerReady is false while any one
model loads or unloads), and the index is completed from its statistics (its
index omits models loaded with an override). A Triton server whose restricted
protocols (``--grpc-restricted-protocol``) the worker's headers do not unlock
is still served: its models are looked up by name (ModelReady, in the
unrestricted metadata group), and what could not be read is kept in the
worker's ``unreadable`` map for the logs and the statistics page.

Nothing here imports the cluster: a worker is read through
:class:`ProbedWorker`, which ``cluster.WorkerState`` satisfies.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

from tritonclient.grpc import model_config_pb2, service_pb2

from gateway.replicas.replica import Replica
from gateway.replicas.errors import WorkerUnreachable
from protos.errors import InferGateError, Unavailable

log = logging.getLogger(__name__)


class ProbedWorker(Protocol):
    """What discovery reads of a worker, and the ``unreadable`` map it keeps up to date."""

    @property
    def address(self) -> str: ...

    @property
    def kind(self) -> str: ...

    @property
    def client(self) -> Replica: ...

    @property
    def models(self) -> Mapping[str, object]: ...

    @property
    def loaded(self) -> set[str]: ...

    @property
    def unreadable(self) -> dict[str, str]: ...

    failed: dict[str, str]


async def check_health(client: Replica, kind: str, timeout_s: float) -> None:
    """Raise ``Unavailable`` unless the worker can take work."""
    if kind == "triton":
        # Triton's ServerReady is false while any one of its models loads or
        # unloads (strict readiness); each model's readiness is in the index.
        if not await client.server_live(timeout_s):
            raise Unavailable("server is not live")
    elif not await client.server_ready(timeout_s):
        raise Unavailable("server is not ready")


async def ready_index(
    worker: ProbedWorker, timeout_s: float, other_names: Callable[[], Iterable[str]]
) -> frozenset[tuple[str, str]]:
    """The worker's READY (name, version) pairs.

    Also sets ``worker.failed``: the models its index shows it was asked to
    serve and cannot (a failed load, a first load still running), with the
    reason, for strict readiness. A model with any READY version, never
    loaded, being unloaded or unloaded is not among them.

    From its repository index; for a Triton server also from its
    statistics, which list every loaded version (its index lists only the
    models in its repository directories, not those loaded with an
    override). What cannot be read is noted; candidate names then come
    from what is known (this worker's models, names loaded through the
    gateway, and, without an index, ``other_names()``: other workers' and
    configured names) and each is checked with ModelReady (the unrestricted
    metadata group).
    """
    client = worker.client
    ready: set[tuple[str, str]] = set()
    try:
        entries = await client.repository_index(ready=False, timeout_s=timeout_s)
    except WorkerUnreachable:
        raise
    except InferGateError as e:
        note_unreadable(worker, "repository_index", e)
        readable = False
    else:
        note_readable(worker, "repository_index")
        ready = {(e.name, e.version) for e in entries if e.state == "READY"}
        worker.failed = _failed(entries, {name for name, _ in ready})
        readable = True
        if worker.kind != "triton":
            return frozenset(ready)
    try:
        stats = await client.model_statistics(timeout_s=timeout_s)
    except WorkerUnreachable:
        raise
    except InferGateError as e:
        note_unreadable(worker, "statistics", e)
        names = set(worker.models) | worker.loaded
        if not readable:
            names.update(other_names())
        known = {name for name, _ in ready}
        candidates = sorted((name, "") for name in names - known)
    else:
        note_readable(worker, "statistics")
        candidates = sorted({(m.name, m.version) for m in stats.model_stats} - ready)
    answers = await asyncio.gather(
        *(client.model_ready(name, version, timeout_s) for name, version in candidates), return_exceptions=True
    )
    for candidate, answer in zip(candidates, answers):
        if isinstance(answer, WorkerUnreachable):
            raise answer
        if answer is True:
            ready.add(candidate)
    return frozenset(ready)


def _failed(entries: Iterable[service_pb2.RepositoryIndexResponse.ModelIndex], ready: set[str]) -> dict[str, str]:
    failed: dict[str, str] = {}
    for e in entries:
        if e.name in ready or e.state in ("", "READY", "UNLOADING") or e.reason == "unloaded":
            continue
        failed.setdefault(e.name, f"{e.state}: {e.reason}" if e.reason else e.state)
    return failed


def note_unreadable(worker: ProbedWorker, call: str, error: InferGateError) -> None:
    if call not in worker.unreadable:
        log.warning(
            "worker %s: cannot read its %s (%s); its models are looked up by name. "
            "Configure the headers its restricted protocols need", worker.address, call.replace("_", " "), error,
        )
    worker.unreadable[call] = str(error)


def note_readable(worker: ProbedWorker, call: str) -> None:
    if worker.unreadable.pop(call, None) is not None:
        log.info("worker %s: its %s is readable again", worker.address, call.replace("_", " "))


async def read_model(
    client: Replica, name: str, timeout_s: float
) -> tuple[model_config_pb2.ModelConfig, service_pb2.ModelMetadataResponse] | None:
    """The model's config and metadata; None when it cannot be read now (skipped this round)."""
    try:
        config = await client.model_config(name, timeout_s=timeout_s)
        metadata = await client.model_metadata(name, timeout_s=timeout_s)
    except WorkerUnreachable:
        raise
    except InferGateError as e:
        # Unloaded between the index and this call, or not readable: skip it this round.
        log.info("worker %s: skipping model %s: %s", client.address, name, e)
        return None
    return config, metadata
