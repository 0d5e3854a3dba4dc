"""Model families that tiny fixed probe sizes get wrong: a conv text
recognizer (sequence = width / 8), a recurrent model with a scalar sample
rate and a state batched on axis 1, a conv encoder-decoder. Each split
(TP2, TP4, PP2, TP2 x PP2) equals ONNX Runtime on the unsplit model at sizes
neither the probe nor the verification used, and every shard's declared
signature keeps the dims that follow an input size dynamic."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
import pytest

from splitter import SplitError, SplitResult, run_plan, split_pipeline_parallel, split_tensor_parallel, verify_split
from splitter.layout_split import split_layout
from splitter.sizes import InputHints
from tests.fixtures import model_families

TOLERANCE = 1e-4
SR = np.array(model_families.SAMPLE_RATE, dtype=np.int64)
RECURRENT_HINTS = InputHints(shapes={"audio": ("batch", ("samples", 256))}, values={"sr": SR})


def split(model: onnx.ModelProto, layout: str, hints: InputHints | None) -> SplitResult:
    if layout == "tp2":
        return split_tensor_parallel(model, 2, name="m", hints=hints)
    if layout == "tp4":
        return split_tensor_parallel(model, 4, name="m", hints=hints)
    if layout == "pp2":
        return split_pipeline_parallel(model, 2, name="m", hints=hints)
    return split_layout(model, 2, 2, name="m", hints=hints).result


def recognizer_inputs(rng: np.random.Generator) -> list[dict[str, np.ndarray]]:
    return [{"image": rng.standard_normal((rows, 3, 48, width)).astype(np.float32)}
            for rows, width in [(1, 100), (2, 200), (3, 320), (1, 57)]]


def recurrent_inputs(rng: np.random.Generator) -> list[dict[str, np.ndarray]]:
    return [{"audio": rng.standard_normal((rows, samples)).astype(np.float32), "sr": SR,
             "state": rng.standard_normal((2, rows, model_families.RECURRENT_HIDDEN)).astype(np.float32)}
            for rows, samples in [(1, 512), (3, 1024), (2, 2048)]]


def encoder_decoder_inputs(rng: np.random.Generator) -> list[dict[str, np.ndarray]]:
    return [{"image": rng.standard_normal((rows, 3, h, w)).astype(np.float32)}
            for rows, h, w in [(1, 64, 100), (2, 36, 76), (1, 128, 20)]]


FAMILIES: dict[str, tuple[Callable[[], onnx.ModelProto], InputHints | None, Callable[..., list[dict[str, np.ndarray]]]]] = {
    "recognizer": (model_families.recognizer, None, recognizer_inputs),
    "recurrent": (model_families.recurrent, RECURRENT_HINTS, recurrent_inputs),
    "encoder_decoder": (model_families.encoder_decoder, None, encoder_decoder_inputs),
}


def reference(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds)))


@pytest.mark.parametrize("layout", ["tp2", "tp4", "pp2", "tp2xpp2"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_split_equals_unsplit_at_unseen_sizes(family: str, layout: str) -> None:
    build, hints, inputs = FAMILIES[family]
    model = build()
    result = split(model, layout, hints)
    report = verify_split(model, result)
    assert report.ok(TOLERANCE), (report.per_output, report.signature_errors)
    assert len(report.runs) >= 2
    seen = [run.input_shapes for run in report.runs]
    for feeds in inputs(np.random.default_rng(7)):
        assert {k: tuple(v.shape) for k, v in feeds.items()} not in seen, "pick sizes verify did not use"
        want = reference(model, feeds)
        got = run_plan(result.plan, result.models, feeds)
        for name, array in want.items():
            assert got[name].shape == array.shape, name
            np.testing.assert_allclose(got[name], array, atol=TOLERANCE, rtol=0, err_msg=f"{family} {layout} {name}")


def test_width_dependent_dims_stay_dynamic_in_every_shard() -> None:
    """The recognizer's sequence (width / 8) is 1 at any width below 8: it
    must not be frozen into a stage's signature, nor into the tensor specs."""
    model = model_families.recognizer()
    result = split_pipeline_parallel(model, 2, name="rec")
    stage = result.plan.shards()[1]
    (boundary,) = stage.inputs
    assert boundary.shape == (-1, -1, 240)
    graph_input = result.models[stage.name].graph.input[0]
    dims = graph_input.type.tensor_type.shape.dim
    assert not dims[1].HasField("dim_value") and dims[2].dim_value == 240
    for shard in split_tensor_parallel(model, 2, name="rec").plan.shards():
        for spec in (*shard.inputs, *shard.outputs):
            if spec.name != "image":
                assert spec.shape[:2] == (-1, -1), (shard.name, spec)


def test_recurrent_state_batch_on_axis_one_stays_dynamic() -> None:
    result = split_tensor_parallel(model_families.recurrent(), 2, name="vad", hints=RECURRENT_HINTS)
    specs = {spec.name: spec.shape for shard in result.plan.shards() for spec in (*shard.inputs, *shard.outputs)}
    assert specs["state"] == (2, -1, model_families.RECURRENT_HIDDEN)
    assert specs["sr"] == ()
    assert {spec.name: spec.shape for spec in result.plan.outputs}["state_out"] == (2, -1, model_families.RECURRENT_HIDDEN)


def test_recurrent_without_values_says_what_to_pass() -> None:
    with pytest.raises(SplitError) as info:
        split_tensor_parallel(model_families.recurrent(), 2, name="vad")
    message = str(info.value)
    assert "--input-values" in message and "--input-shape" in message
    assert "sr" in message  # the integer input filled at random
    assert "Reshape" in message  # ONNX Runtime names the node that refused


def test_strict_names_the_node_and_what_to_do() -> None:
    with pytest.raises(SplitError) as info:
        split_tensor_parallel(model_families.recognizer(), 2, name="rec", strict=True)
    message = str(info.value)
    assert "(Conv)" in message and "Without --strict" in message and "degree" in message


def test_verify_reports_a_signature_that_refuses_a_size() -> None:
    """A shard declared static where the unsplit model varies fails verification."""
    model = model_families.recognizer()
    result = split_pipeline_parallel(model, 2, name="rec")
    stage = result.plan.shards()[1]
    frozen = type(stage.inputs[0])(stage.inputs[0].name, stage.inputs[0].datatype, (-1, 1, 240))
    plan = result.plan
    segments = list(plan.segments)
    segments[1] = type(segments[1])(1, (type(stage)(stage.name, stage.rank, stage.segment, (frozen,), stage.outputs,
                                                     stage.weight_bytes, stage.path),), segments[1].boundaries)
    broken = SplitResult(type(plan)(**{**{f: getattr(plan, f) for f in plan.__dataclass_fields__}, "segments": tuple(segments)}),
                         result.models, result.sizes)
    report = verify_split(model, broken)
    assert not report.ok() and "declares input" in report.signature_errors[0]


def test_typical_sizes_from_hints_are_verified() -> None:
    model = model_families.recognizer()
    hints = InputHints(shapes={"image": ("batch", 3, 48, ("width", 320))})
    result = split_tensor_parallel(model, 2, name="rec", hints=hints)
    report = verify_split(model, result)
    assert report.ok(TOLERANCE)
    assert 320 in {run.input_shapes["image"][3] for run in report.runs}
