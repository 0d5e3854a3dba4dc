"""Placement of a logical model's slots on workers: deterministic, spread out,
and sticky.

A logical model has ``groups`` copies (data-parallel replicas) of ``slots``
slots each (see ``layout_split``); every (group, slot) pair needs one worker.
Each pair ranks the candidate workers by rendezvous hashing (highest
``sha256(model/group/slot/address)`` first), so every gateway that sees the
same workers computes the same placement, with no shared store, and losing a
worker moves only the pairs it hosted.

Among candidates the first tier that is not empty wins:

1. a worker that hosts nothing of this model yet (one slot per worker);
2. a worker outside this group that does not hold this slot for another group
   (a group's ranks run in parallel, on distinct workers; two copies of one
   slot on one worker would add no redundancy);
3. a worker outside this group;
4. a worker that does not hold this slot yet;
5. any worker.

Within a tier, workers carrying fewer slots of all logical models go first
(``load``), then the hash decides. Pairs whose worker is still usable keep it
(``current``): placement only changes where it must.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence

SlotKey = tuple[int, int]  # (group, slot)


def score(model: str, key: SlotKey, address: str) -> int:
    """The rendezvous weight of ``address`` for one (group, slot) pair of ``model``."""
    digest = hashlib.sha256(f"{model}/{key[0]}/{key[1]}/{address}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def place(
    model: str,
    groups: int,
    slots: int,
    workers: Sequence[str],
    *,
    current: Mapping[SlotKey, str] | None = None,
    load: Mapping[str, int] | None = None,
) -> dict[SlotKey, str]:
    """A worker address for every (group, slot) pair (pairs stay out while there is no worker).

    ``current`` pairs are kept as they are (the caller drops those whose
    worker it gives up on); new pairs go only to ``workers``. ``load`` counts
    the slots (of any logical model) each worker carries besides this model's.
    """
    usable = list(dict.fromkeys(workers))
    placed: dict[SlotKey, str] = dict(current or {})
    counts = dict(load or {})
    for address in placed.values():
        counts[address] = counts.get(address, 0) + 1
    for key in _keys(groups, slots):
        if key in placed:
            continue
        if not usable:
            break
        address = _choose(model, key, usable, placed, counts)
        placed[key] = address
        counts[address] = counts.get(address, 0) + 1
    return placed


def _keys(groups: int, slots: int) -> Iterable[SlotKey]:
    return ((g, s) for g in range(groups) for s in range(slots))


def _choose(model: str, key: SlotKey, usable: list[str], placed: Mapping[SlotKey, str], counts: Mapping[str, int]) -> str:
    group, slot = key
    used = set(placed.values())
    in_group = {a for (g, _), a in placed.items() if g == group}
    holding = {a for (_, s), a in placed.items() if s == slot}
    tiers = (
        [a for a in usable if a not in used],
        [a for a in usable if a not in in_group and a not in holding],
        [a for a in usable if a not in in_group],
        [a for a in usable if a not in holding],
        usable,
    )
    tier = next(t for t in tiers if t)
    return min(tier, key=lambda a: (counts.get(a, 0), -score(model, key, a)))
