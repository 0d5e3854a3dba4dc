"""The fleet: the parts that change the cluster's membership and what runs
where, with their start and stop order.

- membership sources (``membership``): the static list, DNS names
  (``discovery``) and self-registration (``registry``, served on the
  gateway's gRPC port);
- placement and model lifecycle (``placement``);
- draining (``gateway.fleet.drain`` drives the placement controller and the cluster).

The composition root builds it and hands in the settings it reads (the
static workers, the DNS names, the ``membership`` group) and what differs
between setups: the worker token registrations must carry, and the placement
controller (``placement``: made from the cluster and the registry this fleet
builds; where several gateway processes serve together, a follower's).

Start (after the cluster's first probe): registry expiry -> DNS (first
lookup: its workers join before placement) -> placement (first round).
Stop: the reverse, before the cluster closes its channels.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from gateway.fleet.cluster import Cluster
from gateway.fleet.discovery import DnsDiscovery
from gateway.fleet.membership import Membership
from gateway.fleet.placement import PlacementController
from gateway.fleet.registry import Registry
from gateway.settings import MembershipSettings, WorkerSpec

log = logging.getLogger(__name__)

# (cluster, registry) -> the placement controller.
PlacementFactory = Callable[[Cluster, Registry], PlacementController]


class Fleet:
    """Membership, registration, DNS discovery and placement of one gateway.

    ``token`` is the token registering workers must present ("" for none), read
    by whoever builds the fleet (``gateway.security.setup.worker_token``);
    ``placement`` makes the placement controller from the cluster and this fleet's registry
    (``gateway.fleet.placement.PlacementController``; several processes:
    ``gateway.multiproc.group.FollowerPlacement`` in a follower), which brings its own settings
    and clock; ``clock`` is the registry's (heartbeat expiry)."""

    def __init__(self, cluster: Cluster, placement: PlacementFactory, *, workers: Sequence[WorkerSpec] = (),
                 worker_dns: Sequence[str] = (), membership: MembershipSettings = MembershipSettings(),
                 token: str = "", clock: Callable[[], float] | None = None) -> None:
        self.cluster = cluster
        self.membership = Membership(cluster, workers)
        kwargs = {"clock": clock} if clock is not None else {}
        self.registry = Registry(self.membership, heartbeat_interval_s=membership.heartbeat_interval_s,
                                 misses_to_down=membership.heartbeat_misses_to_down, token=token, **kwargs)
        self.discovery = (DnsDiscovery(self.membership, worker_dns, refresh_s=membership.dns_refresh_s)
                          if worker_dns else None)
        self.placement = placement(cluster, self.registry)

    async def start(self) -> None:
        await self.registry.start()
        try:
            if self.discovery is not None:
                await self.discovery.start()
            await self.placement.start()
        except BaseException:
            await self.stop()
            raise

    async def stop(self) -> None:
        await self.placement.stop()
        if self.discovery is not None:
            await self.discovery.stop()
        await self.registry.stop()
