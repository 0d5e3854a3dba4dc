"""Tensor-parallel splitting: rewrite one ONNX model into N rank graphs per
segment, deciding by dataflow (not by names) which weights split by column,
which by row, and where a collective has to join the ranks.

The walk gives every tensor a state (see :mod:`splitter.layout`) and
places nodes in topological order. A node whose rule cannot take its inputs'
states waits; when nothing else can be placed the current segment ends and
the waiting nodes' inputs are made replicated at the cut (all-reduce of
partials first, all-gather of shards where that is not enough). Segments are
therefore as long as possible and each cut carries every collective that was
due. The model's outputs are made replicated after the last segment.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx

from splitter import tensor_context, tensor_shapes
from splitter import tensor_rules as rules
from splitter import tensor_weights as weights
from splitter.graph import GraphView, SplitError, has_subgraph, node_inputs, prepare, tensor_nbytes
from splitter.layout import REPLICATED, State
from splitter.plan import Boundary, Collective, Fallback, Plan, Segment, Shard, shard_name
from splitter.probe import Probe, probe
from splitter.shards import SplitResult, build_shard, tensor_spec
from splitter.sizes import InputHints

log = logging.getLogger(__name__)

RULES: dict[str, tensor_context.Rule] = {
    **{op: rules.unary for op in rules.UNARY},
    **{op: rules.broadcast for op in rules.BROADCAST},
    "Transpose": rules.transpose,
    "Softmax": rules.softmax,
    "LogSoftmax": rules.softmax,
    "LayerNormalization": rules.layer_norm,
    "Shape": tensor_shapes.shape,
    "Size": tensor_shapes.shape,
    "Reshape": tensor_shapes.reshape,
    "Flatten": tensor_shapes.flatten,
    "Squeeze": tensor_shapes.squeeze,
    "Unsqueeze": tensor_shapes.squeeze,
    "Concat": rules.concat,
    "Slice": rules.slice_,
    "ReduceSum": rules.reduce,
    "ReduceMean": rules.reduce,
    "ReduceMax": rules.reduce,
    "ReduceMin": rules.reduce,
    "MatMul": weights.matmul,
    "Gemm": weights.gemm,
    "Gather": weights.gather,
    "Split": weights.split,
}


@dataclass(slots=True)
class _Draft:
    """One segment while it is being filled."""

    nodes: list[list[onnx.NodeProto]]
    inits: list[dict[str, onnx.TensorProto]]
    produced: dict[str, State] = field(default_factory=dict)
    collectives: dict[str, State] = field(default_factory=dict)  # applied at the cut after it


def split_tensor_parallel(
    model: onnx.ModelProto,
    n: int,
    *,
    name: str,
    strict: bool = False,
    hints: InputHints | None = None,
    declared: Mapping[str, tuple[int, ...]] | None = None,
    feeds: tuple[dict[str, np.ndarray], dict[str, np.ndarray]] | None = None,
) -> SplitResult:
    """Split ``model`` into ``n`` ranks; shards are named ``<name>.tp<n>.r<rank>.s<segment>``.

    Whatever cannot be sharded runs replicated (and is listed in
    ``plan.fallbacks``); with ``strict`` that raises :class:`SplitError`
    naming the node instead. ``hints``: declared input shapes and values;
    ``declared``: the source's config.pbtxt shapes (typical sizes);
    ``feeds``: the two probe runs' inputs, when the caller has them.
    """
    if n < 1:
        raise SplitError(f"tensor-parallel degree must be >= 1, got {n}")
    prepared = prepare(model, split_gemm_bias=True)
    view = GraphView(prepared)
    found = probe(view, hints, declared=declared, feeds=feeds)
    ctx = tensor_context.Context(view, found, n, weights.fused_layouts(view, found, n))
    walk = _Walk(ctx, strict)
    drafts = walk.run()
    result = _assemble(ctx, drafts, walk.fallbacks, name)
    return SplitResult(result.plan, result.models, found.sizes, hints)


class _Walk:
    def __init__(self, ctx: tensor_context.Context, strict: bool) -> None:
        self.ctx = ctx
        self.strict = strict
        self.view = ctx.view
        self.states: dict[str, State] = {x: REPLICATED for x in [*self.view.inputs, *self.view.initializers]}
        self.fallbacks: list[Fallback] = []

    def _new_draft(self) -> _Draft:
        return _Draft([[] for _ in range(self.ctx.n)], [{} for _ in range(self.ctx.n)])

    def run(self) -> list[_Draft]:
        view = self.view
        missing = [len([x for x in names if x not in self.states]) for names in view.inputs_of]
        queue = deque(i for i, m in enumerate(missing) if m == 0)
        blocked: list[int] = []
        drafts = [self._new_draft()]
        placed = 0
        while placed < len(view.nodes):
            while queue:
                index = queue.popleft()
                emit = self._try(index, self._input_states(index))
                if emit is None:
                    blocked.append(index)
                    continue
                self._place(index, emit, drafts[-1])
                placed += 1
                for out in view.nodes[index].output:
                    for consumer in view.consumers.get(out, ()):
                        missing[consumer] -= 1
                        if missing[consumer] == 0:
                            queue.append(consumer)
            if placed == len(view.nodes):
                break
            if not blocked:
                raise SplitError("tensor-parallel walk stalled: the graph has unreachable nodes")
            self._cut(drafts[-1], blocked)
            drafts.append(self._new_draft())
            queue, blocked = deque(sorted(blocked)), []
        finals = {o: self.states[o] for o in view.outputs if o in self.states and self.states[o].kind != "R"}
        drafts[-1].collectives.update(finals)
        return drafts

    def _input_states(self, index: int) -> list[State]:
        node = self.view.nodes[index]
        return [self.states[x] if x else REPLICATED for x in node.input]

    def _try(self, index: int, st: list[State]) -> tensor_context.Emit | None:
        node = self.view.nodes[index]
        captured = [x for x in self.view.inputs_of[index] if x not in node.input]
        if any(self.states[x].kind != "R" for x in captured):
            return None
        splittable = self.ctx.n > 1 and node.domain in ("", "ai.onnx") and not has_subgraph(node)
        rule = RULES.get(node.op_type) if splittable else None
        emit = rule(self.ctx, node, st) if rule else None
        if emit is None and all(s.kind == "R" for s in st):
            weights = [x for x in node.input if x in self.view.initializers and self.view.initializers[x].dims
                       and len(self.view.initializers[x].dims) >= 2] if rule is None and self.ctx.n > 1 else []
            note = f"no tensor-parallel rule for {node.op_type}: weight {weights[0]!r} kept whole" if weights else None
            emit = self.ctx.copy(node, [REPLICATED] * len(node.output), note=note)
        return emit

    def _needs(self, index: int) -> dict[str, State]:
        """Which inputs must become replicated for the node to be placed:
        partials only if that suffices, else everything not replicated."""
        node = self.view.nodes[index]
        st = self._input_states(index)
        partial = {x: s for x, s in zip(node.input, st) if s.kind == "P"}
        if partial and self._try(index, [REPLICATED if s.kind == "P" else s for s in st]) is not None:
            return partial
        return {x: self.states[x] for x in self.view.inputs_of[index] if x and self.states[x].kind != "R"}

    def _cut(self, draft: _Draft, blocked: list[int]) -> None:
        for index in blocked:
            needs = self._needs(index)
            # an all-gather is the fallback worth reporting (an all-reduce is
            # the normal row-parallel join); once per tensor
            gathered = [f"{x!r} {s}" for x, s in needs.items() if s.kind == "S" and x not in draft.collectives]
            if gathered:
                self._fallback(self.view.nodes[index], "all-gather of " + ", ".join(gathered))
            draft.collectives.update(needs)
        for name in draft.collectives:
            self.states[name] = REPLICATED

    def _place(self, index: int, emit: tensor_context.Emit, draft: _Draft) -> None:
        node = self.view.nodes[index]
        for rank in range(self.ctx.n):
            draft.nodes[rank].extend(emit.nodes[rank])
            draft.inits[rank].update(emit.inits[rank])
            # constants the rule passed through untouched ride along whole
            for emitted in emit.nodes[rank]:
                for x in node_inputs(emitted):
                    if x in self.view.initializers and x not in draft.inits[rank]:
                        draft.inits[rank][x] = self.view.initializers[x]
        for out, state in zip(node.output, emit.outputs):
            if out:
                self.states[out] = state
                draft.produced[out] = state
        if emit.note:
            self._fallback(node, emit.note)

    def _fallback(self, node: onnx.NodeProto, reason: str) -> None:
        if self.strict:
            raise SplitError(f"node {node.name!r} ({node.op_type}): cannot shard at N={self.ctx.n}: {reason}. "
                             "Without --strict it runs replicated (listed as a fallback); or choose another "
                             "tensor-parallel degree")
        log.info("tensor parallel N=%d: node %r (%s): %s", self.ctx.n, node.name, node.op_type, reason)
        self.fallbacks.append(Fallback(node.name, node.op_type, reason))


def _assemble(ctx: tensor_context.Context, drafts: list[_Draft], fallbacks: list[Fallback], name: str) -> SplitResult:
    view, found, n = ctx.view, ctx.probe, ctx.n
    original = ctx.view.model
    # consumed[k]: names segment k's nodes read that it does not produce
    consumed: list[list[str]] = []
    for draft in drafts:
        produced = {o for node in draft.nodes[0] for o in node.output if o}
        seen: list[str] = []
        for node in draft.nodes[0]:
            for x in node_inputs(node):
                if x not in produced and x not in draft.inits[0] and x not in seen:
                    seen.append(x)
        consumed.append(seen)
    reduced_at = {x: k for k, d in enumerate(drafts) for x in d.collectives}
    produced_state = {x: s for d in drafts for x, s in d.produced.items()}

    def state_in(x: str, segment: int) -> State:
        if x not in produced_state or reduced_at.get(x, len(drafts)) < segment:
            return REPLICATED
        return produced_state[x]

    models: dict[str, onnx.ModelProto] = {}
    segments: list[Segment] = []
    for k, draft in enumerate(drafts):
        later = {x for c in consumed[k + 1 :] for x in c} | set(view.outputs)
        outputs = [x for x in draft.produced if x in later or reduced_at.get(x, -1) >= k]
        boundaries = [_boundary(found, x, draft.produced[x], x in draft.collectives) for x in outputs]
        boundaries += [_boundary(found, x, s, True) for x, s in draft.collectives.items() if x not in draft.produced]
        shards = []
        for rank in range(n):
            shard = shard_name(name, "tensor", n, rank, k)
            ins = tuple(tensor_spec(found, x, state_in(x, k), n) for x in consumed[k])
            outs = tuple(tensor_spec(found, x, draft.produced[x], n) for x in outputs)
            models[shard] = build_shard(original, shard, draft.nodes[rank], ins, outs, list(draft.inits[rank].values()))
            weight = sum(tensor_nbytes(t) for t in draft.inits[rank].values())
            shards.append(Shard(shard, rank, k, ins, outs, weight, f"{shard}/1/model.onnx"))
        segments.append(Segment(k, tuple(shards), tuple(boundaries)))
    plan = Plan(
        model=name,
        kind="tensor",
        tensor_parallel=n,
        pipeline_parallel=1,
        inputs=tuple(tensor_spec(found, x, REPLICATED, 1) for x in view.inputs),
        outputs=tuple(tensor_spec(found, x, REPLICATED, 1) for x in view.outputs),
        segments=tuple(segments),
        source_weight_bytes=view.weight_bytes(),
        fallbacks=tuple(fallbacks),
    )
    log.info("tensor parallel N=%d: %d segments, %d fallbacks", n, len(segments), len(fallbacks))
    return SplitResult(plan, models)


def _boundary(found: Probe, name: str, state: State, collective: bool) -> Boundary:
    if collective and state.kind == "P":
        return Boundary(name, Collective.ALLREDUCE_SUM)
    if collective and state.kind == "S":
        # one block per rank concatenates plainly; fused pieces or a shard
        # repeated along a merged axis need the pieces to reassemble
        plain = {found.shape(name, run)[state.axis] for run in (0, 1)} == set(state.pieces)
        return Boundary(name, Collective.ALLGATHER, axis=state.axis, pieces=() if plain else state.pieces)
    return Boundary(name, Collective.NONE, per_rank=state.kind != "R")

