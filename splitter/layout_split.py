"""Splitting a model for serving: one call for any ``tensor_parallel`` x
``pipeline_parallel`` layout, and which shards must share a worker.

Tensor x pipeline (both above 1) composes the two splitters: the model is
cut into pipeline stages, each stage is split tensor-parallel on its own, and
the stage plans are chained into one plan. Chaining is sound because a stage
plan leaves every stage output joined in the shared store (a plan's outputs
always are), which is exactly where the next stage's plan reads its inputs.

A *slot* is the set of shards one worker hosts for one copy of the model:
all segments of one tensor-parallel rank of one stage (a rank's weights stay
together, 1/N of the stage's). Placement works on slots, never on single
shards.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np
import onnx

from splitter.graph import GraphView, SplitError, prepare
from splitter.pipeline import split_pipeline_parallel
from splitter.plan import Plan, Segment
from splitter.probe import cpu_session, model_inputs
from splitter.shards import SplitResult
from splitter.sizes import InputHints
from splitter.tensor import split_tensor_parallel

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LayoutSplit:
    """A split plus its slots: ``slots[j]`` names the shards one worker hosts together."""

    result: SplitResult
    slots: tuple[tuple[str, ...], ...]

    @property
    def plan(self) -> Plan:
        return self.result.plan

    def slot_of(self, shard: str) -> int:
        for index, names in enumerate(self.slots):
            if shard in names:
                return index
        raise KeyError(shard)


def split_layout(
    model: onnx.ModelProto,
    tensor_parallel: int,
    pipeline_parallel: int,
    *,
    name: str,
    hints: InputHints | None = None,
    declared: Mapping[str, tuple[int, ...]] | None = None,
) -> LayoutSplit:
    """Split ``model`` into ``pipeline_parallel`` stages of ``tensor_parallel`` ranks each.

    Shard names: ``<name>.tp<N>.r<rank>.s<segment>`` (tensor only),
    ``<name>.pp<M>.s<stage>`` (pipeline, or neither: ``pp1.s0`` is the whole
    model), ``<name>.pp<M>.s<stage>.tp<N>.r<rank>.s<segment>`` (both).
    """
    if tensor_parallel < 1 or pipeline_parallel < 1:
        raise SplitError(f"parallel degrees must be >= 1, got tp={tensor_parallel} pp={pipeline_parallel}")
    if tensor_parallel == 1:
        result = split_pipeline_parallel(model, pipeline_parallel, name=name, hints=hints, declared=declared)
        return LayoutSplit(result, tuple((shard.name,) for shard in result.plan.shards()))
    if pipeline_parallel == 1:
        result = split_tensor_parallel(model, tensor_parallel, name=name, hints=hints, declared=declared)
        return LayoutSplit(result, _rank_slots(result.plan, tensor_parallel))
    stages = split_pipeline_parallel(model, pipeline_parallel, name=name, hints=hints, declared=declared)
    stage_feeds = _stage_inputs(model, stages, hints, declared)
    segments: list[Segment] = []
    models: dict[str, onnx.ModelProto] = {}
    slots: list[tuple[str, ...]] = []
    fallbacks = []
    for stage in stages.plan.shards():
        # each stage is probed on what the stages before it produce from the
        # whole model's probe inputs, so its sizes stay consistent
        sub = split_tensor_parallel(stages.models[stage.name], tensor_parallel, name=stage.name,
                                    feeds=stage_feeds[stage.name])
        offset = len(segments)
        for segment in sub.plan.segments:
            shards = tuple(replace(shard, segment=shard.segment + offset) for shard in segment.shards)
            segments.append(replace(segment, index=segment.index + offset, shards=shards))
        models.update(sub.models)
        slots.extend(_rank_slots(sub.plan, tensor_parallel))
        fallbacks.extend(sub.plan.fallbacks)
    plan = Plan(
        model=name,
        kind="tensor",
        tensor_parallel=tensor_parallel,
        pipeline_parallel=pipeline_parallel,
        inputs=stages.plan.inputs,
        outputs=stages.plan.outputs,
        segments=tuple(segments),
        source_weight_bytes=stages.plan.source_weight_bytes,
        fallbacks=tuple(fallbacks),
    )
    log.info("split %s into %d stages x %d ranks: %d segments, %d shards", name, pipeline_parallel,
             tensor_parallel, len(segments), len(models))
    return LayoutSplit(SplitResult(plan, models, stages.sizes, hints), tuple(slots))


def _stage_inputs(
    model: onnx.ModelProto, stages: SplitResult, hints: InputHints | None, declared: Mapping[str, tuple[int, ...]] | None
) -> dict[str, tuple[dict[str, np.ndarray], dict[str, np.ndarray]]]:
    """Each stage's inputs at the two probe sizes the pipeline split used."""
    assert stages.sizes is not None
    inputs = model_inputs(GraphView(prepare(model)), hints, declared)
    rng = np.random.default_rng(0)
    runs = [inputs.make(sizes, rng) for sizes in stages.sizes.probe]
    out: dict[str, list[dict[str, np.ndarray]]] = {}
    for store in runs:
        for stage in stages.plan.shards():
            feeds = {spec.name: store[spec.name] for spec in stage.inputs}
            out.setdefault(stage.name, []).append(feeds)
            session = cpu_session(stages.models[stage.name])
            names = [spec.name for spec in stage.outputs]
            store.update(zip(names, session.run(names, feeds)))
    return {name: (pair[0], pair[1]) for name, pair in out.items()}


def _rank_slots(plan: Plan, n: int) -> list[tuple[str, ...]]:
    return [tuple(shard.name for shard in plan.shards() if shard.rank == rank) for rank in range(n)]
