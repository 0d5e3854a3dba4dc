"""Rendezvous (highest random weight) placement of whole models on workers.

Each model ranks every worker by ``sha256(model/address)``, highest first,
and takes the first ``replicas`` workers that have room for it. The ranking
depends on nothing but the names, so every gateway that sees the same
workers computes the same placement with no shared store; a worker joining
takes only the replicas for which it ranks in a model's top ``replicas``,
and a worker leaving moves only its own replicas: the fewest moves any
balanced placement can make. Pure functions, no I/O.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass


def score(key: str, address: str) -> int:
    """The rendezvous weight of ``address`` for ``key``."""
    return int.from_bytes(hashlib.sha256(f"{key}/{address}".encode()).digest()[:8], "big")


def rendezvous_order(key: str, addresses: Iterable[str]) -> list[str]:
    """``addresses`` from the most to the least preferred for ``key`` (ties, impossible in practice, by address)."""
    return sorted(set(addresses), key=lambda a: (-score(key, a), a))


@dataclass(frozen=True, slots=True)
class Demand:
    name: str
    replicas: int
    memory_bytes: int = 0


@dataclass(frozen=True, slots=True)
class Bin:
    """One worker as placement sees it: room for models, None = unbounded."""

    address: str
    capacity_bytes: int | None = None
    reserved_bytes: int = 0  # held by models placement does not manage


def plan(demands: Sequence[Demand], bins: Sequence[Bin], *,
         refused: AbstractSet[tuple[str, str]] = frozenset()) -> dict[str, tuple[str, ...]]:
    """Workers for each demand, in the demands' order of priority.

    Each demand takes the first workers of its rendezvous order that still
    have room and did not refuse it; it gets fewer than it asks for (maybe
    none) when too few do. Replicas of one model never share a worker;
    several models share one wherever their memory fits.
    """
    room: dict[str, int | None] = {
        b.address: None if b.capacity_bytes is None else b.capacity_bytes - b.reserved_bytes for b in bins
    }
    targets: dict[str, tuple[str, ...]] = {}
    for demand in demands:
        chosen: list[str] = []
        for address in rendezvous_order(demand.name, room):
            if len(chosen) >= demand.replicas:
                break
            left = room[address]
            if (demand.name, address) in refused or (left is not None and demand.memory_bytes > left):
                continue
            chosen.append(address)
            if left is not None:
                room[address] = left - demand.memory_bytes
        targets[demand.name] = tuple(chosen)
    return targets
