"""A byte-bounded LRU of inference responses, keyed by what decides a response.

Triton's response cache, in the gateway: a model whose ``config.pbtxt`` says
``response_cache { enable: true }`` is answered from here for a request
identical to one answered before -- same model and version, same input
tensors (name, datatype, shape, bytes), same requested outputs with their
parameters (``classification`` included), same request parameters except
those that only schedule or encode the request (``timeout``, ``priority``,
binary-data flags). Only successful responses are kept, and only while the
model's config enables the cache and ``cache.size_bytes`` is above 0.

Memory: every entry is charged its output bytes, its key and a fixed
overhead per tensor; inserting past ``capacity_bytes`` evicts the least
recently used entries first, and an entry larger than the whole cache is
not kept. Output bytes are copied on insert, so an entry never pins the
larger buffer of the batch its response was split from.

Counters follow Triton: a hit counts the time to look up and copy the
response out, a miss the lookup plus, once the response came back, its
insertion (``cache_hit`` / ``cache_miss`` in the statistics,
``nv_cache_*_per_model`` in ``/metrics``). Everything runs on the event loop
thread: no locks.
"""

from __future__ import annotations

import hashlib
import struct
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from tritonclient.grpc import service_pb2

from gateway.types import InferRequest, InferResponse, Tensor

# Request parameters that schedule or encode a request without changing its outputs.
NEUTRAL_PARAMETERS = frozenset({
    "timeout", "priority", "binary_data_output", "binary_data_size", "binary_data", "headers",
})
# Bookkeeping charged per entry and per tensor, beyond the bytes themselves.
ENTRY_OVERHEAD_BYTES = 256
TENSOR_OVERHEAD_BYTES = 128


@dataclass(slots=True)
class CacheCounters:
    """One model version's hits and misses; durations are nanoseconds, as Triton reports them."""

    hits: int = 0
    hit_ns: int = 0
    misses: int = 0
    miss_ns: int = 0


@dataclass(slots=True)
class _Entry:
    model: str
    version: str
    outputs: list[Tensor]
    parameters: dict[str, Any]
    size: int


@dataclass(slots=True)
class Lookup:
    """A miss in progress: its key and the time spent so far, to be completed by :meth:`ResponseCache.insert`."""

    key: bytes
    model: str
    version: str
    elapsed_ns: int = 0


def cache_enabled(config: Any) -> bool:
    """Whether a model's ``ModelConfig`` asks for the response cache."""
    return bool(config.HasField("response_cache") and config.response_cache.enable)


def _feed_value(h: Any, value: Any) -> None:
    h.update(repr(value).encode())
    h.update(b"\x00")


def request_key(request: InferRequest) -> bytes:
    """A digest of everything that decides the response to ``request`` (its version resolved)."""
    h = hashlib.blake2b(digest_size=32)
    for part in (request.model, request.version):
        _feed_value(h, part)
    for tensor in sorted(request.inputs, key=lambda t: t.name):
        _feed_value(h, (tensor.name, tensor.datatype, tuple(tensor.shape)))
        h.update(struct.pack("<Q", len(tensor.data)))
        h.update(tensor.data)
    outputs = sorted(
        (o.name, sorted((k, repr(v)) for k, v in o.parameters.items() if k not in NEUTRAL_PARAMETERS))
        for o in request.outputs
    )
    _feed_value(h, outputs)
    _feed_value(h, sorted((k, repr(v)) for k, v in request.parameters.items() if k not in NEUTRAL_PARAMETERS))
    return h.digest()


class ResponseCache:
    """Responses by request key, least recently used first out, bounded by ``capacity_bytes``."""

    def __init__(self, capacity_bytes: int, *, clock: Any = time.perf_counter_ns) -> None:
        if capacity_bytes < 0:
            raise ValueError("cache size must be >= 0 bytes")
        self.capacity_bytes = capacity_bytes
        self._clock = clock
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._counters: dict[tuple[str, str], CacheCounters] = {}
        self.used_bytes = 0
        self.evictions = 0

    @property
    def enabled(self) -> bool:
        return self.capacity_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def counters(self) -> dict[tuple[str, str], CacheCounters]:
        """Per (model, version): a copy of the mapping, safe to iterate."""
        return dict(self._counters)

    def counter(self, model: str, version: str) -> CacheCounters:
        c = self._counters.get((model, version))
        if c is None:
            c = self._counters[(model, version)] = CacheCounters()
        return c

    def lookup(self, request: InferRequest) -> InferResponse | Lookup:
        """The cached response for ``request`` (a hit: a fresh response with its id), or the pending miss."""
        start = self._clock()
        key = request_key(request)
        entry = self._entries.get(key)
        if entry is None:
            return Lookup(key, request.model, request.version, self._clock() - start)
        self._entries.move_to_end(key)
        response = InferResponse(
            model=request.model,
            version=entry.version,
            id=request.id,
            outputs=[Tensor(t.name, t.datatype, t.shape, t.data, dict(t.parameters)) for t in entry.outputs],
            parameters=dict(entry.parameters),
        )
        c = self.counter(request.model, request.version)
        c.hits += 1
        c.hit_ns += self._clock() - start
        return response

    def insert(self, miss: Lookup, response: InferResponse) -> None:
        """Keep ``response`` under the miss's key, evicting the least recently used to make room."""
        start = self._clock()
        outputs = [Tensor(t.name, t.datatype, tuple(t.shape), bytes(t.data), dict(t.parameters)) for t in response.outputs]
        size = ENTRY_OVERHEAD_BYTES + len(miss.key) + sum(TENSOR_OVERHEAD_BYTES + len(t.data) for t in outputs)
        if size <= self.capacity_bytes:
            old = self._entries.pop(miss.key, None)
            if old is not None:
                self.used_bytes -= old.size
            while self._entries and self.used_bytes + size > self.capacity_bytes:
                _, evicted = self._entries.popitem(last=False)
                self.used_bytes -= evicted.size
                self.evictions += 1
            self._entries[miss.key] = _Entry(miss.model, response.version, outputs, dict(response.parameters), size)
            self.used_bytes += size
        self.record_miss(miss, self._clock() - start)

    def record_miss(self, miss: Lookup, extra_ns: int = 0) -> None:
        """Count a miss (also one whose request then failed: nothing was inserted)."""
        c = self.counter(miss.model, miss.version)
        c.misses += 1
        c.miss_ns += miss.elapsed_ns + extra_ns

    def clear(self, model: str | None = None) -> None:
        """Forget every entry (of ``model`` only, when given): after an unload or reload."""
        if model is None:
            self._entries.clear()
            self.used_bytes = 0
            return
        for key in [k for k, e in self._entries.items() if e.model == model]:
            self.used_bytes -= self._entries.pop(key).size


def fill_statistics(response: service_pb2.ModelStatisticsResponse, counters: dict[tuple[str, str], CacheCounters]) -> None:
    """Write ``cache_hit`` / ``cache_miss`` into the statistics of each model version that has counters."""
    for stats in response.model_stats:
        c = counters.get((stats.name, stats.version))
        if c is None:
            continue
        st = stats.inference_stats
        st.cache_hit.count, st.cache_hit.ns = c.hits, c.hit_ns
        st.cache_miss.count, st.cache_miss.ns = c.misses, c.miss_ns
