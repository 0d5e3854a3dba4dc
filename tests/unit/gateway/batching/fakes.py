"""Fakes for the Batcher tests: a fake clock, a fake backend and a rig that ties them to a Batcher.

Everything runs on one event loop with a fake clock and a fake backend (the
router's Capacity and the executor's dispatch in one): no sockets, no
wall-clock windows. ``settle()`` lets the loop run until the batcher has
reacted; time only moves when a test calls ``clock.advance``. The ``rig``
fixture that builds a :class:`Rig` lives in this folder's ``conftest.py``.
"""

from __future__ import annotations

import asyncio
import heapq
from dataclasses import dataclass, field
from typing import Any

from gateway.batching.batcher import Batcher, BatchPolicy
from gateway.types import InferRequest, InferResponse, RequestedOutput, Tensor


async def settle() -> None:
    for _ in range(100):
        await asyncio.sleep(0)


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._n = 0

    def now(self) -> float:
        return self.t

    async def sleep(self, s: float) -> None:
        if s <= 0:
            await asyncio.sleep(0)
            return
        fut = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self.t + s, self._n, fut))
        self._n += 1
        await fut

    def pending_sleepers(self) -> int:
        return sum(not f.done() for _, _, f in self._sleepers)

    async def advance(self, s: float) -> None:
        target = self.t + s
        await settle()
        while self._sleepers and self._sleepers[0][0] <= target:
            when, _, fut = heapq.heappop(self._sleepers)
            self.t = max(self.t, when)
            if not fut.done():
                fut.set_result(None)
            await settle()
        self.t = target
        await settle()


@dataclass
class Call:
    requests: list[InferRequest]
    result: asyncio.Future[list[InferResponse]]

    @property
    def ids(self) -> list[str]:
        return [r.id for r in self.requests]


@dataclass
class FakeBackend:
    """Capacity and dispatch together: each running batch holds one of `slots` until completed."""

    slots: int = 1
    busy: int = 0
    calls: list[Call] = field(default_factory=list)
    over_capacity: int = 0  # dispatches made while every slot was taken: must stay 0
    _waiters: list[asyncio.Future[None]] = field(default_factory=list)

    def has_capacity(self) -> bool:
        return self.busy < self.slots

    async def wait(self) -> None:
        if self.has_capacity():
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        finally:
            if fut in self._waiters:
                self._waiters.remove(fut)

    def _can_take(self) -> bool:
        return self.has_capacity()

    async def dispatch(self, requests: list[InferRequest]) -> list[InferResponse]:
        if not self._can_take():
            self.over_capacity += 1
        self.busy += 1  # taken before the first suspension, as the router does
        call = Call(list(requests), asyncio.get_running_loop().create_future())
        self.calls.append(call)
        try:
            return await call.result
        finally:
            self.busy -= 1
            for w in self._waiters:
                if not w.done():
                    w.set_result(None)

    def complete(
        self, i: int, error: BaseException | None = None, responses: list[InferResponse] | None = None
    ) -> None:
        call = self.calls[i]
        if error is not None:
            call.result.set_exception(error)
        else:
            call.result.set_result(responses if responses is not None else [echo(r) for r in call.requests])

    def batches(self) -> list[list[str]]:
        return [c.ids for c in self.calls]


@dataclass
class ReplicaBackend(FakeBackend):
    """A backend that, like the router, is idle below `slots` batches and has `room` more while busy."""

    room: int = 1

    def has_room(self) -> bool:
        return self.busy < self.slots + self.room

    def _can_take(self) -> bool:
        return self.has_room()


def echo(req: InferRequest) -> InferResponse:
    return InferResponse(model=req.model, version=req.version, id=req.id, outputs=[])


def make_req(
    rid: str,
    rows: int = 1,
    tail: tuple[int, ...] = (4,),
    dtype: str = "FP32",
    outputs: tuple[str, ...] = (),
    **kw: Any,
) -> InferRequest:
    return InferRequest(
        model="m",
        version="",
        id=rid,
        inputs=[Tensor("x", dtype, (rows, *tail), b"")],
        outputs=[RequestedOutput(o) for o in outputs],
        **kw,
    )


class Rig:
    def __init__(self, slots: int, policy: BatchPolicy, room: int | None = None) -> None:
        self.clock = FakeClock()
        self.backend = FakeBackend(slots) if room is None else ReplicaBackend(slots, room=room)
        self.batcher = Batcher("m", policy, self.backend.dispatch, self.backend, clock=self.clock)
        self.tasks: dict[str, asyncio.Task[InferResponse]] = {}

    def submit(self, rid: str, **kw: Any) -> asyncio.Task[InferResponse]:
        task = asyncio.create_task(self.batcher.submit(make_req(rid, **kw)))
        self.tasks[rid] = task
        return task

    async def submit_all(self, *rids: str, **kw: Any) -> None:
        """Submit one after another, letting the batcher react to each."""
        for rid in rids:
            self.submit(rid, **kw)
            await settle()

    def batches(self) -> list[list[str]]:
        return self.backend.batches()

    def done(self) -> set[str]:
        return {rid for rid, t in self.tasks.items() if t.done()}

    def error_of(self, rid: str) -> BaseException | None:
        task = self.tasks[rid]
        assert task.done() and not task.cancelled()
        return task.exception()
