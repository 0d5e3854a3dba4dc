"""How much each placed model is wanted: its replica count now, from its
declaration, its use, its idle time and its request rate.

The placement controller (``gateway.fleet.placement``) asks this book what to
place; the book knows nothing of workers. Per model it keeps:

- ``floor``: the replicas it has while active (its declared ``replicas``,
  else 1 for a model loaded on demand);
- ``replicas``: what is wanted now, 0 while inactive (never placed yet,
  unloaded after its idle TTL, or evicted for memory);
- ``last_used`` and ``rate``: the last request and the smoothed inferences
  per second, from this gateway's requests and from what the workers report
  (so several gateways behind one balancer see the same, whole, traffic).

Rules, applied by :meth:`DemandBook.tick`:

- idle TTL: an active model with no inference for longer than its TTL
  becomes inactive (``replicas`` 0);
- autoscaling (when ``AutoscalePolicy.up_rate`` > 0): one replica more while
  the rate exceeds ``up_rate`` per replica, one fewer (never below the floor)
  while it is under ``down_rate`` per remaining replica. ``down_rate`` below
  ``up_rate`` is the hysteresis band, and each model changes at most once
  per ``cooldown_s``, so a rate near a threshold does not flap.

Everything runs on the gateway's event loop; ``touch`` is on the request path
and only adds to counters.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class AutoscalePolicy:
    up_rate: float = 0.0  # inferences/s per replica above which a replica is added; 0 = off
    down_rate: float = 0.0  # per remaining replica below which one is removed; 0 = up_rate / 2
    max_replicas: int = 0  # 0 = as many as there are workers to hold them
    cooldown_s: float = 30.0
    window_s: float = 5.0  # time constant of the rate's moving average

    @property
    def enabled(self) -> bool:
        return self.up_rate > 0

    @property
    def effective_down_rate(self) -> float:
        return self.down_rate if self.down_rate > 0 else self.up_rate / 2


@dataclass(frozen=True, slots=True)
class Observed:
    """What the workers report about one model, summed over them."""

    rows_per_s: float = 0.0
    last_used: float | None = None  # on the book's clock


@dataclass(slots=True, eq=False)
class ModelDemand:
    name: str
    floor: int
    declared: bool
    idle_ttl_s: float
    ceiling: int = 0  # per-model max_replicas; 0 = the policy's
    replicas: int = 0
    last_used: float = 0.0
    rate: float = 0.0
    pending_rows: int = 0
    changed_at: float = -math.inf
    reason: str = ""  # why it is inactive, or last changed

    @property
    def active(self) -> bool:
        return self.replicas > 0


class DemandBook:
    """Every model the controller places, with what is wanted of it."""

    def __init__(self, policy: AutoscalePolicy, *, idle_ttl_s: float = 0.0, clock: Clock = time.monotonic) -> None:
        self.policy = policy
        self._idle_ttl_s = idle_ttl_s
        self._clock = clock
        self._models: dict[str, ModelDemand] = {}
        self._last_tick: float | None = None

    def __contains__(self, name: object) -> bool:
        return name in self._models

    def __iter__(self) -> Iterator[ModelDemand]:
        return iter(list(self._models.values()))

    def get(self, name: str) -> ModelDemand | None:
        return self._models.get(name)

    def declare(self, name: str, replicas: int, *, idle_ttl_s: float | None = None, ceiling: int = 0) -> ModelDemand:
        """A model of the config: active now, with ``replicas`` at rest."""
        demand = ModelDemand(name, max(1, replicas), True, self._ttl(idle_ttl_s), ceiling=ceiling)
        self._models[name] = demand
        self._activate(demand, "declared")
        return demand

    def activate(self, name: str, *, floor: int = 1, idle_ttl_s: float | None = None) -> ModelDemand:
        """Wanted now (a request for it): added if new, reactivated if idle or evicted."""
        demand = self._models.get(name)
        if demand is None:
            demand = self._models[name] = ModelDemand(name, max(1, floor), False, self._ttl(idle_ttl_s))
        if not demand.active:
            self._activate(demand, "requested")
        return demand

    def adopt(self, name: str, replicas: int) -> ModelDemand:
        """Take over a model this gateway did not place (a drained worker's): keep ``replicas`` of it."""
        demand = self._models.get(name)
        if demand is None:
            demand = self._models[name] = ModelDemand(name, max(1, replicas), True, self._ttl(None))
        else:
            demand.floor = max(demand.floor, replicas)
        if demand.replicas < demand.floor:
            self._activate(demand, "adopted")
        return demand

    def deactivate(self, name: str, reason: str) -> None:
        demand = self._models.get(name)
        if demand is not None and demand.active:
            demand.replicas = 0
            demand.reason = reason
            demand.rate = 0.0

    def forget(self, name: str) -> None:
        self._models.pop(name, None)

    def touch(self, name: str, rows: int = 1) -> None:
        """A request for ``name`` (hot path): counts for the idle TTL and the rate."""
        demand = self._models.get(name)
        if demand is not None:
            demand.last_used = self._clock()
            demand.pending_rows += rows

    def tick(self, observed: Mapping[str, Observed], workers: int) -> list[tuple[str, str]]:
        """Update rates, apply the idle TTL and autoscaling; returns (model, what happened) pairs."""
        now = self._clock()
        dt = 0.0 if self._last_tick is None else now - self._last_tick
        self._last_tick = now
        events: list[tuple[str, str]] = []
        policy = self.policy
        alpha = 1.0 - math.exp(-dt / policy.window_s) if dt > 0 else 0.0
        for demand in list(self._models.values()):
            if dt > 0:
                demand.rate += alpha * (demand.pending_rows / dt - demand.rate)
                demand.pending_rows = 0
            seen = observed.get(demand.name, Observed())
            if seen.last_used is not None and seen.last_used > demand.last_used:
                demand.last_used = seen.last_used
            if not demand.active:
                continue
            if demand.idle_ttl_s > 0 and now - demand.last_used > demand.idle_ttl_s:
                self.deactivate(demand.name, "idle")
                events.append((demand.name, "idle"))
                continue
            if not policy.enabled:
                continue
            rate = max(demand.rate, seen.rows_per_s)
            cooled = now - demand.changed_at >= policy.cooldown_s
            ceiling = max(demand.floor, demand.ceiling or policy.max_replicas or workers)
            if rate > policy.up_rate * demand.replicas and demand.replicas < ceiling and cooled:
                demand.replicas += 1
                demand.changed_at, demand.reason = now, f"scaled up at {rate:.1f}/s"
                events.append((demand.name, "up"))
            elif (demand.replicas > demand.floor and rate < policy.effective_down_rate * (demand.replicas - 1)
                  and cooled):
                demand.replicas -= 1
                demand.changed_at, demand.reason = now, f"scaled down at {rate:.1f}/s"
                events.append((demand.name, "down"))
        return events

    def _activate(self, demand: ModelDemand, reason: str) -> None:
        demand.replicas = max(demand.replicas, demand.floor)
        demand.last_used = self._clock()
        demand.reason = reason
        # A fresh activation may scale up at once if it is hot; its cooldown starts with the first change.
        demand.changed_at = -math.inf

    def _ttl(self, idle_ttl_s: float | None) -> float:
        return self._idle_ttl_s if idle_ttl_s is None else float(idle_ttl_s)
