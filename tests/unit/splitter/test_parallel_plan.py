"""plan.json, the fused-piece layout arithmetic, and the written repository."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from splitter import Plan, load_split, shard_config, split_pipeline_parallel, split_tensor_parallel, write_split
from splitter.layout import map_sharded_axis, shard_slice
from splitter.plan import Collective, gather_pieces
from tests.fixtures import split_graphs


@pytest.mark.parametrize("pieces", [(12,), (4, 4, 4), (2, 6, 4)])
@pytest.mark.parametrize("axis", [0, 1])
def test_gather_pieces_inverts_shard_slice(pieces: tuple[int, ...], axis: int) -> None:
    shape = [3, 3]
    shape[axis] = 2 * sum(pieces)  # two periods: a head axis merged with the batch
    full = np.arange(np.prod(shape)).reshape(shape)
    parts = [shard_slice(full, axis, 2, r, pieces) for r in range(2)]
    assert parts[0].shape[axis] == sum(pieces)
    np.testing.assert_array_equal(gather_pieces(parts, axis, pieces), full)
    assert not np.array_equal(np.concatenate(parts, axis=axis), full)


def test_map_sharded_axis_follows_heads_through_reshapes() -> None:
    runs = lambda *shapes: tuple(shapes)  # noqa: E731 - two probe runs
    # [B, S, 64] sharded on 64 -> [B, S, 4, 16]: heads carry the shard
    assert map_sharded_axis(runs((2, 3, 64), (3, 5, 64)), runs((2, 3, 4, 16), (3, 5, 4, 16)), 2, 64, 2) == (2, 4)
    # and back
    assert map_sharded_axis(runs((2, 3, 4, 16), (3, 5, 4, 16)), runs((2, 3, 64), (3, 5, 64)), 2, 4, 2) == (2, 64)
    # heads merged into the batch: one piece of 4 repeated B times
    assert map_sharded_axis(runs((2, 4, 3, 16), (3, 4, 5, 16)), runs((8, 3, 16), (12, 5, 16)), 1, 4, 2) == (0, 4)
    # 3 heads cannot be split in 2; head_dim (the minor factor) is never sharded
    assert map_sharded_axis(runs((2, 3, 48), (3, 5, 48)), runs((2, 3, 3, 16), (3, 5, 3, 16)), 2, 48, 2) is None


def test_plan_json_round_trip() -> None:
    result = split_tensor_parallel(split_graphs.fused_qkv(), 2, name="fq")
    text = result.plan.to_json()
    again = Plan.from_json(text)
    assert again == result.plan
    assert again.to_json() == text
    assert all(b.collective in Collective for seg in again.segments for b in seg.boundaries)
    with pytest.raises(ValueError, match="format"):
        Plan.from_json(text.replace('"format": 1', '"format": 99'))


def test_written_repository_loads_back_and_configs_match_models(tmp_path: Path) -> None:
    model = split_graphs.mha_computed()
    result = split_tensor_parallel(model, 2, name="mha")
    plan_path = write_split(result, tmp_path)
    assert plan_path == tmp_path / "plan.json"
    loaded = load_split(tmp_path)
    assert loaded.plan == result.plan
    for shard in loaded.plan.shards():
        onnx.checker.check_model(loaded.models[shard.name])
        config = text_format.Parse((tmp_path / shard.name / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
        assert config == shard_config(shard)
        assert config.name == shard.name and config.max_batch_size == 0
        graph = loaded.models[shard.name].graph
        assert [i.name for i in config.input] == [i.name for i in graph.input]
        assert [o.name for o in config.output] == [o.name for o in graph.output]
        for value, declared in zip(graph.input, config.input):
            dims = [d.dim_value if d.HasField("dim_value") else -1 for d in value.type.tensor_type.shape.dim]
            assert dims == list(declared.dims)


def test_shard_specs_carry_local_shapes() -> None:
    plan = split_tensor_parallel(split_graphs.mlp(), 2, name="mlp").plan
    first = plan.segments[0]
    # the column-split hidden layer is not an output; the row-split partial is, full width
    assert [(s.name, s.shape) for s in first.shards[0].outputs] == [(first.boundaries[0].name, (-1, 64))]
    assert first.boundaries[0].collective is Collective.ALLREDUCE_SUM
    assert plan.inputs[0].shape == (-1, 64) and plan.outputs[0].datatype == "FP32"


def test_pipeline_plan_has_one_rank_per_stage() -> None:
    plan = split_pipeline_parallel(split_graphs.mlp(), 2, name="mlp").plan
    assert plan.ranks == 1 and plan.pipeline_parallel == 2 and plan.kind == "pipeline"
    assert Plan.from_json(plan.to_json()) == plan
