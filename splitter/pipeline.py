"""Pipeline-parallel splitting: cut a model's topological order into M
stages balanced by weight bytes and extract each stage as an ordinary model
with ``onnx.utils.Extractor``.

Costing: each node costs the bytes of the initializers it is the first to
use (shared weights count once, where first needed). A linear-partition DP
over the weight-carrying nodes minimises the heaviest stage, then the fewest
activation bytes crossing the cuts; each cut is placed, between its two
weight-carrying nodes, where the fewest activation bytes are live.

Traps guarded: every boundary tensor gets a ``value_info`` (shape inference,
completed from a probe run where inference gives up); stage inputs and
outputs are every live tensor crossing the cut, names captured by If/Loop
bodies included; each extracted stage must be exactly its own node range
(an incomplete cut would silently pull earlier nodes in), so stages are
asserted disjoint; nodes and initializers read only inside subgraph bodies,
which Extractor does not follow, are put back; initializers shared across
stages are copied into each.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np
import onnx
from onnx import helper
from onnx.utils import Extractor

from splitter.graph import GraphView, SplitError, node_inputs, prepare, tensor_nbytes
from splitter.layout import REPLICATED
from splitter.plan import Boundary, Collective, Plan, Segment, Shard, TensorSpec, shard_name
from splitter.probe import Probe, probe
from splitter.shards import SplitResult, signature_value_info, tensor_spec
from splitter.sizes import InputHints

log = logging.getLogger(__name__)


def split_pipeline_parallel(
    model: onnx.ModelProto,
    m: int,
    *,
    name: str,
    hints: InputHints | None = None,
    declared: Mapping[str, tuple[int, ...]] | None = None,
) -> SplitResult:
    """Split ``model`` into ``m`` stages; shards are named ``<name>.pp<m>.s<stage>``.

    ``hints`` and ``declared`` as for :func:`splitter.split_tensor_parallel`.
    """
    if m < 1:
        raise SplitError(f"pipeline-parallel degree must be >= 1, got {m}")
    view = GraphView(prepare(model))
    found = probe(view, hints, declared=declared)
    cuts = _choose_cuts(view, found, m)
    bounds = [0, *cuts, len(view.nodes)]
    inferred = _with_value_info(view, found)
    extractor = Extractor(inferred)
    later_reads = _reads_from(view, bounds)
    models: dict[str, onnx.ModelProto] = {}
    segments: list[Segment] = []
    taken: set[str] = set()
    for stage in range(m):
        start, end = bounds[stage], bounds[stage + 1]
        own = view.nodes[start:end]
        produced = {o for node in own for o in node.output if o}
        inputs: list[str] = []
        for node in own:
            for x in node_inputs(node):
                if x not in produced and x not in view.initializers and x not in inputs:
                    inputs.append(x)
        outputs = [x for node in own for x in node.output if x and x in later_reads[stage + 1]]
        if not outputs:
            raise SplitError(f"stage {stage} (nodes {own[0].name!r}..{own[-1].name!r}) feeds nothing downstream")
        shard = shard_name(name, "pipeline", m, 0, stage)
        extracted = extractor.extract_model(inputs, outputs)
        _check_stray(stage, extracted, own)
        _complete_stage(extracted, own, inputs, outputs, view)
        _check_disjoint(stage, extracted, taken)
        extracted.graph.name = shard
        extracted.producer_name = "infergate-split"
        models[shard] = extracted
        weight = sum(tensor_nbytes(t) for t in extracted.graph.initializer)
        ins = tuple(tensor_spec(found, x, REPLICATED, 1) for x in inputs)
        outs = tuple(tensor_spec(found, x, REPLICATED, 1) for x in outputs)
        _declare_signature(extracted, ins, outs)
        shards = (Shard(shard, 0, stage, ins, outs, weight, f"{shard}/1/model.onnx"),)
        segments.append(Segment(stage, shards, tuple(Boundary(x, Collective.NONE) for x in outputs)))
    plan = Plan(
        model=name,
        kind="pipeline",
        tensor_parallel=1,
        pipeline_parallel=m,
        inputs=tuple(tensor_spec(found, x, REPLICATED, 1) for x in view.inputs),
        outputs=tuple(tensor_spec(found, x, REPLICATED, 1) for x in view.outputs),
        segments=tuple(segments),
        source_weight_bytes=view.weight_bytes(),
    )
    log.info("pipeline parallel M=%d: cuts before nodes %s", m, [view.nodes[c].name for c in cuts])
    return SplitResult(plan, models, found.sizes, hints)


def _declare_signature(model: onnx.ModelProto, inputs: tuple[TensorSpec, ...], outputs: tuple[TensorSpec, ...]) -> None:
    """The stage's graph inputs and outputs as the plan (and config.pbtxt)
    declare them, not as shape inference happened to leave them."""
    for target, specs in ((model.graph.input, inputs), (model.graph.output, outputs)):
        by_name = {spec.name: spec for spec in specs}
        for index, value in enumerate(target):
            if value.name in by_name:
                target[index].CopyFrom(signature_value_info(by_name[value.name]))


def _reads_from(view: GraphView, bounds: list[int]) -> list[set[str]]:
    """``reads[s]``: names read by stages s.. (plus the model outputs)."""
    stages = len(bounds) - 1
    reads = [set(view.outputs) for _ in range(stages + 1)]
    for stage in range(stages - 1, -1, -1):
        reads[stage] = set(reads[stage + 1])
        for node in view.nodes[bounds[stage] : bounds[stage + 1]]:
            reads[stage].update(node_inputs(node))
    return reads


def _choose_cuts(view: GraphView, found: Probe, m: int) -> list[int]:
    """Node indices before which stages 1..m-1 start."""
    seen: set[str] = set()
    weighted: list[tuple[int, int]] = []  # (node index, bytes first used there)
    for index, node in enumerate(view.nodes):
        fresh = [x for x in node_inputs(node) if x in view.initializers and x not in seen]
        seen.update(fresh)
        cost = sum(tensor_nbytes(view.initializers[x]) for x in fresh)
        if cost:
            weighted.append((index, cost))
    if m == 1:
        return []
    if len(weighted) < m:
        raise SplitError(f"cannot cut into {m} stages: only {len(weighted)} nodes carry weights; "
                         f"choose a pipeline-parallel degree of {max(len(weighted), 1)} or less")
    crossing = _crossing_bytes(view, found)
    # boundary j sits between weighted items j-1 and j; pick its cheapest position
    places: list[int] = [0]
    costs = np.zeros(len(weighted))
    for j in range(1, len(weighted)):
        lo, hi = weighted[j - 1][0] + 1, weighted[j][0]
        best = min(range(lo, hi + 1), key=lambda p: (crossing[p], -p))
        places.append(best)
        costs[j] = crossing[best]
    sizes = np.array([c for _, c in weighted], dtype=np.float64)
    starts = _linear_partition(sizes, costs, m)
    return [places[j] for j in starts[1:]]


def _crossing_bytes(view: GraphView, found: Probe) -> np.ndarray:
    """``out[p]``: activation bytes live across a cut placed before node p."""
    n = len(view.nodes)
    delta = np.zeros(n + 2)
    outputs = set(view.outputs)
    for index, node in enumerate(view.nodes):
        for name in node.output:
            if not name or not found.knows(name):
                continue
            readers = view.consumers.get(name, [])
            last = n if name in outputs else max(readers, default=index)
            size = int(np.prod(found.shape(name), dtype=np.int64)) * found.dtypes[name].itemsize
            delta[index + 1] += size
            delta[last + 1] -= size
    return np.cumsum(delta)[: n + 1]


def _linear_partition(sizes: np.ndarray, cut_costs: np.ndarray, m: int) -> list[int]:
    """First item of each of ``m`` contiguous groups: minimise the largest
    group sum, then the summed cost of the cuts used (``cut_costs[j]``:
    cutting just before item j)."""
    k = len(sizes)
    prefix = np.concatenate([[0.0], np.cumsum(sizes)])
    # best[s][i]: (max load, cut cost) of items[:i] in s groups
    load = np.full((m + 1, k + 1), np.inf)
    cut = np.full((m + 1, k + 1), np.inf)
    back = np.zeros((m + 1, k + 1), dtype=np.int64)
    load[1, 1:] = prefix[1:]
    cut[1, 1:] = 0.0
    for s in range(2, m + 1):
        for i in range(s, k + 1):
            t = np.arange(s - 1, i)
            cand_load = np.maximum(load[s - 1, t], prefix[i] - prefix[t])
            cand_cut = cut[s - 1, t] + cut_costs[t]
            best_load = cand_load.min()
            tied = np.flatnonzero(cand_load <= best_load * (1 + 1e-9))
            pick = tied[np.argmin(cand_cut[tied])]
            load[s, i], cut[s, i], back[s, i] = cand_load[pick], cand_cut[pick], t[pick]
    starts = []
    i = k
    for s in range(m, 0, -1):
        start = int(back[s, i]) if s > 1 else 0
        starts.append(start)
        i = start
    return starts[::-1]


def _with_value_info(view: GraphView, found: Probe) -> onnx.ModelProto:
    """Shape inference, then a probe-based value_info for any tensor it left out:
    Extractor needs one for every stage input and output."""
    try:
        inferred = onnx.shape_inference.infer_shapes(view.model)
    except Exception as exc:  # inference is best effort: the probe fills the gaps
        log.warning("shape inference failed (%s); using probed shapes", exc)
        inferred = onnx.ModelProto()
        inferred.CopyFrom(view.model)
    known = {v.name for v in inferred.graph.value_info} | {v.name for v in inferred.graph.input}
    known |= {v.name for v in inferred.graph.output}
    for node in inferred.graph.node:
        for name in node.output:
            if name and name not in known and found.knows(name):
                elem = helper.np_dtype_to_tensor_dtype(found.dtypes[name])
                dims = [d if d >= 0 else None for d in found.spec_shape(name)]
                inferred.graph.value_info.append(helper.make_tensor_value_info(name, elem, dims))
    return inferred


def _check_stray(stage: int, extracted: onnx.ModelProto, own: list[onnx.NodeProto]) -> None:
    allowed = {node.name for node in own}
    stray = [node.name for node in extracted.graph.node if node.name not in allowed]
    if stray:
        raise SplitError(
            f"stage {stage}: extraction pulled in node {stray[0]!r} from another stage (a live tensor is missing from the cut)"
        )


def _check_disjoint(stage: int, extracted: onnx.ModelProto, taken: set[str]) -> None:
    names = [node.name for node in extracted.graph.node]
    overlap = taken.intersection(names)
    if overlap:
        raise SplitError(f"stage {stage}: node {sorted(overlap)[0]!r} is in two stages")
    taken.update(names)


def _complete_stage(
    extracted: onnx.ModelProto, own: list[onnx.NodeProto], inputs: list[str], outputs: list[str], view: GraphView
) -> None:
    """Extractor follows explicit inputs only: a producer read only inside an
    If/Loop body, or an initializer captured by one, is left out. Put back
    every node of the stage the outputs need (in stage order) and every
    initializer those nodes read."""
    producer = {o: node for node in own for o in node.output if o}
    needed: set[str] = set()
    stack = list(outputs)
    seen = set(inputs)
    while stack:
        name = stack.pop()
        if name in seen or name not in producer:
            continue
        seen.add(name)
        node = producer[name]
        if node.name not in needed:
            needed.add(node.name)
            stack.extend(node_inputs(node))
    have = {node.name for node in extracted.graph.node}
    if needed - have:
        log.info("stage %s: restoring nodes read only inside subgraphs: %s", extracted.graph.name, sorted(needed - have))
        nodes = [node for node in own if node.name in needed or node.name in have]
        extracted.graph.ClearField("node")
        extracted.graph.node.extend(nodes)
    present = {t.name for t in extracted.graph.initializer}
    for node in extracted.graph.node:
        for x in node_inputs(node):
            if x in view.initializers and x not in present:
                extracted.graph.initializer.append(view.initializers[x])
                present.add(x)
