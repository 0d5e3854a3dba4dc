"""Tensor-parallel rules for shape arithmetic and layout changes: Shape and
Size of a shard (scaled back so all shape arithmetic downstream stays
exact), Reshape (the shard follows the head axis; the target is rewritten as
``(target * mask + frozen) / div``, which handles constant targets and
torch-style computed ones alike), Flatten, Squeeze and Unsqueeze.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from splitter.layout import REPLICATED, State, map_sharded_axis, sharded
from splitter.tensor_context import Context, Emit, attr, axes_of, static_extent


def shape(ctx: Context, node: onnx.NodeProto, st: list[State]) -> Emit | None:
    """Shape/Size of a shard would report local sizes: scale them back so
    every shape computation downstream stays exact (replicated)."""
    s = st[0]
    if s.kind != "S":
        return ctx.copy(node, [REPLICATED])
    out = node.output[0]
    if node.op_type == "Size":
        scale = np.array(ctx.n, dtype=np.int64)
    else:
        rank = ctx.rank(node.input[0])
        start = int(attr(node, "start", 0))  # type: ignore[arg-type]
        end = int(attr(node, "end", rank))  # type: ignore[arg-type]
        start = min(max(start + rank if start < 0 else start, 0), rank)
        end = min(max(end + rank if end < 0 else end, 0), rank)
        if not start <= s.axis < end:
            return ctx.copy(node, [REPLICATED])
        scale = np.ones(end - start, dtype=np.int64)
        scale[s.axis - start] = ctx.n
    local = ctx.fresh(f"{out}.local")
    clone = onnx.NodeProto()
    clone.CopyFrom(node)
    clone.output[0] = local
    factor = ctx.constant(f"{out}.scale", scale)
    mul = helper.make_node("Mul", [local, factor.name], [out], name=ctx.fresh(f"{node.name}.unshard"))
    return Emit([REPLICATED], [[clone, mul] for _ in range(ctx.n)], [{factor.name: factor} for _ in range(ctx.n)])


def reshape(ctx: Context, node: onnx.NodeProto, st: list[State]) -> Emit | None:
    s = st[0]
    if st[1].kind != "R":
        return None
    if s.kind != "S":
        return ctx.copy(node, [s])
    if len(s.pieces) != 1:
        return None
    x, target, out = node.input[0], node.input[1], node.output[0]
    mapped = map_sharded_axis(ctx.shapes(x), ctx.shapes(out), s.axis, s.pieces[0], ctx.n)
    values = ctx.values(target)
    if mapped is None or values is None:
        return None
    b, piece = mapped
    fix = _rewrite_target(ctx, node, values, s.axis, b)
    if fix is None:
        return None
    nodes, inits = fix
    return Emit([sharded(b, (piece,))], [nodes for _ in range(ctx.n)], [inits for _ in range(ctx.n)])


def _rewrite_target(
    ctx: Context, node: onnx.NodeProto, values: tuple[np.ndarray, np.ndarray], in_axis: int, b: int
) -> tuple[list[onnx.NodeProto], dict[str, onnx.TensorProto]] | None:
    """A local target: ``(target * mask + frozen) / div``.

    ``mask`` keeps entries that follow the input size (they come from exact
    shape arithmetic); ``frozen`` holds the static ones, the sharded entry
    divided by N; ``div`` divides a dynamic sharded entry (a head axis merged
    with the batch). A literal 0 copies the *local* input dim, so it is
    frozen to its full size where that local dim is sharded.
    """
    t0, t1 = (np.asarray(v, dtype=np.int64).reshape(-1) for v in values)
    out0, out1 = ctx.shapes(node.output[0])
    allowzero = bool(attr(node, "allowzero", 0))
    n = ctx.n
    mask = np.zeros_like(t0)
    frozen = np.zeros_like(t0)
    div = np.ones_like(t0)
    for i, (v0, v1) in enumerate(zip(t0.tolist(), t1.tolist())):
        static = v0 == v1
        copies = static and v0 == 0 and not allowzero
        full = out0[i] if out0[i] == out1[i] else None
        if i == b:
            if static and v0 == -1:
                frozen[i] = -1
            elif copies and i == in_axis:
                frozen[i] = 0  # copies the local dim, which is already the shard
            elif static and (v0 > 0 or copies) and full is not None:
                frozen[i] = full // n
            elif not static and v0 > 0 and v1 > 0:
                mask[i], div[i] = 1, n
            else:
                return None
        elif copies and i == in_axis:
            if full is None:
                return None
            frozen[i] = full
        elif static:
            frozen[i] = v0
        elif v0 > 0 and v1 > 0:
            mask[i] = 1
        else:
            return None
    target = node.input[1]
    nodes: list[onnx.NodeProto] = []
    inits: dict[str, onnx.TensorProto] = {}
    if not mask.any():
        value = ctx.constant(f"{target}.tp{n}", frozen)
        inits[value.name] = value
        current = value.name
    else:
        current = target
        for op, array in (("Mul", mask), ("Add", frozen), ("Div", div)):
            if (op == "Mul" and mask.all()) or (op == "Add" and not frozen.any()) or (op == "Div" and (div == 1).all()):
                continue
            const = ctx.constant(f"{target}.{op.lower()}", array)
            inits[const.name] = const
            result = ctx.fresh(f"{target}.tp{n}.{op.lower()}")
            nodes.append(helper.make_node(op, [current, const.name], [result], name=ctx.fresh(f"{node.name}.{op.lower()}")))
            current = result
    clone = onnx.NodeProto()
    clone.CopyFrom(node)
    clone.input[1] = current
    nodes.append(clone)
    return nodes, inits


def flatten(ctx: Context, node: onnx.NodeProto, st: list[State]) -> Emit | None:
    s = st[0]
    if s.kind != "S":
        return ctx.copy(node, [s])
    if len(s.pieces) != 1:
        return None
    mapped = map_sharded_axis(ctx.shapes(node.input[0]), ctx.shapes(node.output[0]), s.axis, s.pieces[0], ctx.n)
    return None if mapped is None else ctx.copy(node, [sharded(mapped[0], (mapped[1],))])


def squeeze(ctx: Context, node: onnx.NodeProto, st: list[State]) -> Emit | None:
    s = st[0]
    if any(x.kind != "R" for x in st[1:]):
        return None
    if s.kind != "S":
        return ctx.copy(node, [s])
    in_rank = ctx.rank(node.input[0])
    if node.op_type == "Unsqueeze":
        out_rank = ctx.rank(node.output[0])
        axes = axes_of(ctx, node, out_rank)
        if axes is None:
            return None
        kept = [i for i in range(out_rank) if i not in axes]
        return ctx.copy(node, [sharded(kept[s.axis], s.pieces)])
    axes = axes_of(ctx, node, in_rank)
    if axes is None:  # no axes: every 1 goes, including a shard of local size 1
        if static_extent(ctx, node.input[0], s.axis) == ctx.n:
            return None
        axes = [i for i in range(in_rank) if static_extent(ctx, node.input[0], i) == 1]
    if s.axis in axes:
        return None
    return ctx.copy(node, [sharded(s.axis - sum(1 for a in axes if a < s.axis), s.pieces)])
