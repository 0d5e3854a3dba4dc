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
from dataclasses import dataclass, replace

import onnx

from splitter.graph import SplitError
from splitter.pipeline import split_pipeline_parallel
from splitter.plan import Plan, Segment
from splitter.shards import SplitResult
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


def split_layout(model: onnx.ModelProto, tensor_parallel: int, pipeline_parallel: int, *, name: str) -> LayoutSplit:
    """Split ``model`` into ``pipeline_parallel`` stages of ``tensor_parallel`` ranks each.

    Shard names: ``<name>.tp<N>.r<rank>.s<segment>`` (tensor only),
    ``<name>.pp<M>.s<stage>`` (pipeline, or neither: ``pp1.s0`` is the whole
    model), ``<name>.pp<M>.s<stage>.tp<N>.r<rank>.s<segment>`` (both).
    """
    if tensor_parallel < 1 or pipeline_parallel < 1:
        raise SplitError(f"parallel degrees must be >= 1, got tp={tensor_parallel} pp={pipeline_parallel}")
    if tensor_parallel == 1:
        result = split_pipeline_parallel(model, pipeline_parallel, name=name)
        return LayoutSplit(result, tuple((shard.name,) for shard in result.plan.shards()))
    if pipeline_parallel == 1:
        result = split_tensor_parallel(model, tensor_parallel, name=name)
        return LayoutSplit(result, _rank_slots(result.plan, tensor_parallel))
    stages = split_pipeline_parallel(model, pipeline_parallel, name=name)
    segments: list[Segment] = []
    models: dict[str, onnx.ModelProto] = {}
    slots: list[tuple[str, ...]] = []
    fallbacks = []
    for stage in stages.plan.shards():
        sub = split_tensor_parallel(stages.models[stage.name], tensor_parallel, name=stage.name)
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
    return LayoutSplit(SplitResult(plan, models), tuple(slots))


def _rank_slots(plan: Plan, n: int) -> list[tuple[str, ...]]:
    return [tuple(shard.name for shard in plan.shards() if shard.rank == rank) for rank in range(n)]
