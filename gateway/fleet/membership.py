"""Who vouches for each worker in the cluster: the static list, a DNS name,
or the worker's own registration.

A worker joins the cluster when its first source names it and leaves when
its last source lets go of it, so a worker both registered and found by DNS
stays while either says so, and a static worker never leaves through the
others. All on the gateway's event loop.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from gateway.fleet.cluster import Cluster, WorkerState
from gateway.settings import WorkerSpec

log = logging.getLogger(__name__)

STATIC = "static"
REGISTERED = "registered"


def dns_source(name: str) -> str:
    return f"dns:{name}"


class Membership:
    def __init__(self, cluster: Cluster, static: Iterable[WorkerSpec] = ()) -> None:
        self.cluster = cluster
        self._sources: dict[str, set[str]] = {spec.address: {STATIC} for spec in static}

    def sources(self, address: str) -> frozenset[str]:
        return frozenset(self._sources.get(address, ()))

    def is_static(self, address: str) -> bool:
        return STATIC in self._sources.get(address, ())

    async def join(self, spec: WorkerSpec, source: str) -> WorkerState:
        """``source`` names ``spec``: add the worker (probed before this returns) unless it is known."""
        # Recorded before the probe's await, so a leave() racing with it sees this source.
        self._sources.setdefault(spec.address, set()).add(source)
        worker = self.cluster.worker(spec.address)
        if worker is not None:
            return worker
        log.info("worker %s joins (%s)", spec.address, source)
        return await self.cluster.add_worker(spec)

    async def leave(self, address: str, source: str, grace_s: float = 5.0) -> bool:
        """``source`` no longer names ``address``; True when that removed the worker from the cluster."""
        sources = self._sources.get(address)
        if sources is None or source not in sources:
            return False
        sources.discard(source)
        if sources:
            return False
        del self._sources[address]
        log.info("worker %s leaves (%s)", address, source)
        return await self.cluster.remove_worker(address, grace_s)
