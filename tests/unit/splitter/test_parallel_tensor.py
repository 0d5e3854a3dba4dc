"""Tensor-parallel splitting: numerics against the unsplit model, weight
shares, fallbacks, and the traps (fused QKV, computed reshape targets,
head counts N does not divide)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from splitter import SplitError, split_tensor_parallel, tensor_weights, verify_split
from splitter.plan import Collective
from splitter.shards import SplitResult
from tests.fixtures import split_graphs

TOLERANCE = 1e-4
TORCH_MODEL = Path(__file__).resolve().parents[2] / "fixtures" / "torch_transformer.onnx"


def split_and_verify(model: onnx.ModelProto, n: int, name: str = "m") -> tuple[SplitResult, list[float]]:
    result = split_tensor_parallel(model, n, name=name)
    report = verify_split(model, result)
    # the check must run at sizes the splitter never saw, several of them
    assert result.sizes is not None and len(report.runs) >= 2
    for run in result.sizes.verify:
        assert all(size not in (result.sizes.probe[0][s], result.sizes.probe[1][s]) for s, size in run.items())
    assert report.max_abs_error <= TOLERANCE, report.per_output
    return result, report.rank_shares


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize(
    "build",
    [
        split_graphs.mlp,
        split_graphs.gemm_mlp,
        split_graphs.mha_constant,
        split_graphs.mha_computed,
        split_graphs.mha_merged_heads,
        split_graphs.fused_qkv,
        split_graphs.transformer,
    ],
)
def test_matches_unsplit_and_shares_weights(build, n: int) -> None:
    result, shares = split_and_verify(build(), n)
    assert len(shares) == n
    assert max(shares) - min(shares) < 1e-9
    # only the last 64x10 layer of the MLP at N=4, biases and norms stay whole
    assert shares[0] <= 1 / n + 0.035
    assert all(len(seg.shards) == n for seg in result.plan.segments)
    assert [s.name for s in result.plan.segments[0].shards] == [f"m.tp{n}.r{r}.s0" for r in range(n)]


def test_attention_is_split_by_heads_without_gathers() -> None:
    for build in (split_graphs.mha_constant, split_graphs.mha_computed, split_graphs.mha_merged_heads, split_graphs.fused_qkv):
        result, _ = split_and_verify(build(), 2)
        assert result.plan.fallbacks == ()
        collectives = [b.collective for seg in result.plan.segments for b in seg.boundaries if b.collective is not Collective.NONE]
        assert set(collectives) == {Collective.ALLREDUCE_SUM}


def test_computed_reshape_target_is_rewritten_with_mask_and_frozen_entries() -> None:
    result, _ = split_and_verify(split_graphs.mha_computed(), 4)
    shard = result.models["m.tp4.r0.s0"]
    reshapes = [node for node in shard.graph.node if node.op_type == "Reshape"]
    inits = {t.name: numpy_helper.to_array(t) for t in shard.graph.initializer}
    frozen = [inits[n.input[1]] for n in shard.graph.node if n.op_type == "Add" and n.input[1] in inits and inits[n.input[1]].dtype == np.int64]
    # [B, S, 4, 16] -> each rank reshapes to [B, S, 1, 16]: batch/seq kept from the shape, heads frozen
    assert any(list(f) == [0, 0, 1, 16] for f in frozen)
    assert len(reshapes) == 4


def test_heads_folded_into_the_batch_divide_the_dynamic_entry() -> None:
    result, _ = split_and_verify(split_graphs.mha_merged_heads(), 2)
    shard = result.models["m.tp2.r0.s0"]
    inits = {t.name: numpy_helper.to_array(t) for t in shard.graph.initializer}
    divisors = [list(inits[n.input[1]]) for n in shard.graph.node if n.op_type == "Div" and n.input[1] in inits]
    # [B*4, S, 16] -> [B*4/2, S, 16] on each rank: the batch-derived entry is halved at run time
    assert [2, 1, 1] in divisors


def test_fused_qkv_weight_holds_each_ranks_block_of_every_piece() -> None:
    model = split_graphs.fused_qkv()
    result, _ = split_and_verify(model, 2)
    qkv_name = model.graph.node[0].input[1]
    full = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == qkv_name))
    node = result.models["m.tp2.r1.s0"].graph.node[0]
    local = numpy_helper.to_array(next(t for t in result.models["m.tp2.r1.s0"].graph.initializer if t.name == node.input[1]))
    expected = np.concatenate([full[:, 32:64], full[:, 96:128], full[:, 160:192]], axis=1)
    np.testing.assert_array_equal(local, expected)


def test_fused_split_without_layout_falls_back_instead_of_going_wrong(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tensor_weights, "fused_layouts", lambda view, probe, n: {})
    result, _ = split_and_verify(split_graphs.fused_qkv(), 2)
    assert any(f.op_type == "Split" and "all-gather" in f.reason for f in result.plan.fallbacks)


@pytest.mark.parametrize(("build", "n"), [(split_graphs.mlp, 3), (split_graphs.mha_constant, 3), (split_graphs.transformer, 3)])
def test_indivisible_degree_replicates_and_says_where(build, n: int) -> None:
    result, shares = split_and_verify(build(), n)
    assert shares == pytest.approx([1.0] * n)
    assert result.plan.fallbacks
    assert all("not divisible by 3" in f.reason for f in result.plan.fallbacks)


def test_head_count_not_divisible_gathers_and_stays_correct() -> None:
    result, shares = split_and_verify(split_graphs.mha_constant(heads=3), 2)  # 48 columns split, 3 heads do not
    assert any(f.op_type == "Reshape" for f in result.plan.fallbacks)
    assert shares[0] == pytest.approx(0.5, abs=0.01)


def test_strict_mode_names_the_node() -> None:
    with pytest.raises(SplitError, match=r"node 'Reshape_\d+' \(Reshape\)"):
        split_tensor_parallel(split_graphs.mha_constant(heads=3), 2, name="m", strict=True)
    with pytest.raises(SplitError, match=r"node 'MatMul_\d+' \(MatMul\).*not divisible"):
        split_tensor_parallel(split_graphs.mlp(), 3, name="m", strict=True)


def test_degree_one_is_the_whole_model_and_bad_degree_is_refused() -> None:
    result, shares = split_and_verify(split_graphs.mlp(), 1)
    assert len(result.plan.segments) == 1 and shares == [1.0]
    with pytest.raises(SplitError):
        split_tensor_parallel(split_graphs.mlp(), 0, name="m")


def test_names_captured_by_a_subgraph_are_replicated_first() -> None:
    result, _ = split_and_verify(split_graphs.with_if(), 2)
    assert any(f.op_type == "If" for f in result.plan.fallbacks)


def test_torch_export() -> None:
    model = onnx.load(str(TORCH_MODEL))
    for n in (2, 4):
        result, shares = split_and_verify(model, n, name="torch")
        assert shares[0] <= 1 / n + 0.02
        # the Slice-based chunk of the fused QKV is split by pieces: only the
        # embedding sum is gathered (for the first LayerNorm)
        assert [f.op_type for f in result.plan.fallbacks] == ["LayerNormalization"]


def test_example_repository_models() -> None:
    graphs = pytest.importorskip("models.graphs")
    for name, model in (("mlp", graphs.build_mlp()), ("encoder", graphs.build_encoder())):
        for n in (2, 4):
            _, shares = split_and_verify(model, n, name=name)
            assert shares[0] < 1 / n + 0.05  # the encoder's position table stays whole
