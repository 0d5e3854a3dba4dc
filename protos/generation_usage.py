"""A generation model's live figures in Triton's statistics answer: the one
place the worker writes them and the gateway reads them.

``ModelStatistics.memory_usage`` (repeated ``MemoryUsage{type, id,
byte_size}``) is Triton's field for what a model holds in memory, so the
KV cache goes there, in two entries whose ``type`` names what they are:

- ``KV_CACHE``: the bytes the running sequences' caches hold;
- ``KV_CACHE_RESERVED``: the bytes reserved by every admitted sequence
  (prompt + ``max_tokens`` each), running or waiting.

Triton's ``id`` is an integer (a device's index); here it counts the
sequences behind each entry: the running sequences for ``KV_CACHE``, the
admitted ones for ``KV_CACHE_RESERVED`` (so waiting = admitted - running).
That keeps the counts in the same answer as the bytes, read in one call
the gateway already knows how to make, instead of a second channel
(the heartbeat reaches registered workers only; a worker's own ``/metrics``
only those whose metrics address the gateway was given). A Triton client
parses the answer as it always did: two more memory entries of a type it
does not know.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from tritonclient.grpc import service_pb2

__all__ = ["KV_CACHE", "KV_CACHE_RESERVED", "GenerationUsage", "add_usage", "instances_usage", "read_usage"]

KV_CACHE = "KV_CACHE"
KV_CACHE_RESERVED = "KV_CACHE_RESERVED"


class GenerationSample(Protocol):
    """What one generation instance reports (``GenerationStats``)."""

    @property
    def running(self) -> int: ...

    @property
    def waiting(self) -> int: ...

    @property
    def cache_bytes(self) -> int: ...

    @property
    def reserved_cache_bytes(self) -> int: ...


@dataclass(frozen=True, slots=True)
class GenerationUsage:
    """One generation model's sequences and KV cache now, summed over its instances."""

    running: int
    waiting: int
    cache_bytes: int
    reserved_cache_bytes: int

    @classmethod
    def total(cls, samples: Iterable[GenerationSample]) -> GenerationUsage:
        running = waiting = cache = reserved = 0
        for s in samples:
            running += s.running
            waiting += s.waiting
            cache += s.cache_bytes
            reserved += s.reserved_cache_bytes
        return cls(running, waiting, cache, reserved)


def instances_usage(instances: Iterable[object]) -> GenerationUsage | None:
    """The figures of a model's generation instances (those with ``generation_stats()``); None when it has none."""
    samples = [stats() for stats in (getattr(i, "generation_stats", None) for i in instances) if stats is not None]
    return GenerationUsage.total(samples) if samples else None


def add_usage(stats: service_pb2.ModelStatistics, usage: GenerationUsage) -> None:
    """Append the two KV cache entries to a model's statistics."""
    stats.memory_usage.add(type=KV_CACHE, id=usage.running, byte_size=usage.cache_bytes)
    stats.memory_usage.add(type=KV_CACHE_RESERVED, id=usage.running + usage.waiting,
                           byte_size=usage.reserved_cache_bytes)


def read_usage(stats: service_pb2.ModelStatistics) -> GenerationUsage | None:
    """The figures :func:`add_usage` wrote; None for a model without them (not generative, or a Triton server)."""
    held = reserved = None
    for entry in stats.memory_usage:
        if entry.type == KV_CACHE:
            held = entry
        elif entry.type == KV_CACHE_RESERVED:
            reserved = entry
    if held is None or reserved is None:
        return None
    running = max(0, held.id)
    return GenerationUsage(running, max(0, reserved.id - running), held.byte_size, reserved.byte_size)
