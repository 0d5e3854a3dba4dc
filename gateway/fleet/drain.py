"""Draining a worker so it can stop with no request failing: the procedure.

The procedure (:func:`drain_worker`), in this order:

1. placement stops using the worker (no new replicas there) and adopts the
   models it serves that placement did not manage, keeping their replica
   counts;
2. each of those models gets a READY replica elsewhere (the placement
   controller loads them); until then the worker keeps serving them;
3. the worker turns DRAINING: the router sends it no new batch;
4. the batches already sent there finish (its in-flight count drops to 0),
   and the stateful sequences pinned there end (``gateway.routing.sequences``):
   a sequence's state lives on its worker, so it is never moved; a drain
   that times out first answers ``state: draining`` with ``open_sequences``,
   and the worker keeps serving them until they end.

Then the worker can be stopped; a registered worker deregisters as it stops.
If some model cannot be placed elsewhere within the timeout, the drain is
undone and answered 409 with those models, unless ``force`` is given.
A logical model's shards are moved by the parallel registry, not here.

The procedure reads and changes only what :class:`DrainSubject` names (the
cluster, the placement controller, the open sequences), so it needs no
gateway. Its HTTP endpoints are admin routes
(``gateway.frontends.admin_routes``); the command is ``infergate drain``
(``infergate.drain``). Each gateway drains on its own: with several
gateways, drain on each.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from gateway.fleet.cluster import Cluster
from gateway.fleet.placement import PlacementController, is_shard

log = logging.getLogger(__name__)

INFLIGHT_POLL_S = 0.05


class OpenSequences(Protocol):
    """The stateful sequences pinned to each worker (``gateway.routing.sequences``)."""

    def open_on(self, address: str) -> int: ...


class DrainSubject(Protocol):
    """What a drain reads and changes: the gateway's parts, not the gateway."""

    @property
    def cluster(self) -> Cluster: ...

    @property
    def placement(self) -> PlacementController: ...

    @property
    def sequences(self) -> OpenSequences: ...


async def drain_worker(subject: DrainSubject, address: str, *, timeout_s: float,
                       force: bool = False) -> tuple[int, dict[str, Any]]:
    """Drain ``address``; (HTTP status, result document)."""
    cluster, placement = subject.cluster, subject.placement
    worker = cluster.worker(address)
    if worker is None:
        return 404, {"error": f"no worker {address}"}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    placement.exclude(address)
    models = sorted(n for n in worker.models if not is_shard(worker, n))
    for name in models:
        if not placement.manages(name):
            hosts = sum(1 for w in cluster.workers() if w.is_up and name in w.models)
            placement.adopt(name, hosts)
    log.info("draining worker %s: moving %d model(s) first: %s", address, len(models), ", ".join(models) or "-")

    def stranded() -> list[str]:
        return [n for n in models
                if not any(w is not worker and w.address not in placement.excluded for w in cluster.healthy(n))]

    left = stranded()
    while left and loop.time() < deadline:
        await placement.wait_round(deadline - loop.time())
        left = stranded()
    if left and not force:
        placement.include(address)
        log.warning("drain of %s undone: no other worker serves %s", address, ", ".join(left))
        return 409, {"error": f"models {', '.join(left)} have no replica on another worker; drain again with "
                              "force=true to drain anyway", "address": address, "stranded": left}
    if cluster.worker(address) is worker and not worker.draining:
        cluster.set_draining(address, True)
    # Polling a condition (the router's in-flight count, the sequences pinned
    # there), bounded by the deadline. Open sequences are never moved: their
    # state lives on this worker, which keeps serving them while DRAINING.
    def open_sequences() -> int:
        return subject.sequences.open_on(address)

    while (worker.inflight > 0 or open_sequences() > 0) and loop.time() < deadline:
        await asyncio.sleep(INFLIGHT_POLL_S)
    sequences = open_sequences()
    state = "drained" if worker.inflight == 0 and sequences == 0 else "draining"
    log.info("worker %s %s (%d batch(es) still in flight, %d open sequence(s))", address, state, worker.inflight,
             sequences)
    return 200, {"address": address, "state": state, "moved": [n for n in models if n not in left],
                 "stranded": left, "inflight": worker.inflight, "open_sequences": sequences}


def undrain_worker(subject: DrainSubject, address: str) -> tuple[int, dict[str, Any]]:
    """Put a drained worker back into service; (HTTP status, result document)."""
    worker = subject.cluster.worker(address)
    if worker is None:
        return 404, {"error": f"no worker {address}"}
    subject.placement.include(address)
    if worker.draining:
        subject.cluster.set_draining(address, False)
    return 200, {"address": address, "state": worker.state.name.lower()}


class LocalDrains:
    """The drain endpoints' answers in a gateway of one process
    (``gateway.multiproc.routes.GroupViews`` answers them among several)."""

    def __init__(self, subject: DrainSubject) -> None:
        self._subject = subject

    async def drain(self, address: str, timeout_s: float, force: bool) -> tuple[int, dict[str, Any]]:
        return await drain_worker(self._subject, address, timeout_s=timeout_s, force=force)

    async def undrain(self, address: str) -> tuple[int, dict[str, Any]]:
        return undrain_worker(self._subject, address)

    async def placement(self) -> dict[str, Any]:
        return self._subject.placement.view()
