"""The fleet: the parts that change the cluster's membership and what runs
where, with their start and stop order.

- membership sources (``membership``): the static list, DNS names
  (``discovery``) and self-registration (``registry``, served on the
  gateway's gRPC port);
- placement and model lifecycle (``placement``);
- draining (``gateway.fleet.drain`` drives the placement controller and the cluster).

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
from gateway.security.setup import _worker_token
from gateway.settings import GatewayConfig

log = logging.getLogger(__name__)


class Fleet:
    def __init__(self, config: GatewayConfig, cluster: Cluster, *, clock: Callable[[], float] | None = None) -> None:
        self.config = config
        self.cluster = cluster
        self.membership = Membership(cluster, config.workers)
        kwargs = {"clock": clock} if clock is not None else {}
        membership = config.membership
        self.registry = Registry(self.membership, heartbeat_interval_s=membership.heartbeat_interval_s,
                                 misses_to_down=membership.heartbeat_misses_to_down, token=_worker_token(config), **kwargs)
        self.discovery = (DnsDiscovery(self.membership, config.worker_dns, refresh_s=config.membership.dns_refresh_s)
                          if config.worker_dns else None)
        self.placement = PlacementController(config, cluster, self.registry, **kwargs)

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
