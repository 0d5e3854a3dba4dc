"""Tensor-parallel rules for the operators that own the weights (MatMul,
Gemm, embedding Gather) and for Split, which decides how fused weights
(QKV, gate/up) are laid out: the Megatron column/row pattern, by dataflow.
"""

from __future__ import annotations

import numpy as np
import onnx

from splitter.graph import GraphView
from splitter.layout import PARTIAL, REPLICATED, State, sharded
from splitter.probe import Probe
from splitter.tensor_context import Context, Emit, attr
from splitter.tensor_rules import BROADCAST, UNARY, static_slice


def _split_sizes(view: GraphView, probe: Probe, node: onnx.NodeProto, axis: int) -> list[int] | None:
    if len(node.input) > 1 and node.input[1]:
        sizes = view.const(node.input[1])
        return None if sizes is None else [int(v) for v in sizes.reshape(-1)]
    listed = attr(node, "split", None)
    if listed is not None:
        return [int(v) for v in listed]  # type: ignore[union-attr]
    full = probe.shape(node.input[0])[axis]
    parts = len(node.output)
    return [full // parts] * parts if full % parts == 0 else None


def fused_layouts(view: GraphView, probe: Probe, n: int) -> dict[str, tuple[int, ...]]:
    """Outputs of MatMul/Gemm that a Split (or torch's Slice-based
    ``chunk``) later cuts along the feature axis, with the piece sizes.

    A column split of such a weight must give rank r block r of *every*
    piece (its share of Q, of K and of V), not block r of the whole: a plain
    contiguous split would hand rank 0 all of Q and some of K, which runs
    without error and is wrong by order 1. Walks back from the cut through
    bias adds, scales and activations to the projection.
    """
    cuts: dict[str, list[int]] = {}
    chunks: dict[str, set[tuple[int, int]]] = {}
    for node in view.nodes:
        if not node.input or not probe.knows(node.input[0]):
            continue
        last = probe.rank(node.input[0]) - 1
        if node.op_type == "Split" and int(attr(node, "axis", 0)) % (last + 1) == last:  # type: ignore[arg-type]
            sizes = _split_sizes(view, probe, node, last)
            if sizes is not None:
                cuts[node.input[0]] = sizes
        elif node.op_type == "Slice":
            bounds = static_slice(probe, node)
            if bounds is not None and bounds[0] == last:
                chunks.setdefault(node.input[0], set()).add(bounds[1:])
    for tensor, ranges in chunks.items():
        ordered = sorted(ranges)
        full = probe.shape(tensor)[-1]
        if ordered[0][0] == 0 and ordered[-1][1] == full and all(a[1] == b[0] for a, b in zip(ordered, ordered[1:])):
            cuts.setdefault(tensor, [end - start for start, end in ordered])
    hints: dict[str, tuple[int, ...]] = {}
    for tensor, sizes in cuts.items():
        if len(sizes) < 2 or any(size % n for size in sizes):
            continue
        while tensor in view.producer:
            producer = view.nodes[view.producer[tensor]]
            if producer.op_type in ("MatMul", "Gemm"):
                weight = view.const(producer.input[1])
                if weight is not None and weight.ndim == 2:
                    hints[tensor] = tuple(sizes)
                break
            if producer.op_type not in BROADCAST and producer.op_type not in UNARY:
                break
            activations = [x for x in producer.input if x and view.const(x) is None]
            if len(activations) != 1:
                break
            tensor = activations[0]
    return hints


def _column_pieces(ctx: Context, out: str, features: int) -> tuple[int, ...]:
    pieces = ctx.hints.get(out)
    if pieces and sum(pieces) == features and all(p % ctx.n == 0 for p in pieces):
        return pieces
    return (features,)


def _weighted(ctx: Context, node: onnx.NodeProto, index: int, axis: int, pieces: tuple[int, ...], out: State) -> Emit:
    name, parts = ctx.sliced(node.input[index], axis, pieces)
    nodes, inits = ctx.with_inputs(node, {index: name}, [parts])
    return Emit([out], nodes, inits)


def matmul(ctx: Context, node: onnx.NodeProto, st: list[State]) -> Emit | None:
    a_name, b_name = node.input[0], node.input[1]
    sa, sb = st
    ra, rb, ro = ctx.rank(a_name), ctx.rank(b_name), ctx.rank(node.output[0])
    weight = ctx.const(b_name)
    if weight is not None and weight.ndim == 2 and ra >= 2:
        k, m = weight.shape
        if sa.kind == "R":
            if m % ctx.n == 0:  # column parallel: output features split
                pieces = _column_pieces(ctx, node.output[0], m)
                return _weighted(ctx, node, 1, 1, pieces, sharded(ro - 1, pieces))
            return ctx.copy(node, [REPLICATED], note=f"weight {b_name!r} {list(weight.shape)}: {m} not divisible by {ctx.n}; kept whole")
        if sa.kind == "S" and sa.axis == ra - 1:  # row parallel: contraction split, partial sums
            return _weighted(ctx, node, 1, 0, sa.pieces, PARTIAL)
        if sa.kind == "S":  # a batch/row axis: the weight is needed whole
            return ctx.copy(node, [sa], note=f"weight {b_name!r} kept whole: input sharded on a batch axis")
        if sa.kind == "P":  # reduce first and split the weight, unless it cannot be split
            return None if m % ctx.n == 0 else ctx.copy(node, [PARTIAL])
    if sa.kind == "R" and sb.kind == "R":
        return ctx.copy(node, [REPLICATED])
    if (sa.kind, sb.kind) in (("P", "R"), ("R", "P")):
        return ctx.copy(node, [PARTIAL])
    if ra < 2 or rb < 2:
        return None
    if sa.kind == "S" and sb.kind == "S":
        if sa.axis == ra - 1 and sb.axis == rb - 2 and sa.pieces == sb.pieces:
            return ctx.copy(node, [PARTIAL])
        oa, ob = sa.axis + ro - ra, sb.axis + ro - rb
        if sa.axis < ra - 2 and sb.axis < rb - 2 and oa == ob and sa.pieces == sb.pieces:
            return ctx.copy(node, [sharded(oa, sa.pieces)])  # heads: QK^T, PV
        return None
    if sa.kind == "S" and sb.kind == "R":
        if sa.axis == ra - 2:
            return ctx.copy(node, [sharded(ro - 2, sa.pieces)])
        if sa.axis < ra - 2 and _broadcasts(ctx, b_name, sa.axis + ro - ra, ro):
            return ctx.copy(node, [sharded(sa.axis + ro - ra, sa.pieces)])
        return None
    if sa.kind == "R" and sb.kind == "S":
        if sb.axis == rb - 1:
            return ctx.copy(node, [sharded(ro - 1, sb.pieces)])
        if sb.axis < rb - 2 and _broadcasts(ctx, a_name, sb.axis + ro - rb, ro):
            return ctx.copy(node, [sharded(sb.axis + ro - rb, sb.pieces)])
    return None


def _broadcasts(ctx: Context, name: str, out_axis: int, out_rank: int) -> bool:
    """Whether a replicated operand is the same for every slice along ``out_axis``."""
    axis = out_axis - (out_rank - ctx.rank(name))
    return axis < 0 or (ctx.shape(name, 0)[axis] == 1 and ctx.shape(name, 1)[axis] == 1)


def gemm(ctx: Context, node: onnx.NodeProto, st: list[State]) -> Emit | None:
    weight = ctx.const(node.input[1])
    has_bias = len(node.input) > 2 and bool(node.input[2])
    sa = st[0]
    if weight is None or weight.ndim != 2 or has_bias or int(attr(node, "transA", 0)) or st[1].kind != "R":  # type: ignore[arg-type]
        return ctx.copy(node, [REPLICATED]) if all(s.kind == "R" for s in st) else None
    trans_b = bool(attr(node, "transB", 0))
    k, m = (weight.shape[1], weight.shape[0]) if trans_b else weight.shape
    out_axis, in_axis = (0, 1) if trans_b else (1, 0)  # weight axes holding output / input features
    if sa.kind == "R":
        if m % ctx.n == 0:
            pieces = _column_pieces(ctx, node.output[0], m)
            return _weighted(ctx, node, 1, out_axis, pieces, sharded(1, pieces))
        return ctx.copy(node, [REPLICATED], note=f"weight {node.input[1]!r} {list(weight.shape)}: {m} not divisible by {ctx.n}; kept whole")
    if sa.kind == "S" and sa.axis == 1:
        return _weighted(ctx, node, 1, in_axis, sa.pieces, PARTIAL)
    if sa.kind == "S":
        return ctx.copy(node, [sa], note=f"weight {node.input[1]!r} kept whole: input sharded on the batch axis")
    return None if m % ctx.n == 0 else ctx.copy(node, [PARTIAL])


def gather(ctx: Context, node: onnx.NodeProto, st: list[State]) -> Emit | None:
    data, indices = node.input[0], node.input[1]
    sd, si = st
    if si.kind != "R":
        return None
    rank = ctx.rank(data)
    axis = int(attr(node, "axis", 0)) % rank  # type: ignore[arg-type]
    table = ctx.const(data)
    if sd.kind == "R" and table is not None and table.ndim == 2 and axis == 0 and table.dtype.kind == "f":
        width = table.shape[1]
        if width % ctx.n == 0:  # embedding split along the hidden size
            return _weighted(ctx, node, 0, 1, (width,), sharded(ctx.rank(node.output[0]) - 1, (width,)))
        return ctx.copy(node, [REPLICATED], note=f"table {data!r} {list(table.shape)}: {width} not divisible by {ctx.n}; kept whole")
    if sd.kind in ("R", "P"):
        return ctx.copy(node, [sd])
    if sd.axis == axis:
        return None
    index_rank = ctx.rank(indices)
    return ctx.copy(node, [sharded(sd.axis if sd.axis < axis else sd.axis + index_rank - 1, sd.pieces)])


def split(ctx: Context, node: onnx.NodeProto, st: list[State]) -> Emit | None:
    s = st[0]
    if any(x.kind != "R" for x in st[1:]):
        return None
    if s.kind != "S":
        return ctx.copy(node, [s] * len(node.output))
    rank = ctx.rank(node.input[0])
    axis = int(attr(node, "axis", 0)) % rank  # type: ignore[arg-type]
    if s.axis != axis:
        return ctx.copy(node, [s] * len(node.output))
    sizes = _split_sizes(ctx.view, ctx.probe, node, axis)
    full = {ctx.shape(node.input[0], run)[axis] for run in (0, 1)}
    if sizes is None or tuple(sizes) != s.pieces or full != {sum(sizes)}:
        return None
    outputs = [sharded(axis, (size,)) for size in sizes]
    if not (len(node.input) > 1 and node.input[1]) and attr(node, "split", None) is None:
        return ctx.copy(node, outputs)  # equal parts of the shard are the shards of equal parts
    clone = onnx.NodeProto()
    clone.CopyFrom(node)
    local = [size // ctx.n for size in sizes]
    inits: dict[str, onnx.TensorProto] = {}
    if len(node.input) > 1 and node.input[1]:
        const = ctx.constant(f"{node.input[1]}.tp{ctx.n}", np.array(local, dtype=np.int64))
        clone.input[1] = const.name
        inits[const.name] = const
    else:
        for a in clone.attribute:
            if a.name == "split":
                del a.ints[:]
                a.ints.extend(local)
    return Emit(outputs, [[clone] for _ in range(ctx.n)], [dict(inits) for _ in range(ctx.n)])
