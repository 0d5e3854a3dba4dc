"""Running a split plan: segments in order, each segment's ranks at once,
collectives between segments (the gateway-driven star: partials come back,
are summed or concatenated here, and go out with the next segment).

Running one shard is injected (:class:`ShardRunner`): :class:`LocalShards`
runs ONNX Runtime sessions in this process; the gateway plugs in a remote
call to the worker that hosts the shard. Values are numpy arrays because the
collectives do arithmetic on them.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import Awaitable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import numpy as np
import onnx
import onnxruntime as ort

from protos.errors import InferGateError
from protos.collective_tensors import combine
from splitter.plan import Boundary, Collective, Plan, Shard
from splitter.probe import cpu_session

log = logging.getLogger(__name__)


class ShardRunner(Protocol):
    """Runs one shard on named inputs and returns all of its outputs by name."""

    def __call__(self, shard: Shard, inputs: dict[str, np.ndarray]) -> Awaitable[dict[str, np.ndarray]]: ...


class PlanExecutor:
    """Executes a :class:`Plan` for one request at a time per ``run`` call
    (calls may overlap: each keeps its own stores)."""

    def __init__(self, plan: Plan, run_shard: ShardRunner) -> None:
        self.plan = plan
        self._run_shard = run_shard
        # Last segment reading each name, so stores drop tensors no one needs
        # any more (a long model would otherwise hold every activation).
        self._last_read: dict[str, int] = {}
        for segment in plan.segments:
            for shard in segment.shards:
                for spec in shard.inputs:
                    self._last_read[spec.name] = segment.index
            for boundary in segment.boundaries:
                self._last_read[boundary.name] = segment.index

    async def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        shared: dict[str, np.ndarray] = dict(inputs)
        local: list[dict[str, np.ndarray]] = [{} for _ in range(self.plan.ranks)]
        keep = {spec.name for spec in self.plan.outputs}
        for segment in self.plan.segments:
            calls = []
            for shard in segment.shards:
                store = local[shard.rank]
                try:
                    feeds = {s.name: store[s.name] if s.name in store else shared[s.name] for s in shard.inputs}
                except KeyError as exc:
                    raise ValueError(f"plan {self.plan.model!r}: shard {shard.name!r} input {exc} is not available") from exc
                calls.append(self._run_shard(shard, feeds))
            results = await _all(calls, [shard.rank for shard in segment.shards])
            for shard, outputs in zip(segment.shards, results):
                local[shard.rank].update(outputs)
            for boundary in segment.boundaries:
                _join(boundary, local, shared, [s.rank for s in segment.shards])
            for store in [shared, *local]:
                for name in [x for x in store if self._last_read.get(x, -1) <= segment.index and x not in keep]:
                    del store[name]
        missing = [spec.name for spec in self.plan.outputs if spec.name not in shared]
        if missing:
            raise ValueError(f"plan {self.plan.model!r} did not produce outputs {missing}")
        return {spec.name: shared[spec.name] for spec in self.plan.outputs}


async def _all(calls: list[Awaitable[dict[str, np.ndarray]]], ranks: list[int]) -> list[dict[str, np.ndarray]]:
    """Await every rank; on the first failure cancel the others (every task
    is owned here and finished before returning or raising).

    Every rank that failed is heard, not only the first: ranks failing
    together (a request no rank can run, or several workers lost) raise one
    error that names each rank's cause, and no task's exception is left
    unretrieved.
    """
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    if pending:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    # Ranks that failed by themselves, in rank order: not the CancelledError of
    # a rank cancelled because of them. exception() marks each one retrieved.
    failed = [(rank, task.exception()) for rank, task in zip(ranks, tasks)
              if task in done and not task.cancelled() and task.exception() is not None]
    if failed:
        raise _combined(failed)
    return [task.result() for task in tasks]


def _combined(failed: list[tuple[int, BaseException | None]]) -> BaseException:
    """The first rank's error, its message naming every other rank's different cause."""
    (first_rank, first), others = failed[0], failed[1:]
    assert first is not None
    for rank, error in others:
        log.info("rank %d failed too: %r", rank, error)
    causes = [f"rank {rank}: {error}" for rank, error in others if str(error) != str(first)]
    if not causes:
        return first
    if isinstance(first, InferGateError):
        combined = copy.copy(first)  # same class, so the same status goes back
        combined.message = f"rank {first_rank}: {first.message}; " + "; ".join(causes)
        combined.args = (combined.message,)
        return combined
    first.add_note("; ".join(causes))
    return first


def _join(boundary: Boundary, local: list[dict[str, np.ndarray]], shared: dict[str, np.ndarray], ranks: list[int]) -> None:
    name = boundary.name
    if boundary.collective is Collective.NONE:
        if not boundary.per_rank:
            shared[name] = local[ranks[0]][name]
            for rank in ranks:
                local[rank].pop(name, None)
        return
    parts = [local[rank].pop(name) for rank in range(len(local))]
    shared[name] = combine(boundary.collective.value, parts, boundary.axis, boundary.pieces)


class LocalShards:
    """A :class:`ShardRunner` over in-process ONNX Runtime sessions, run on a
    bounded thread pool so the event loop never blocks (ORT releases the GIL)."""

    def __init__(self, sessions: Mapping[str, ort.InferenceSession], threads: int = 2) -> None:
        self._sessions = dict(sessions)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="shard")

    @classmethod
    def from_models(cls, models: Mapping[str, onnx.ModelProto], threads: int = 2) -> LocalShards:
        return cls({name: cpu_session(model) for name, model in models.items()}, threads)

    async def __call__(self, shard: Shard, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        session = self._sessions[shard.name]
        names = [spec.name for spec in shard.outputs]
        loop = asyncio.get_running_loop()
        values = await loop.run_in_executor(self._pool, session.run, names, inputs)
        return dict(zip(names, values))

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def run_plan(plan: Plan, models: Mapping[str, onnx.ModelProto], inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Synchronous convenience: run ``plan`` once in-process on ``models``."""
    runner = LocalShards.from_models(models)
    try:
        return asyncio.run(PlanExecutor(plan, runner).run(inputs))
    finally:
        runner.close()
