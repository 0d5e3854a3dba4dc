"""Per-operator tensor-parallel rules for elementwise and data-movement
operators: given a node and the states of its inputs, either place it (its
output states and the node each rank runs) or decline, in which case the
splitter makes inputs replicated first (all-reduce of partials, all-gather of
shards) and asks again. Weights are handled in
:mod:`splitter.tensor_weights`, reshapes in
:mod:`splitter.tensor_shapes`.
"""

from __future__ import annotations

import numpy as np
import onnx

from splitter.layout import PARTIAL, REPLICATED, State, sharded
from splitter.probe import Probe
from splitter.tensor_context import Context, Emit, attr, axes_of, static_extent

UNARY = {
    "Relu", "Gelu", "Erf", "Tanh", "Sigmoid", "Cast", "Sqrt", "Exp", "Log", "Abs", "Reciprocal", "Softplus",
    "Softsign", "LeakyRelu", "Elu", "Selu", "Celu", "HardSigmoid", "HardSwish", "Mish", "Floor", "Ceil",
    "Round", "Sign", "Sin", "Cos", "Not", "IsNaN", "IsInf", "Clip", "Dropout", "Identity", "Neg",
}  # fmt: skip
LINEAR_UNARY = {"Identity", "Neg", "Dropout"}
BROADCAST = {
    "Add", "Sub", "Mul", "Div", "Pow", "Where", "Max", "Min", "Equal", "Less", "Greater", "LessOrEqual",
    "GreaterOrEqual", "And", "Or", "Xor", "Mod",
}  # fmt: skip


def unary(ctx: Context, node: onnx.NodeProto, st: list[State]) -> Emit | None:
    if any(s.kind != "R" for s in st[1:]):
        return None
    if st[0].kind == "P" and node.op_type not in LINEAR_UNARY:
        return None
    if node.op_type == "Dropout" and len(node.output) > 1 and node.output[1] and st[0].kind == "P":
        return None
    return ctx.copy(node, [st[0]] * len(node.output))


def broadcast(ctx: Context, node: onnx.NodeProto, st: list[State]) -> Emit | None:
    kinds = {s.kind for s in st}
    if kinds == {"R"}:
        return ctx.copy(node, [REPLICATED])
    op = node.op_type
    if "P" in kinds:
        if "S" in kinds:
            return None
        partial = [s.kind == "P" for s in st]
        if op in ("Add", "Sub") and all(partial):
            return ctx.copy(node, [PARTIAL])
        if op == "Mul" and sum(partial) == 1:
            return ctx.copy(node, [PARTIAL])
        if op == "Div" and partial == [True, False]:
            return ctx.copy(node, [PARTIAL])
        return None
    out = node.output[0]
    out_rank = ctx.rank(out)
    layouts = {(s.axis + out_rank - ctx.rank(node.input[i]), s.pieces) for i, s in enumerate(st) if s.kind == "S"}
    if len(layouts) != 1:
        return None
    axis, pieces = layouts.pop()
    replace: dict[int, str] = {}
    inits: list[list[onnx.TensorProto]] = []
    for i, s in enumerate(st):
        if s.kind != "R":
            continue
        local_axis = axis - (out_rank - ctx.rank(node.input[i]))
        if local_axis < 0 or static_extent(ctx, node.input[i], local_axis) == 1:
            continue  # broadcast along the sharded axis: same operand on every rank
        if ctx.const(node.input[i]) is None:
            return None  # a full-size activation would need slicing at run time
        replace[i], parts = ctx.sliced(node.input[i], local_axis, pieces)
        inits.append(parts)
    nodes, per_rank = ctx.with_inputs(node, replace, inits)
    return Emit([sharded(axis, pieces)], nodes, per_rank)


def transpose(ctx: Context, node: onnx.NodeProto, st: list[State]) -> Emit | None:
    s = st[0]
    if s.kind != "S":
        return ctx.copy(node, [s])
    perm = list(attr(node, "perm", list(reversed(range(ctx.rank(node.input[0]))))))  # type: ignore[arg-type]
    return ctx.copy(node, [sharded(perm.index(s.axis), s.pieces)])


def softmax(ctx: Context, node: onnx.NodeProto, st: list[State]) -> Emit | None:
    s = st[0]
    if s.kind != "S":
        return ctx.copy(node, [s]) if s.kind == "R" else None
    rank = ctx.rank(node.input[0])
    axis = int(attr(node, "axis", -1)) % rank  # type: ignore[arg-type]
    opset = next((o.version for o in ctx.view.model.opset_import if o.domain in ("", "ai.onnx")), 17)
    # before opset 13 softmax flattens [axis:] into one row
    ok = s.axis < axis if opset < 13 else s.axis != axis
    return ctx.copy(node, [s]) if ok else None


def layer_norm(ctx: Context, node: onnx.NodeProto, st: list[State]) -> Emit | None:
    s = st[0]
    if s.kind != "S" or any(x.kind != "R" for x in st[1:]):
        return None
    axis = int(attr(node, "axis", -1)) % ctx.rank(node.input[0])  # type: ignore[arg-type]
    return ctx.copy(node, [s] * len(node.output)) if s.axis < axis else None


def concat(ctx: Context, node: onnx.NodeProto, st: list[State]) -> Emit | None:
    if len(set(st)) != 1:
        return None
    s = st[0]
    if s.kind == "S" and s.axis == int(attr(node, "axis", 0)) % ctx.rank(node.output[0]):  # type: ignore[arg-type]
        return None
    return ctx.copy(node, [s])


def static_slice(probe: Probe, node: onnx.NodeProto) -> tuple[int, int, int] | None:
    """``(axis, start, end)`` of a one-axis, step-1 Slice whose bounds were
    the same in both probe runs (torch's ``chunk`` computes them from shapes),
    normalised to ``0 <= start <= end <= dim``."""
    data = node.input[0]
    got = []
    for position in (1, 2, 3, 4):
        if len(node.input) <= position or not node.input[position]:
            got.append(None)
            continue
        a, b = probe.values[0].get(node.input[position]), probe.values[1].get(node.input[position])
        if a is None or b is None or not np.array_equal(a, b):
            return None
        got.append([int(v) for v in np.asarray(a).reshape(-1)])
    starts, ends, axes, steps = got
    if starts is None or ends is None or len(starts) != 1 or (steps is not None and steps != [1]):
        return None
    rank = probe.rank(data)
    axis = (axes[0] if axes else 0) % rank
    dims = {probe.shape(data, run)[axis] for run in (0, 1)}
    if len(dims) != 1:
        return None
    dim = dims.pop()

    def clamp(v: int) -> int:
        return min(max(v + dim if v < 0 else v, 0), dim)

    return axis, clamp(starts[0]), clamp(ends[0])


def slice_(ctx: Context, node: onnx.NodeProto, st: list[State]) -> Emit | None:
    """Slices of other axes keep the shard; a slice that is exactly one piece
    of a fused layout (torch's ``chunk``) becomes that piece's shard."""
    s = st[0]
    if any(x.kind != "R" for x in st[1:]):
        return None
    if s.kind != "S":
        return ctx.copy(node, [s])
    rank = ctx.rank(node.input[0])
    axes = axes_of(ctx, node, rank)
    if axes is None and not (len(node.input) > 3 and node.input[3]):
        starts = ctx.values(node.input[1])
        axes = None if starts is None else list(range(starts[0].size))
    if axes is not None and s.axis not in axes:
        return ctx.copy(node, [s])
    bounds = static_slice(ctx.probe, node)
    if bounds is None or bounds[0] != s.axis or sum(s.pieces) != static_extent(ctx, node.input[0], s.axis):
        return None
    _, start, end = bounds
    offset = 0
    for piece in s.pieces:
        if (offset, offset + piece) == (start, end):
            break
        offset += piece
    else:
        return None
    clone = onnx.NodeProto()
    clone.CopyFrom(node)
    inits: dict[str, onnx.TensorProto] = {}
    for position, value in ((1, start // ctx.n), (2, end // ctx.n)):
        dtype = ctx.probe.dtypes[node.input[position]]
        const = ctx.constant(f"{node.input[position]}.tp{ctx.n}", np.array([value], dtype=dtype))
        clone.input[position] = const.name
        inits[const.name] = const
    return Emit([sharded(s.axis, (end - start,))], [[clone] for _ in range(ctx.n)], [dict(inits) for _ in range(ctx.n)])


def reduce(ctx: Context, node: onnx.NodeProto, st: list[State]) -> Emit | None:
    """Reductions over other axes keep the shard; a sum over the sharded
    axis (or of a partial) is a partial."""
    s = st[0]
    if any(x.kind != "R" for x in st[1:]):
        return None
    rank = ctx.rank(node.input[0])
    axes = axes_of(ctx, node, rank)
    if axes is None:
        if len(node.input) > 1 and node.input[1]:
            return None  # computed axes
        axes = [] if attr(node, "noop_with_empty_axes", 0) else list(range(rank))
    keep = bool(attr(node, "keepdims", 1))
    linear = node.op_type in ("ReduceSum", "ReduceMean")
    if s.kind == "P":
        return ctx.copy(node, [PARTIAL]) if linear else None
    if s.kind != "S":
        return ctx.copy(node, [s])
    if s.axis in axes:
        return ctx.copy(node, [PARTIAL]) if node.op_type == "ReduceSum" else None
    axis = s.axis if keep else s.axis - sum(1 for a in axes if a < s.axis)
    return ctx.copy(node, [sharded(axis, s.pieces)])
