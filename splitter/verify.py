"""Checking a split against the unsplit model: run both in-process with ONNX
Runtime on fresh random inputs at several sizes per dynamic dimension
(the verification sizes of the size plan the split was probed with, which
the probe did not use, plus the typical sizes given or declared), and
report the largest absolute difference, the sizes used, and how the weight
bytes were shared out.

Every shard call is checked against the shard's declared signature (the
plan's tensor specs, which are its ``config.pbtxt``): a size the unsplit
model accepts but a shard would refuse fails the verification, naming the
shard and the tensor.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx

from splitter.execute import LocalShards, PlanExecutor
from splitter.graph import GraphView
from splitter.plan import Shard, TensorSpec
from splitter.probe import cpu_session, model_inputs
from splitter.shards import SplitResult
from splitter.sizes import InputHints, SizePlan

DEFAULT_TOLERANCE = 1e-4


@dataclass(frozen=True, slots=True)
class VerifyRun:
    input_shapes: dict[str, tuple[int, ...]]
    max_abs_error: float


@dataclass(frozen=True, slots=True)
class VerifyReport:
    max_abs_error: float
    per_output: dict[str, float]
    input_shapes: dict[str, tuple[int, ...]]  # of the first run
    shard_shares: dict[str, float]  # shard -> its weight bytes / the unsplit model's
    rank_shares: list[float]  # tensor parallel: per rank, all segments together
    runs: list[VerifyRun] = field(default_factory=list)
    signature_errors: list[str] = field(default_factory=list)
    probe_sizes: tuple[dict[str, int], ...] = ()  # symbol sizes the splitter probed with

    def ok(self, tolerance: float = DEFAULT_TOLERANCE) -> bool:
        return not self.signature_errors and self.max_abs_error <= tolerance


class SignatureError(RuntimeError):
    """A shard was given, or produced, a tensor its declared signature refuses."""


def _refuses(spec: TensorSpec, array: np.ndarray) -> bool:
    return len(spec.shape) != array.ndim or any(d >= 0 and d != s for d, s in zip(spec.shape, array.shape))


class _CheckedShards:
    """Runs shards in-process, checking each call against the shard's specs."""

    def __init__(self, runner: LocalShards) -> None:
        self._runner = runner

    async def __call__(self, shard: Shard, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        for spec in shard.inputs:
            if _refuses(spec, inputs[spec.name]):
                raise SignatureError(f"shard {shard.name!r} declares input {spec.name!r} as {list(spec.shape)}, "
                                     f"got {list(inputs[spec.name].shape)}")
        try:
            outputs = await self._runner(shard, inputs)
        except Exception as exc:  # ORT refusing the shard's ONNX signature, or failing in it
            raise SignatureError(f"shard {shard.name!r} failed: {str(exc).strip()}") from exc
        for spec in shard.outputs:
            if _refuses(spec, outputs[spec.name]):
                raise SignatureError(f"shard {shard.name!r} declares output {spec.name!r} as {list(spec.shape)}, "
                                     f"produced {list(outputs[spec.name].shape)}")
        return outputs


def _error(want: np.ndarray, got: np.ndarray | None) -> float:
    if got is None or got.shape != want.shape:
        return float("inf")
    if want.dtype.kind in "fc":
        return float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64)), initial=0.0))
    return 0.0 if np.array_equal(got, want) else float("inf")


def verify_split(
    model: onnx.ModelProto,
    result: SplitResult,
    *,
    hints: InputHints | None = None,
    declared: Mapping[str, tuple[int, ...]] | None = None,
    seed: int = 1,
    sizes: list[dict[str, int]] | None = None,
) -> VerifyReport:
    """Compare the split with ``model`` at several sizes (``sizes``: symbol
    sizes per run; default: the verification runs of the split's size plan)."""
    inputs = model_inputs(GraphView(model), hints or result.hints, declared)
    session = cpu_session(model)
    names = [o.name for o in session.get_outputs()]
    plan = result.sizes or _plan_that_runs(session, names, inputs.plans, inputs)
    runs_sizes = sizes if sizes is not None else _distinct(plan.verify if plan else ())
    rng = np.random.default_rng(seed)
    per_output: dict[str, float] = {}
    runs: list[VerifyRun] = []
    signature_errors: list[str] = []
    runner = LocalShards.from_models(result.models)
    try:
        for symbol_sizes in runs_sizes:
            feeds = inputs.make(symbol_sizes, rng)
            expected = dict(zip(names, session.run(names, feeds)))
            try:
                actual: dict[str, np.ndarray] = asyncio.run(PlanExecutor(result.plan, _CheckedShards(runner)).run(feeds))
            except SignatureError as exc:
                signature_errors.append(str(exc))
                actual = {}
            errors = {name: _error(want, actual.get(name)) for name, want in expected.items()}
            for name, err in errors.items():
                per_output[name] = max(per_output.get(name, 0.0), err)
            runs.append(VerifyRun({k: tuple(v.shape) for k, v in feeds.items()}, max(errors.values(), default=0.0)))
    finally:
        runner.close()
    return VerifyReport(
        max_abs_error=max(per_output.values(), default=0.0),
        per_output=per_output,
        input_shapes=runs[0].input_shapes if runs else {},
        shard_shares=result.plan.weight_shares(),
        rank_shares=result.plan.rank_shares(),
        runs=runs,
        signature_errors=signature_errors,
        probe_sizes=plan.probe if plan else (),
    )


def _distinct(runs: tuple[dict[str, int], ...]) -> list[dict[str, int]]:
    out: list[dict[str, int]] = []
    for run in runs:
        if run not in out:
            out.append(run)
    return out or [{}]


def _plan_that_runs(session, names: list[str], plans: list[SizePlan], inputs) -> SizePlan | None:  # noqa: ANN001
    """For a split loaded from disk: the first size plan the unsplit model runs at."""
    for plan in plans:
        try:
            for sizes in plan.probe:
                session.run(names, inputs.make(sizes, np.random.default_rng(0)))
        except Exception:  # noqa: BLE001 - try the next plan
            continue
        return plan
    return plans[-1] if plans else None
