"""The state the gateway keeps per logical model while serving it, and the
snapshot of its counters (``ParallelStats``).

``ServedModel`` is mutable and lives on the gateway's event loop: the
registry (``serving``) reads and updates it between awaits; placement changes
(``shard_placement``) happen under its ``lock``.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field

from gateway.fleet.cluster import ModelInfo
from gateway.parallel.logical import LogicalSpec
from gateway.parallel.placement import SlotKey
from protos.collective_pb2 import Step
from splitter.layout_split import LayoutSplit


@dataclass(frozen=True, slots=True)
class ParallelStats:
    """Counters of one logical model; times are sums over batches, in seconds."""

    model: str
    batches: int
    failures: int
    retries: int  # batches rerun after a shard had no copy left
    replaced: int  # slots moved to another worker
    shard_calls: int  # gateway -> worker calls (shard runs, or one group run per rank)
    plan_s: float  # wall time of plan runs
    remote_s: float  # waiting on workers (per segment: first call out to last answer in)
    collective_s: float  # the gateway's side between segments: decode, sum/concat, encode
    bytes_sent: int
    bytes_received: int
    peer_bytes: int = 0  # tensor bytes moved worker to worker (peer collectives, pipeline hand-offs)
    groups_ready: int = 0  # copies set up as peer groups and serving now


@dataclass(slots=True, eq=False)
class PeerGroup:
    """One copy of a logical model as a collective group."""

    id: str
    replica: int
    epoch: int
    members: tuple[str, ...]  # worker address per slot (rank or stage)
    ready: bool = True
    inflight: int = 0
    batches: itertools.count = field(default_factory=lambda: itertools.count(1))


@dataclass(slots=True, eq=False)
class ServedModel:
    """One logical model: its split, signature, placement and load."""

    spec: LogicalSpec
    layout: LayoutSplit
    needed: dict[str, tuple[str, ...]]  # shard -> outputs the plan reads from it
    files: dict[str, bytes]  # shard -> ONNX bytes
    digests: dict[str, str]  # shard -> content digest (a worker holding it needs no push)
    info: ModelInfo  # what clients see: the source's signature under this name
    limit: int  # batches in flight at once
    slot_steps: tuple[tuple[Step, ...], ...] = ()  # per slot, for peer groups (empty: the star only)
    loaded: bool = True
    placement: dict[SlotKey, str] = field(default_factory=dict)
    down_since: dict[SlotKey, float] = field(default_factory=dict)
    excluded: set[str] = field(default_factory=set)  # workers that refused our shards
    inflight: int = 0
    waiters: set[asyncio.Future[None]] = field(default_factory=set)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    repair: asyncio.Task[None] | None = None
    counters: dict[str, float] = field(default_factory=dict)
    groups: dict[int, PeerGroup] = field(default_factory=dict)  # replica -> its peer group
    group_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def count(self, key: str, value: float = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + value

    def stats(self) -> ParallelStats:
        c = self.counters
        return ParallelStats(
            self.spec.name, int(c.get("batches", 0)), int(c.get("failures", 0)), int(c.get("retries", 0)),
            int(c.get("replaced", 0)), int(c.get("shard_calls", 0)), c.get("plan_s", 0.0), c.get("remote_s", 0.0),
            c.get("collective_s", 0.0), int(c.get("bytes_sent", 0)), int(c.get("bytes_received", 0)),
            int(c.get("peer_bytes", 0)), sum(g.ready for g in self.groups.values()))

    def wake(self) -> None:
        """Resolve every capacity waiter (a batch finished, or hosts changed)."""
        waiters, self.waiters = self.waiters, set()
        for future in waiters:
            if not future.done():
                future.set_result(None)
