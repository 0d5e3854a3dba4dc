"""``infergate split``: split an ONNX model for tensor or pipeline parallelism.

    infergate split MODEL.onnx (--tensor-parallel N | --pipeline-parallel M) -o DIR [--verify]
        [--input-shape NAME=D0,D1,...]... [--input-values NAME=FILE.npy]...

Writes DIR as a Triton model repository, one model per shard
(``DIR/<shard>/config.pbtxt`` and ``DIR/<shard>/1/model.onnx``), plus
``DIR/plan.json``, the plan the gateway executes. ``--input-shape`` declares
an input's dims (a size, -1 or a name for a dynamic axis, ``name:320`` with a
typical size); ``--input-values`` feeds an input real values. For a model at
``<repo>/<name>/<version>/model.onnx`` the sizes in ``<repo>/<name>/config.pbtxt``
count as typical sizes. ``--verify`` runs the plan in-process against the
unsplit model on fresh inputs at several sizes and fails (exit 1) when the
largest absolute difference exceeds the tolerance or a shard's signature
refuses a size the unsplit model accepts. Exit 2: the model could not be
read or split.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import numpy as np
import onnx
from google.protobuf import text_format
from google.protobuf.message import DecodeError
from tritonclient.grpc import model_config_pb2

from splitter.graph import SplitError
from splitter.pipeline import split_pipeline_parallel
from splitter.plan import Collective, Plan
from splitter.shards import SplitResult, write_split
from splitter.sizes import InputHints, config_shapes, load_values, parse_shape_arg
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
    parser.add_argument("--input-shape", action="append", default=[], metavar="NAME=D0,D1,...",
                        help="an input's dims: a size, -1 or a name for a dynamic axis, name:SIZE for a typical size "
                             "(e.g. image=batch,3,48,width:320); repeatable")
    parser.add_argument("--input-values", action="append", default=[], metavar="NAME=FILE.npy",
                        help="real values for an input (a sample rate, token ids), tiled to each size tried; repeatable")


def default_name(path: Path) -> str:
    """``repo/<name>/<version>/model.onnx`` -> ``<name>``; otherwise the file's stem."""
    if path.stem == "model" and path.parent.name.isdigit() and path.parent.parent.name:
        return path.parent.parent.name
    return path.stem


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    name = args.name or default_name(args.model)
    try:
        hints = hints_from_args(args.input_shape, args.input_values)
        declared = config_shapes_near(args.model)
        model = onnx.load(str(args.model))
        if args.tensor_parallel is not None:
            result = split_tensor_parallel(model, args.tensor_parallel, name=name, strict=args.strict,
                                           hints=hints, declared=declared)
        else:
            result = split_pipeline_parallel(model, args.pipeline_parallel, name=name, hints=hints, declared=declared)
    except (OSError, DecodeError, SplitError, ValueError) as exc:
        print(f"infergate split: {exc}", file=sys.stderr)
        return 2
    plan_path = write_split(result, args.output)
    _print_plan(result.plan, plan_path)
    if not args.verify:
        return 0
    return _verify(model, result, args.tolerance, declared)


def hints_from_args(shapes: list[str], values: list[str]) -> InputHints:
    parsed_shapes = dict(parse_shape_arg(text) for text in shapes)
    arrays: dict[str, np.ndarray] = {}
    for text in values:
        input_name, sep, path = text.partition("=")
        if not sep or not input_name or not path:
            raise ValueError(f"--input-values {text!r}: expected NAME=FILE.npy")
        arrays[input_name] = load_values(input_name, Path(path))
    return InputHints(parsed_shapes, arrays)


def config_shapes_near(path: Path) -> dict[str, tuple[int, ...]]:
    """Input shapes from ``<repo>/<name>/config.pbtxt`` for a model at ``<repo>/<name>/<version>/model.onnx``."""
    config_path = path.parent.parent / "config.pbtxt"
    if not (path.parent.name.isdigit() and config_path.is_file()):
        return {}
    config = model_config_pb2.ModelConfig()
    try:
        text_format.Parse(config_path.read_text(encoding="utf-8"), config)
    except text_format.ParseError as exc:
        log.warning("ignoring unreadable %s: %s", config_path, exc)
        return {}
    return config_shapes(config)


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


def _verify(model: onnx.ModelProto, result: SplitResult, tolerance: float, declared: dict[str, tuple[int, ...]]) -> int:
    report = verify_split(model, result, declared=declared)
    verdict = "OK" if report.ok(tolerance) else "FAILED"
    if report.probe_sizes:
        probed = "; ".join(", ".join(f"{k}={v}" for k, v in sizes.items()) or "static" for sizes in report.probe_sizes)
        print(f"probed at: {probed}")
    for run in report.runs:
        shapes = ", ".join(f"{k}{list(v)}" for k, v in run.input_shapes.items())
        print(f"verify on {shapes}: max abs error {run.max_abs_error:.3g}")
    for error in report.signature_errors:
        print(f"  signature: {error}")
    print(f"verify: {len(report.runs)} sizes, max abs error {report.max_abs_error:.3g} (tolerance {tolerance:g}): {verdict}")
    if result.plan.kind == "tensor":
        shares = ", ".join(f"rank {r} {s:.1%}" for r, s in enumerate(report.rank_shares))
    else:
        shares = ", ".join(f"{shard} {s:.1%}" for shard, s in report.shard_shares.items())
    print(f"  weight bytes held: {shares}")
    return 0 if report.ok(tolerance) else 1
