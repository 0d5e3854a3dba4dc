"""What the observers read of the live gateway (``ObservedGateway``).

``metrics`` and ``cluster_api`` are handed the gateway by the process wiring
and read it at each scrape or poll. They depend on this ``Protocol``, which
lists only what they read, never on ``gateway.core``: the parts below it
(cluster, router, batchers, placement, split models, response cache) are
described here by the few members read, so nothing in observability imports
the packages above it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from gateway.observability.latency import LatencyHistograms
from gateway.observability.stats import GatewayStats


class ObservedCluster(Protocol):
    """The cluster view: its workers and the models they serve."""

    def workers(self) -> Iterable[Any]: ...

    def models(self) -> Mapping[str, Any]: ...

    def known_models(self) -> Mapping[str, Any]: ...


class ObservedRouter(Protocol):
    """The router's per-worker counters, its outlier detector and its per-row cost estimates."""

    outliers: Any
    row_costs: Any
    resumes: Any  # generations resumed (``resumed``) and not (``not_resumed``), by model
    prefix_affinity: Any  # prompts routed by prefix (``hits``, ``misses``, ``diverted``, ``remembered``), or None

    def worker_stats(self) -> Iterable[Any]: ...


class ObservedBatcher(Protocol):
    """One model's batcher: its policy, queue depth, batches in flight and counters."""

    policy: Any
    stats: Any

    def queue_depth(self) -> int: ...

    def inflight_batches(self) -> int: ...


class ObservedGateway(Protocol):
    """The gateway as the metrics and the cluster API read it.

    ``placement`` (moves, loads, rounds), ``parallel`` (``stats()`` of split
    models) and ``cache`` (the response cache's counters) are read when present.
    """

    stats: GatewayStats
    latency: LatencyHistograms
    placement: Any
    parallel: Any
    cache: Any

    @property
    def cluster(self) -> ObservedCluster: ...

    @property
    def router(self) -> ObservedRouter: ...

    def batchers(self) -> Mapping[tuple[str, str], ObservedBatcher]: ...

    def server_ready(self) -> bool: ...
