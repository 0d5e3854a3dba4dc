"""Peer groups: the gateway's side of worker-to-worker collectives
(``protos/collective.proto``).

Every placed copy (replica group) of a tensor-parallel or pipeline-parallel
logical model becomes one collective group on its workers: the gateway
sends each member ``SetupGroup`` with the group id, an epoch, the member's
rank, every member's address and the member's steps (``steps_by_slot``: the
plan's segments for that rank, or the stage with the tensors it hands on).
A group is rebuilt -- a new epoch on every member, the old one torn down --
whenever its members change (re-placement), and whenever a batch on it
failed by a server's fault (a member restarted and lost its groups, a member
died). Until it is rebuilt the group serves nothing.

Group ids carry this gateway's instance id, so several gateways in front of
one fleet each keep their own groups and never replace each other's.

Steps: a tensor-parallel rank runs every segment's shard for its rank, with
the segment's boundaries; a pipeline stage runs its one shard and forwards
the tensors later stages read (and model outputs produced early).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid

from gateway.fleet.cluster import Cluster, WorkerStatus
from gateway.parallel.served import PeerGroup, ServedModel
from gateway.replicas.replica import group_member
from protos.collective_pb2 import Boundary, SetupGroupRequest, Step, TeardownGroupRequest
from splitter.plan import Boundary as PlanBoundary
from splitter.plan import Collective, Plan

log = logging.getLogger(__name__)

SETUP_TIMEOUT_S = 10.0
COLLECTIVES = ("peer", "gateway")


def peer_kind(plan: Plan) -> str | None:
    """"tensor" or "pipeline" when the plan can run as peer groups, else None (hybrids use the star)."""
    if plan.tensor_parallel > 1 and plan.pipeline_parallel == 1:
        return "tensor"
    if plan.pipeline_parallel > 1 and plan.tensor_parallel == 1:
        return "pipeline"
    return None


def steps_by_slot(plan: Plan) -> tuple[tuple[Step, ...], ...]:
    """Each slot's steps: per rank (tensor parallel) or per stage (pipeline)."""
    kind = peer_kind(plan)
    if kind == "tensor":
        return tuple(
            tuple(Step(shard=seg.shards[rank].name, inputs=[s.name for s in seg.shards[rank].inputs],
                       outputs=[s.name for s in seg.shards[rank].outputs],
                       boundaries=[_boundary(b) for b in seg.boundaries]) for seg in plan.segments)
            for rank in range(plan.tensor_parallel))
    if kind == "pipeline":
        available = {t.name for t in plan.inputs}
        outputs = {t.name for t in plan.outputs}
        steps = []
        for index, segment in enumerate(plan.segments):
            (shard,) = segment.shards
            available |= {s.name for s in shard.outputs}
            later = {s.name for seg in plan.segments[index + 1:] for sh in seg.shards for s in sh.inputs}
            forward = sorted((later | outputs) & available)
            steps.append((Step(shard=shard.name, inputs=[s.name for s in shard.inputs],
                               outputs=[s.name for s in shard.outputs], forward=forward),))
        return tuple(steps)
    return ()


def _boundary(b: PlanBoundary) -> Boundary:
    if b.per_rank or b.collective is Collective.NONE:
        return Boundary(name=b.name, collective=Collective.NONE.value)
    return Boundary(name=b.name, collective=b.collective.value, axis=b.axis or 0, pieces=list(b.pieces))


class GroupKeeper:
    """Sets up, rebuilds and tears down the peer groups of every logical model."""

    def __init__(self, cluster: Cluster) -> None:
        self._cluster = cluster
        self._instance = uuid.uuid4().hex[:8]
        self._epochs = itertools.count(1)

    def enabled(self, served: ServedModel) -> bool:
        return served.spec.collectives == "peer" and bool(served.slot_steps)

    def pick(self, served: ServedModel) -> PeerGroup | None:
        """The ready group with the fewest batches in flight."""
        ready = [g for g in served.groups.values() if g.ready]
        return min(ready, key=lambda g: (g.inflight, g.replica)) if ready else None

    def broken(self, served: ServedModel, group: PeerGroup) -> None:
        if group.ready:
            log.warning("logical model %s: group %s epoch %d failed a batch; it will be rebuilt",
                        served.spec.name, group.id, group.epoch)
        group.ready = False

    async def sync(self, served: ServedModel) -> None:
        """Build every copy's group that is placed on live workers and not ready yet."""
        if not self.enabled(served):
            return
        async with served.group_lock:
            for replica in range(served.spec.replicas):
                members = self._members(served, replica)
                current = served.groups.get(replica)
                if members is None or (current is not None and current.ready and current.members == members):
                    continue
                fresh = PeerGroup(f"{served.spec.name}/{replica}/{self._instance}", replica, next(self._epochs), members)
                if await self._setup(served, fresh):
                    served.groups[replica] = fresh
                    if current is not None:
                        await self._teardown(current, skip=set())
                    log.info("logical model %s: group %s epoch %d ready on %s", served.spec.name, fresh.id,
                             fresh.epoch, ", ".join(members))

    async def teardown_all(self, served: ServedModel) -> None:
        async with served.group_lock:
            groups, served.groups = list(served.groups.values()), {}
            await asyncio.gather(*(self._teardown(g, skip=set()) for g in groups))

    def _members(self, served: ServedModel, replica: int) -> tuple[str, ...] | None:
        members = []
        for slot, shards in enumerate(served.layout.slots):
            address = served.placement.get((replica, slot))
            worker = self._cluster.worker(address) if address is not None else None
            if worker is None or worker.state is not WorkerStatus.READY or worker.kind != "infergate":
                return None
            if any(shard not in worker.models for shard in shards):
                return None  # not pushed yet: the next reconcile tries again
            members.append(worker.address)
        return tuple(members)

    async def _setup(self, served: ServedModel, group: PeerGroup) -> bool:
        kind = peer_kind(served.layout.plan)
        assert kind is not None

        async def one(rank: int, address: str) -> None:
            worker = self._cluster.worker(address)
            assert worker is not None
            request = SetupGroupRequest(group_id=group.id, epoch=group.epoch, rank=rank, peers=list(group.members),
                                        kind=kind, steps=list(served.slot_steps[rank]))
            await group_member(worker.client).setup_group(request, timeout_s=SETUP_TIMEOUT_S)

        results = await asyncio.gather(*(one(r, a) for r, a in enumerate(group.members)), return_exceptions=True)
        failed = [(a, r) for a, r in zip(group.members, results) if isinstance(r, BaseException)]
        for address, error in failed:
            if isinstance(error, asyncio.CancelledError):
                raise error
            log.warning("logical model %s: setting up group %s on %s failed: %s", served.spec.name, group.id,
                        address, error)
        if failed:
            await self._teardown(group, skip={a for a, _ in failed})
        return not failed

    async def _teardown(self, group: PeerGroup, skip: set[str]) -> None:
        """Best effort: a member that is gone has lost the group anyway."""
        async def one(address: str) -> None:
            worker = self._cluster.worker(address)
            if worker is None or worker.state is not WorkerStatus.READY:
                return
            try:
                await group_member(worker.client).teardown_group(TeardownGroupRequest(group_id=group.id, epoch=group.epoch),
                                                   timeout_s=SETUP_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - tearing down is best effort by design
                log.info("tearing down group %s on %s: %s", group.id, address, e)

        await asyncio.gather(*(one(a) for a in dict.fromkeys(group.members) if a not in skip))
