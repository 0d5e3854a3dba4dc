"""Collective groups on this worker: the ranks of split models it runs with
its peers, and how one rank runs one batch (``protos/collective.proto``).

Tensor parallel: every rank holds the batch's inputs, runs its steps in
order, and at each boundary joins its part with the other ranks'. Direct
exchange (two ranks, and every concatenation): send its part to every other
rank and wait for theirs (one hop, (N-1) parts out per rank), then join them
in rank order. A sum from ``ring.RING_MIN_RANKS`` ranks up: a ring
(``ring``), 2(N-1)/N of the tensor out per rank. Either way every rank ends
with the same bytes. Rank 0 answers with the outputs.

Pipeline: the stage runs its step, then calls the next stage's ``Run`` with
the tensors the stages after it read, and answers with what the last stage
returned. The call is awaited without holding the stage's model, so the next
batch runs here while this one moves on: batches overlap along the pipeline.

Concurrency: groups are read and replaced on the event loop only. A batch
keeps the ``Group`` it started with, so a setup of a newer epoch never
changes a batch in flight; the batch then fails on its peers' side and the
gateway reruns it on the new group.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import numpy as np

from protos.collective_pb2 import Boundary, PeerMessage, RunRequest, RunResponse, SetupGroupRequest, Step
from protos.collective_tensors import ALLGATHER, ALLREDUCE_SUM, NONE, combine, fill_message, from_message, to_message
from protos.errors import InvalidArgument, Unavailable
from execution.manager import ModelManager
from workers.peers import BatchKey, Mailbox, PeerLinks
from workers.ring import RING_MIN_RANKS, first_error, ring_allreduce

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 30.0
KINDS = ("tensor", "pipeline")


@dataclass(frozen=True, slots=True)
class Group:
    id: str
    epoch: int
    rank: int
    peers: tuple[str, ...]
    kind: str
    steps: tuple[Step, ...]


class GroupNotSetUp(Unavailable):
    """The gateway asked for a group (or epoch) this worker does not hold: it sets it up again."""


class Groups:
    def __init__(self, manager: ModelManager, links: PeerLinks, mailbox: Mailbox) -> None:
        self._manager = manager
        self._links = links
        self._mailbox = mailbox
        self._groups: dict[tuple[str, int], Group] = {}  # (group id, rank): a worker may hold two ranks

    def __len__(self) -> int:
        return len(self._groups)

    def setup(self, request: SetupGroupRequest) -> None:
        if request.kind not in KINDS:
            raise InvalidArgument(f"group {request.group_id}: kind must be one of {KINDS}, got {request.kind!r}")
        if request.rank >= len(request.peers):
            raise InvalidArgument(f"group {request.group_id}: rank {request.rank} but {len(request.peers)} peers")
        if not request.steps:
            raise InvalidArgument(f"group {request.group_id}: no steps")
        for step in request.steps:
            self._manager.get(step.shard)  # the shard must be loaded here: NOT_FOUND / UNAVAILABLE otherwise
            for b in step.boundaries:
                if b.collective not in (NONE, ALLREDUCE_SUM, ALLGATHER):
                    raise InvalidArgument(f"group {request.group_id}: unknown collective {b.collective!r}")
        current = self._groups.get((request.group_id, request.rank))
        if current is not None and current.epoch > request.epoch:
            raise InvalidArgument(f"group {request.group_id}: epoch {request.epoch} is older than {current.epoch}")
        if current is not None and current.epoch < request.epoch:
            self._mailbox.drop_group(request.group_id)
        self._groups[(request.group_id, request.rank)] = Group(request.group_id, request.epoch, request.rank, tuple(request.peers),
                                               request.kind, tuple(request.steps))
        log.info("group %s epoch %d: rank %d of %d (%s, %d steps)", request.group_id, request.epoch, request.rank,
                 len(request.peers), request.kind, len(request.steps))

    def teardown(self, group_id: str, epoch: int) -> bool:
        """Drop every rank of the group this worker holds (at ``epoch``; 0: any)."""
        keys = [k for k, g in self._groups.items() if k[0] == group_id and (not epoch or g.epoch == epoch)]
        for key in keys:
            log.info("group %s epoch %d rank %d: torn down", group_id, self._groups.pop(key).epoch, key[1])
        if keys:
            self._mailbox.drop_group(group_id)
        return bool(keys)

    def _group(self, group_id: str, rank: int, epoch: int) -> Group:
        group = self._groups.get((group_id, rank))
        if group is None or group.epoch != epoch:
            have = "not set up" if group is None else f"at epoch {group.epoch}"
            raise GroupNotSetUp(f"group {group_id} epoch {epoch} is {have} on this worker")
        return group

    async def run(self, request: RunRequest, timeout_s: float | None) -> RunResponse:
        group = self._group(request.group_id, request.rank, request.epoch)
        timeout = DEFAULT_TIMEOUT_S if timeout_s is None else max(timeout_s, 0.0)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        store = {t.name: from_message(t) for t in request.inputs}
        if group.kind == "pipeline":
            return await self._run_stage(group, request, store, deadline)
        key: BatchKey = (group.id, group.epoch, request.batch_id)
        try:
            sent = await self._run_rank(group, key, store, deadline)
        finally:
            self._mailbox.finish(key, group.rank)
        # The gateway names outputs for rank 0 only; any rank answers those its request names.
        return RunResponse(peer_bytes=sent, outputs=[to_message(name, store[name]) for name in request.outputs])

    async def _run_step(self, step: Step, store: dict[str, np.ndarray]) -> None:
        model = self._manager.get(step.shard)
        try:
            feeds = {name: store[name] for name in step.inputs}
        except KeyError as e:
            raise InvalidArgument(f"shard '{step.shard}' input {e} was not sent") from None
        store.update(await model.run_arrays(feeds, list(step.outputs)))

    async def _run_rank(self, group: Group, key: BatchKey, store: dict[str, np.ndarray], deadline: float) -> int:
        """Run this rank's steps with the exchanges between them; the bytes sent to peers."""
        sent = 0
        exchange = 0
        for step in group.steps:
            await self._run_step(step, store)
            for boundary in step.boundaries:
                if boundary.collective == NONE:
                    continue  # the ranks agree already, or the value stays per rank
                hops = _PeerHops(self._links, self._mailbox, group, key, exchange, boundary.name, deadline)
                if boundary.collective == ALLREDUCE_SUM and len(group.peers) >= RING_MIN_RANKS:
                    store[boundary.name], moved = await ring_allreduce(store[boundary.name], group.rank,
                                                                       len(group.peers), hops)
                else:
                    store[boundary.name], moved = await _direct(boundary, store[boundary.name], group, hops)
                sent += moved
                exchange += 1
        return sent

    async def _run_stage(self, group: Group, request: RunRequest, store: dict[str, np.ndarray], deadline: float) -> RunResponse:
        (step,) = group.steps
        await self._run_step(step, store)
        if group.rank == len(group.peers) - 1:
            return RunResponse(outputs=[to_message(name, store[name]) for name in request.outputs])
        onward = RunRequest(group_id=group.id, epoch=group.epoch, batch_id=request.batch_id, rank=group.rank + 1,
                            inputs=[to_message(name, store[name]) for name in step.forward],
                            outputs=request.outputs)
        remaining = deadline - asyncio.get_running_loop().time()
        answer = await self._links.run(group.peers[group.rank + 1], onward, remaining)
        forwarded = sum(len(t.raw) for t in onward.inputs)
        returned = sum(len(t.raw) for t in answer.outputs)
        return RunResponse(outputs=answer.outputs, peer_bytes=answer.peer_bytes + forwarded + returned)


class _PeerHops:
    """One collective's messages over the worker's peer links and mailbox (``ring.Hops``)."""

    def __init__(self, links: PeerLinks, mailbox: Mailbox, group: Group, key: BatchKey, step: int, name: str,
                 deadline: float) -> None:
        self._links, self._mailbox, self._group = links, mailbox, group
        self._key, self._step, self._name, self._deadline = key, step, name, deadline

    async def send(self, part: int, target: int, chunk: np.ndarray) -> None:
        group = self._group
        message = PeerMessage(group_id=group.id, epoch=group.epoch, batch_id=self._key[2], step=self._step, part=part,
                              source_rank=group.rank, target_rank=target)
        fill_message(message.tensor, self._name, chunk)
        await self._links.send(group.peers[target], message)

    async def receive(self, part: int, source: int) -> np.ndarray:
        remaining = self._deadline - asyncio.get_running_loop().time()
        return from_message(await self._mailbox.receive(self._key, self._step, part, source, self._group.rank, remaining))


async def _direct(boundary: Boundary, mine: np.ndarray, group: Group, hops: _PeerHops) -> tuple[np.ndarray, int]:
    """Send this rank's part to every other rank, take theirs, join all in rank order; the bytes sent."""
    others = [r for r in range(len(group.peers)) if r != group.rank]
    try:
        async with asyncio.TaskGroup() as tasks:
            for r in others:
                tasks.create_task(hops.send(0, r, mine))
            received = {r: tasks.create_task(hops.receive(0, r)) for r in others}
    except ExceptionGroup as failed:
        raise first_error(failed) from None
    parts = [mine if r == group.rank else received[r].result() for r in range(len(group.peers))]
    axis = boundary.axis if boundary.collective == ALLGATHER else None
    return combine(boundary.collective, parts, axis, tuple(boundary.pieces)), mine.nbytes * len(others)
