"""Ring all-reduce between the ranks of a collective group: reduce-scatter,
then all-gather, each rank talking only to its neighbours.

The tensor is cut into N chunks (``chunk_bounds``: ``numpy.array_split``'s
bounds on the flattened tensor). Reduce-scatter: at hop s rank r sends its
running sum of chunk (r - s) mod N to rank r + 1 and adds what rank r - 1
sent it to its own part of chunk (r - s - 1) mod N; after N - 1 hops rank r
holds the whole sum of chunk (r + 1) mod N. All-gather: N - 1 more hops pass
the finished chunks on around the ring. Each rank sends 2(N-1)/N of the
tensor instead of the (N-1) whole copies of a direct exchange.

Determinism: chunk c is always summed in the same order, starting at rank c
and going round the ring -- ``(x_c + x_{c+1}) + ...`` -- whatever the timing
of the messages, and every rank ends with the finished chunk's bytes as its
owner computed them: every rank holds the same bytes, run after run.

The transport is a seam (``Hops``): the worker's peer links and mailbox in
production, an in-memory one in the unit tests.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

import numpy as np

# From three ranks up a sum runs as a ring: at two the ring sends the same
# bytes as the direct exchange (one half each way, twice) in twice the hops.
RING_MIN_RANKS = 3


class Hops(Protocol):
    """One collective's messages to and from a rank's neighbours, ``part`` = the hop number."""

    async def send(self, part: int, target: int, chunk: np.ndarray) -> None: ...

    async def receive(self, part: int, source: int) -> np.ndarray: ...


def chunk_bounds(length: int, n: int) -> list[tuple[int, int]]:
    """(start, stop) of each of the n chunks of a flattened tensor of ``length`` elements."""
    base, extra = divmod(length, n)
    bounds, start = [], 0
    for i in range(n):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def sum_order(chunk: int, n: int) -> list[int]:
    """The ranks whose parts chunk ``chunk`` adds, in the order the ring adds them."""
    return [(chunk + i) % n for i in range(n)]


async def ring_allreduce(part: np.ndarray, rank: int, n: int, hops: Hops) -> tuple[np.ndarray, int]:
    """The sum of every rank's ``part`` (same shape and dtype on every rank), and the bytes this rank sent."""
    total = np.array(part, copy=True).reshape(-1)  # contiguous: chunks are views of it
    bounds = chunk_bounds(total.size, n)
    right, left = (rank + 1) % n, (rank - 1) % n
    sent = 0

    def chunk(i: int) -> np.ndarray:
        start, stop = bounds[i % n]
        return total[start:stop]

    async def hop(number: int, outgoing: np.ndarray) -> np.ndarray:
        nonlocal sent
        # Send and receive at once: the neighbours' hops overlap, no rank waits on its own send.
        try:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(hops.send(number, right, outgoing))
                incoming = tasks.create_task(hops.receive(number, left))
        except ExceptionGroup as failed:
            raise first_error(failed) from None
        sent += outgoing.nbytes
        return incoming.result()

    for s in range(n - 1):  # reduce-scatter
        incoming = await hop(s, chunk(rank - s))
        target = chunk(rank - s - 1)
        # incoming holds the ranks before this one in the chunk's order: it goes first.
        np.add(incoming.reshape(-1), target, out=target)
    for s in range(n - 1):  # all-gather
        incoming = await hop(n - 1 + s, chunk(rank + 1 - s))
        chunk(rank - s)[...] = incoming.reshape(-1)
    return total.reshape(part.shape), sent


def first_error(group: BaseExceptionGroup) -> BaseException:
    """The first leaf error of a task group, which the error edge can map to a status."""
    first = group.exceptions[0]
    return first_error(first) if isinstance(first, BaseExceptionGroup) else first
