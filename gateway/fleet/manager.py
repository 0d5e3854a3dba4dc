"""The fleet: the parts that change the cluster's membership and what runs
where, with their start and stop order.

- membership sources (``membership``): the static list, DNS names
  (``discovery``) and self-registration (``registry``, served on the
  gateway's gRPC port);
- placement and model lifecycle (``placement``);
- draining (``gateway.fleet.drain`` drives the placement controller and the cluster).

The composition root builds it and hands in what differs between setups: the
worker token registrations must carry, and where several gateway processes
serve together, a follower's placement (``placement``: made from the cluster
and the registry this fleet builds).

Start (after the cluster's first probe): registry expiry -> DNS (first
lookup: its workers join before placement) -> placement (first round).
Stop: the reverse, before the cluster closes its channels.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from gateway.fleet.cluster import Cluster
from gateway.fleet.discovery import DnsDiscovery
from gateway.fleet.membership import Membership
from gateway.fleet.placement import PlacementController
from gateway.fleet.registry import Registry
from gateway.settings import GatewayConfig

log = logging.getLogger(__name__)

# (config, cluster, registry) -> the placement controller; the default is ``PlacementController`` itself.
PlacementFactory = Callable[[GatewayConfig, Cluster, Registry], PlacementController]


class Fleet:
    """Membership, registration, DNS discovery and placement of one gateway.

    ``token`` is the token registering workers must present ("" for none), read
    by whoever builds the fleet (``gateway.security.setup.worker_token``);
    ``placement`` makes the placement controller when a setup supplies its own
    (several processes: ``gateway.multiproc.group.FollowerPlacement``)."""

    def __init__(self, config: GatewayConfig, cluster: Cluster, *, token: str = "",
                 placement: PlacementFactory | None = None, clock: Callable[[], float] | None = None) -> None:
        self.config = config
        self.cluster = cluster
        self.membership = Membership(cluster, config.workers)
        kwargs = {"clock": clock} if clock is not None else {}
        self.registry = Registry(self.membership, heartbeat_interval_s=config.membership.heartbeat_interval_s,
                                 misses_to_down=config.membership.heartbeat_misses_to_down, token=token, **kwargs)
        self.discovery = (DnsDiscovery(self.membership, config.worker_dns, refresh_s=config.membership.dns_refresh_s)
                          if config.worker_dns else None)
        self.placement = (placement(config, cluster, self.registry) if placement is not None
                          else PlacementController(config, cluster, self.registry, **kwargs))

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
