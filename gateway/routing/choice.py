"""Replica choice: the policy that picks, among a model's candidate replicas, the one a batch goes to.

The router decides which replicas are candidates (READY, circuit closed or
every circuit open, not tried yet by the call while another can serve, each
below its in-flight bound: ``gateway.routing.capacity``); a
:class:`ReplicaChooser` picks one of them, or none, and the call waits for a
slot. The policy is the one seam for other rules (a sticky sequence, a
prefix cache), as Ray Serve's ``RequestRouter`` is; the composition root
builds it and hands it to the router.

:class:`LeastLoaded`, the default: least outstanding batches per execution
slot, random among equals so idle replicas share light load; with more than
a handful of candidates, the better of two random ones (power of two
choices).

:class:`LocalFirst` wraps another policy where the gateway runs models
itself (``gateway.replicas.local``): the in-process replica takes a
batch while it has a free execution slot (no hop, no copy), the others take
the rest by the wrapped policy.
"""

from __future__ import annotations

import random
from collections.abc import Sequence, Set
from typing import Protocol

from gateway.fleet.cluster import WorkerState
from gateway.routing.capacity import InflightBounds

# Above this many candidates, sample two instead of scanning (power of two choices).
P2C_THRESHOLD = 4


class ReplicaChooser(Protocol):
    def choose(
        self, model: str, version: str, candidates: Sequence[WorkerState], avoid: Set[WorkerState],
        bounds: InflightBounds,
    ) -> WorkerState | None:
        """One of ``candidates`` (never empty) for a batch of ``model``, or None to wait for a slot.

        ``avoid``: the replicas this call has tried or runs on already; the
        candidates hold some only when no other replica can serve.
        ``bounds``: each replica's in-flight bounds and load.
        """
        ...


class LeastLoaded:
    """The least loaded candidate (power of two choices among many)."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(
        self, model: str, version: str, candidates: Sequence[WorkerState], avoid: Set[WorkerState],
        bounds: InflightBounds,
    ) -> WorkerState | None:
        # Load = batches in flight per execution slot: a replica with more slots takes
        # more batches before it counts as loaded as a smaller one, and idle replicas
        # (load 0) stay equals, so light load is shared whatever their sizes.
        if len(candidates) > P2C_THRESHOLD:
            a, b = self._rng.sample(candidates, 2)
            return a if bounds.load(a, model) <= bounds.load(b, model) else b
        loads = [bounds.load(w, model) for w in candidates]
        least = min(loads)
        best = [w for w, n in zip(candidates, loads) if n == least]
        # Random among equals so idle replicas share light load.
        return best[0] if len(best) == 1 else self._rng.choice(best)


class LocalFirst:
    """The in-process replica while it has a free execution slot; ``inner``'s choice otherwise."""

    def __init__(self, inner: ReplicaChooser, kind: str = "local") -> None:
        self._inner = inner
        self._kind = kind

    def choose(
        self, model: str, version: str, candidates: Sequence[WorkerState], avoid: Set[WorkerState],
        bounds: InflightBounds,
    ) -> WorkerState | None:
        for w in candidates:
            if w.kind == self._kind and w not in avoid and bounds.held(w, model) < bounds.limits(w, model)[0]:
                return w
        return self._inner.choose(model, version, candidates, avoid, bounds)
