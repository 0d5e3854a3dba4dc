"""Pipeline-parallel splitting: balanced stages, numerics, and the
Extractor traps (live tensors across cuts, shared initializers, missing
value_info, names captured by subgraphs, incomplete cuts)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx.utils import Extractor

from splitter import SplitError, pipeline, split_pipeline_parallel, verify_split
from splitter.graph import GraphView, prepare
from splitter.plan import Collective
from splitter.shards import SplitResult
from tests.fixtures import split_graphs

TORCH_MODEL = Path(__file__).resolve().parents[2] / "fixtures" / "torch_transformer.onnx"


def split_and_verify(model: onnx.ModelProto, m: int, name: str = "m") -> SplitResult:
    result = split_pipeline_parallel(model, m, name=name)
    report = verify_split(model, result)
    assert report.max_abs_error <= 1e-4, report.per_output
    assert len(result.plan.segments) == m
    assert [seg.shards[0].name for seg in result.plan.segments] == [f"{name}.pp{m}.s{k}" for k in range(m)]
    for model_ in result.models.values():
        onnx.checker.check_model(model_)
    return result


@pytest.mark.parametrize("m", [2, 3])
@pytest.mark.parametrize(
    "build", [split_graphs.mlp, split_graphs.mha_computed, split_graphs.fused_qkv, split_graphs.transformer, split_graphs.skip]
)
def test_matches_unsplit(build, m: int) -> None:
    result = split_and_verify(build(), m)
    for seg in result.plan.segments:
        assert all(b.collective is Collective.NONE and not b.per_rank for b in seg.boundaries)


def test_stages_are_balanced_by_weight_bytes() -> None:
    result = split_and_verify(split_graphs.transformer(layers=4), 4)
    shares = list(result.plan.weight_shares().values())
    # embeddings + 4 equal layers into 4 stages: no stage far above a quarter
    assert max(shares) < 0.36
    assert sum(shares) == pytest.approx(1.0, abs=1e-3)  # small shared constants are copied


def test_live_tensor_crosses_two_cuts_and_tied_weight_is_copied() -> None:
    model = split_graphs.skip()
    result = split_and_verify(model, 3)
    first = model.graph.node[2].output[0]  # the skip branch, read only by the last layer
    stages = result.plan.segments
    assert first in [spec.name for spec in stages[0].shards[0].outputs]
    assert first not in [spec.name for spec in stages[1].shards[0].inputs]
    assert first in [spec.name for spec in stages[2].shards[0].inputs]
    tied = model.graph.node[0].input[1]
    holders = [name for name, m in result.models.items() if tied in {t.name for t in m.graph.initializer}]
    assert holders == ["m.pp3.s0", "m.pp3.s2"]
    assert sum(result.plan.weight_shares().values()) > 1.0  # the tied weight is held twice


def test_boundaries_without_inferred_shapes_get_probed_value_info(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_inference(model: onnx.ModelProto, *args: object, **kwargs: object) -> onnx.ModelProto:
        raise RuntimeError("inference unavailable")

    monkeypatch.setattr(onnx.shape_inference, "infer_shapes", no_inference)
    result = split_and_verify(split_graphs.transformer(), 2)
    assert result.plan.segments[0].shards[0].outputs[0].shape[-1] == 64


def test_names_captured_by_subgraphs_are_kept() -> None:
    split_and_verify(split_graphs.with_if(), 1)
    split_and_verify(split_graphs.with_if(), 2)


def test_incomplete_cut_is_detected() -> None:
    view = GraphView(prepare(split_graphs.mlp()))
    inferred = onnx.shape_inference.infer_shapes(view.model)
    # stage [4:] given the model input instead of the tensor it reads: Extractor
    # walks back into the first stage's nodes
    extracted = Extractor(inferred).extract_model(["x"], [view.outputs[0]])
    with pytest.raises(SplitError, match=f"pulled in node '{view.nodes[0].name}'"):
        pipeline._check_stray(1, extracted, view.nodes[4:])
    complete = Extractor(inferred).extract_model([view.nodes[3].output[0]], [view.outputs[0]])
    pipeline._check_stray(1, complete, view.nodes[4:])


def test_more_stages_than_weights_is_refused() -> None:
    with pytest.raises(SplitError, match="only 6 nodes carry weights"):
        split_pipeline_parallel(split_graphs.mlp(), 7, name="m")


def test_linear_partition_minimises_the_heaviest_stage() -> None:
    sizes = np.array([5.0, 1, 1, 1, 1, 1, 5])
    starts = pipeline._linear_partition(sizes, np.zeros(7), 3)
    loads = [sizes[a:b].sum() for a, b in zip(starts, starts[1:] + [7])]
    assert max(loads) == 5.0
    # with equal loads possible, the cheaper cut wins
    costs = np.array([0.0, 9, 9, 9, 1, 9, 9])
    assert pipeline._linear_partition(np.ones(7), costs, 2) == [0, 4]


def test_torch_export() -> None:
    result = split_and_verify(onnx.load(str(TORCH_MODEL)), 2, name="torch")
    shares = list(result.plan.weight_shares().values())
    assert max(shares) < 0.6
