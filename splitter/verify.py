"""Checking a split against the unsplit model: run both in-process with ONNX
Runtime on fresh random inputs whose dynamic sizes differ from those the
splitter probed with, and report the largest absolute difference and how the
weight bytes were shared out.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

from splitter.execute import run_plan
from splitter.graph import GraphView
from splitter.probe import VERIFY_SIZES, cpu_session, index_bounds, make_inputs
from splitter.shards import SplitResult

DEFAULT_TOLERANCE = 1e-4


@dataclass(frozen=True, slots=True)
class VerifyReport:
    max_abs_error: float
    per_output: dict[str, float]
    input_shapes: dict[str, tuple[int, ...]]
    shard_shares: dict[str, float]  # shard -> its weight bytes / the unsplit model's
    rank_shares: list[float]  # tensor parallel: per rank, all segments together

    def ok(self, tolerance: float = DEFAULT_TOLERANCE) -> bool:
        return self.max_abs_error <= tolerance


def verify_split(
    model: onnx.ModelProto, result: SplitResult, *, seed: int = 1, sizes: tuple[int, ...] = VERIFY_SIZES
) -> VerifyReport:
    rng = np.random.default_rng(seed)
    inputs = make_inputs(model, sizes, rng, index_bounds(GraphView(model)))
    session = cpu_session(model)
    names = [o.name for o in session.get_outputs()]
    expected = dict(zip(names, session.run(names, inputs)))
    actual = run_plan(result.plan, result.models, inputs)
    per_output: dict[str, float] = {}
    for name, want in expected.items():
        got = actual[name]
        if got.shape != want.shape:
            per_output[name] = float("inf")
        elif want.dtype.kind in "fc":
            per_output[name] = float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64)), initial=0.0))
        else:
            per_output[name] = 0.0 if np.array_equal(got, want) else float("inf")
    return VerifyReport(
        max_abs_error=max(per_output.values(), default=0.0),
        per_output=per_output,
        input_shapes={k: tuple(v.shape) for k, v in inputs.items()},
        shard_shares=result.plan.weight_shares(),
        rank_shares=result.plan.rank_shares(),
    )
