"""A generation model as a logical model's source: told by its backend, split
with sizes that keep ``total = past + new``, shown with its generation signature."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
from tritonclient.grpc import model_config_pb2 as mc

from gateway.parallel.decoder_source import decoder_hints, generation_signature, is_generation_source
from gateway.parallel.logical import PLATFORM, LogicalSpec, signature
from models.decoder import DecoderShape, build_tiny_lm, tiny_lm_config
from models.graphs import build_mlp
from splitter.execute import run_plan
from splitter.layout_split import split_layout
from splitter.sizes import config_shapes

SMALL = DecoderShape(d_model=32, heads=4, layers=2, d_ff=64, max_positions=64)


def test_a_generation_source_is_told_by_its_backend() -> None:
    assert is_generation_source(tiny_lm_config())
    assert not is_generation_source(mc.ModelConfig(name="mlp", platform="onnxruntime_onnx"))
    assert not is_generation_source(None)


def test_hints_keep_the_mask_as_long_as_the_cache_and_the_new_tokens() -> None:
    hints = decoder_hints(build_tiny_lm(SMALL))
    assert hints.shapes["input_ids"] == ("batch", ("new", 2))
    assert hints.shapes["attention_mask"] == ("batch", ("total", 10))
    assert hints.shapes["past_value_1"] == ("batch", 4, ("past", 8), 8)
    assert not decoder_hints(build_mlp())  # another graph: no rule of ours applies


def test_the_hinted_split_runs_a_decode_step_equal_to_the_unsplit_graph() -> None:
    model = build_tiny_lm(SMALL)
    layout = split_layout(model, 2, 1, name="lm_tp2", hints=decoder_hints(model),
                          declared=config_shapes(tiny_lm_config(shape=SMALL)))
    assert {t.name for t in layout.plan.inputs} >= {"input_ids", "attention_mask", "past_key_0"}
    # The split's own verification ran at sizes it did not probe; check one decode step here too.
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(5)
    past = 11
    feeds = {"input_ids": rng.integers(0, 259, (3, 1)), "position_ids": np.full((3, 1), past),
             "attention_mask": np.ones((3, past + 1), dtype=np.int64)}
    for layer in range(SMALL.layers):
        for kind in ("key", "value"):
            feeds[f"past_{kind}_{layer}"] = rng.standard_normal((3, 4, past, 8)).astype(np.float32)
    models = layout.result.models
    outputs = run_plan(layout.plan, models, feeds)
    want = session.run(["logits"], feeds)[0]
    np.testing.assert_allclose(outputs["logits"], want, atol=1e-4, rtol=0)


def test_the_logical_model_shows_the_generation_contract_not_the_step_graph() -> None:
    source = tiny_lm_config()
    spec = LogicalSpec.from_settings("lm_pp2", {"from": "tiny_lm", "pipeline_parallel": 2})
    model = build_tiny_lm(SMALL)
    layout = split_layout(model, 1, 2, name="lm_pp2", hints=decoder_hints(model))
    config, metadata = signature(spec, layout.plan, None, source)
    assert [t.name for t in metadata.inputs] == [t.name for t in source.input]
    assert metadata.inputs[0].datatype == "BYTES" and list(metadata.inputs[0].shape) == [1]
    assert [t.name for t in metadata.outputs] == ["text_output"]
    assert config.model_transaction_policy.decoupled and config.platform == PLATFORM
    assert config.parameters["max_sequences"].string_value == source.parameters["max_sequences"].string_value
    direct_config, _ = generation_signature("lm_pp2", source)
    assert direct_config.name == "lm_pp2" and direct_config.backend == "generate"
