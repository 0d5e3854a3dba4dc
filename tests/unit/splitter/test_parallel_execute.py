"""The plan executor with an injected shard runner: order, concurrency,
collectives, failure handling."""

from __future__ import annotations

import asyncio
import gc

import numpy as np
import pytest

from protos.errors import InvalidArgument, Unavailable
from splitter import LocalShards, PlanExecutor, Shard, split_tensor_parallel
from splitter.plan import Boundary, Collective, Plan, Segment, TensorSpec
from splitter.probe import cpu_session
from tests.fixtures import split_graphs


def spec(name: str, shape: tuple[int, ...] = (-1, 4)) -> TensorSpec:
    return TensorSpec(name, "FP32", shape)


def shard(name: str, rank: int, segment: int, ins: list[str], outs: list[str]) -> Shard:
    return Shard(name, rank, segment, tuple(spec(x) for x in ins), tuple(spec(x) for x in outs), 0, f"{name}/1/model.onnx")


def hand_plan() -> Plan:
    """Two ranks: segment 0 makes a partial, a shard and a replicated tensor;
    the partial is summed after segment 0, the shard stays per rank until it
    is gathered after segment 1 (in fused pieces), the replicated one is read
    again by segment 1."""
    seg0 = Segment(
        0,
        (shard("s0r0", 0, 0, ["x"], ["p", "s", "r"]), shard("s0r1", 1, 0, ["x"], ["p", "s", "r"])),
        (
            Boundary("p", Collective.ALLREDUCE_SUM),
            Boundary("s", Collective.NONE, per_rank=True),
            Boundary("r", Collective.NONE),
        ),
    )
    seg1 = Segment(
        1,
        (shard("s1r0", 0, 1, ["p", "s", "r"], ["y"]), shard("s1r1", 1, 1, ["p", "s", "r"], ["y"])),
        (Boundary("y", Collective.NONE), Boundary("s", Collective.ALLGATHER, axis=1, pieces=(2, 2))),
    )
    return Plan("hand", "tensor", 2, 1, (spec("x"),), (spec("y"), spec("s")), (seg0, seg1), 0)


class FakeRanks:
    """A fake remote: rank r's partial is x*(r+1); its shard is its block of each piece."""

    def __init__(self, fail: str | None = None) -> None:
        self.calls: list[tuple[str, dict[str, np.ndarray]]] = []
        self.fail = fail
        self.running = 0
        self.peak = 0
        self.cancelled: list[str] = []

    async def __call__(self, shard: Shard, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.calls.append((shard.name, inputs))
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            await asyncio.sleep(0)  # let the other rank start: both must be in flight together
            if shard.name == self.fail:
                raise ConnectionError("worker gone")
            if shard.name == "s1r1" and self.fail:
                await asyncio.sleep(3600)
            x = inputs.get("x")
            if shard.segment == 0:
                assert x is not None
                full = np.arange(8, dtype=np.float32).reshape(2, 4)  # pieces (2, 2) along axis 1
                local = full[:, [shard.rank, 2 + shard.rank]]
                return {"p": x * (shard.rank + 1), "s": local, "r": x + 1}
            return {"y": inputs["p"] + inputs["r"] + inputs["s"].sum()}
        except asyncio.CancelledError:
            self.cancelled.append(shard.name)
            raise
        finally:
            self.running -= 1


async def test_segments_run_in_order_ranks_together_and_collectives_join() -> None:
    runner = FakeRanks()
    x = np.ones((2, 4), dtype=np.float32)
    out = await PlanExecutor(hand_plan(), runner).run({"x": x})
    assert [name for name, _ in runner.calls] == ["s0r0", "s0r1", "s1r0", "s1r1"]
    assert runner.peak == 2
    seg1 = dict(runner.calls[2:])
    np.testing.assert_array_equal(seg1["s1r0"]["p"], 3 * x)  # x*1 + x*2
    np.testing.assert_array_equal(seg1["s1r1"]["r"], x + 1)
    # each rank got back its own shard, not the other's
    np.testing.assert_array_equal(seg1["s1r0"]["s"], [[0, 2], [4, 6]])
    np.testing.assert_array_equal(seg1["s1r1"]["s"], [[1, 3], [5, 7]])
    np.testing.assert_array_equal(out["s"], np.arange(8).reshape(2, 4))
    np.testing.assert_array_equal(out["y"], 3 * x + x + 1 + 12)


async def test_a_failing_rank_cancels_the_others_and_raises() -> None:
    runner = FakeRanks(fail="s1r0")
    with pytest.raises(ConnectionError):
        await PlanExecutor(hand_plan(), runner).run({"x": np.ones((2, 4), dtype=np.float32)})
    assert runner.cancelled == ["s1r1"]
    assert runner.running == 0


async def test_missing_input_is_named() -> None:
    with pytest.raises(ValueError, match="input 'x'"):
        await PlanExecutor(hand_plan(), FakeRanks()).run({})


async def test_local_sessions_run_a_real_split_concurrently() -> None:
    model = split_graphs.mha_constant()
    result = split_tensor_parallel(model, 2, name="mha")
    x = np.random.default_rng(3).standard_normal((3, 10, 64)).astype(np.float32)
    runner = LocalShards.from_models(result.models)
    try:
        outs = await asyncio.gather(*(PlanExecutor(result.plan, runner).run({"x": x * k}) for k in (1.0, 2.0)))
    finally:
        runner.close()
    session = cpu_session(model)
    for k, out in zip((1.0, 2.0), outs):
        (want,) = session.run(["y"], {"x": x * k})
        assert np.max(np.abs(out["y"] - want)) < 1e-4


class FailingRanks(FakeRanks):
    """Every rank of segment 1 fails, each with its own error, at the same time."""

    def __init__(self, errors: dict[str, Exception]) -> None:
        super().__init__()
        self.errors = errors

    async def __call__(self, shard: Shard, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if shard.name in self.errors:
            raise self.errors[shard.name]
        return await super().__call__(shard, inputs)


async def test_every_failing_rank_is_heard(caplog: pytest.LogCaptureFixture) -> None:
    unhandled: list[dict[str, object]] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, context: unhandled.append(context))
    runner = FailingRanks({"s1r0": Unavailable("worker a lost"), "s1r1": Unavailable("worker b lost")})
    with pytest.raises(Unavailable) as info:
        await PlanExecutor(hand_plan(), runner).run({"x": np.ones((2, 4), dtype=np.float32)})
    assert str(info.value) == "rank 0: worker a lost; rank 1: worker b lost"
    same = FailingRanks({"s1r0": InvalidArgument("bad row"), "s1r1": InvalidArgument("bad row")})
    with pytest.raises(InvalidArgument, match="^bad row$"):
        await PlanExecutor(hand_plan(), same).run({"x": np.ones((2, 4), dtype=np.float32)})
    del info, runner, same
    gc.collect()  # an exception never retrieved is reported when its task is collected
    assert not unhandled, unhandled
