"""``infergate split``: split an ONNX model for tensor or pipeline parallelism.

    infergate split MODEL.onnx (--tensor-parallel N | --pipeline-parallel M) -o DIR [--verify]

Writes DIR as a Triton model repository, one model per shard
(``DIR/<shard>/config.pbtxt`` and ``DIR/<shard>/1/model.onnx``), plus
``DIR/plan.json``, the plan the gateway executes. ``--verify`` runs the plan
in-process against the unsplit model on fresh random inputs and fails (exit
1) when the largest absolute difference exceeds the tolerance. Exit 2: the
model could not be read or split.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError

from splitter.graph import SplitError
from splitter.pipeline import split_pipeline_parallel
from splitter.plan import Collective, Plan
from splitter.shards import SplitResult, write_split
from splitter.tensor import split_tensor_parallel
from splitter.verify import DEFAULT_TOLERANCE, verify_split

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", type=Path, help="the ONNX model file to split")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--tensor-parallel", "--tp", type=int, metavar="N", help="split every layer across N ranks")
    mode.add_argument("--pipeline-parallel", "--pp", type=int, metavar="M", help="cut into M sequential stages")
    parser.add_argument("-o", "--output", type=Path, required=True, help="directory for the shards and plan.json")
    parser.add_argument("--name", help="model name the shards are named after (default: from the path)")
    parser.add_argument("--verify", action="store_true", help="check the split against the unsplit model")
    parser.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE, help="largest absolute error --verify accepts")
    parser.add_argument("--strict", action="store_true", help="tensor parallel: fail on anything that would run replicated")


def default_name(path: Path) -> str:
    """``repo/<name>/<version>/model.onnx`` -> ``<name>``; otherwise the file's stem."""
    if path.stem == "model" and path.parent.name.isdigit() and path.parent.parent.name:
        return path.parent.parent.name
    return path.stem


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    name = args.name or default_name(args.model)
    try:
        model = onnx.load(str(args.model))
        if args.tensor_parallel is not None:
            result = split_tensor_parallel(model, args.tensor_parallel, name=name, strict=args.strict)
        else:
            result = split_pipeline_parallel(model, args.pipeline_parallel, name=name)
    except (OSError, DecodeError, SplitError) as exc:
        print(f"infergate split: {exc}", file=sys.stderr)
        return 2
    plan_path = write_split(result, args.output)
    _print_plan(result.plan, plan_path)
    if not args.verify:
        return 0
    return _verify(model, result, args.tolerance)


def _print_plan(plan: Plan, plan_path: Path) -> None:
    degree = f"N={plan.tensor_parallel}" if plan.kind == "tensor" else f"M={plan.pipeline_parallel}"
    print(f"{plan.model}: {plan.kind} parallel {degree}, {len(plan.segments)} segments, {len(plan.shards())} shards -> {plan_path}")
    shares = plan.weight_shares()
    for segment in plan.segments:
        shards = ", ".join(f"{s.name} ({shares[s.name]:.1%} of weights)" for s in segment.shards)
        print(f"  segment {segment.index}: {shards}")
        joins = [b for b in segment.boundaries if b.collective is not Collective.NONE]
        for b in joins:
            extra = f" axis {b.axis}" if b.collective is Collective.ALLGATHER else ""
            print(f"    then {b.collective.value}{extra}: {b.name}")
    for fallback in plan.fallbacks:
        print(f"  fallback: node {fallback.node!r} ({fallback.op_type}): {fallback.reason}")


def _verify(model: onnx.ModelProto, result: SplitResult, tolerance: float) -> int:
    report = verify_split(model, result)
    shapes = ", ".join(f"{k}{list(v)}" for k, v in report.input_shapes.items())
    verdict = "OK" if report.ok(tolerance) else "FAILED"
    print(f"verify on {shapes}: max abs error {report.max_abs_error:.3g} (tolerance {tolerance:g}): {verdict}")
    if result.plan.kind == "tensor":
        shares = ", ".join(f"rank {r} {s:.1%}" for r, s in enumerate(report.rank_shares))
    else:
        shares = ", ".join(f"{shard} {s:.1%}" for shard, s in report.shard_shares.items())
    print(f"  weight bytes held: {shares}")
    return 0 if report.ok(tolerance) else 1
