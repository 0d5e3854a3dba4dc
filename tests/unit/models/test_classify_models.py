"""The example ``classify`` ensemble and its steps: ``preprocess`` normalises a
uint8 HWC image into the cnn's CHW input, ``postprocess`` takes the top k,
and the ensemble config chains them in Triton's format (checked by the
gateway's own plan reader)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from gateway.ensembles.plan import build_plan
from models.build import build_repository, example_names
from models.graphs import CHANNEL_MEAN, CHANNEL_STD, TOP_K


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("classify-repo")
    build_repository(path)
    return path


def _session(repo: Path, name: str) -> ort.InferenceSession:
    return ort.InferenceSession(str(repo / name / "1" / "model.onnx"), providers=["CPUExecutionProvider"])


def test_preprocess_normalises_and_transposes(repo: Path) -> None:
    image = np.random.default_rng(0).integers(0, 256, (2, 32, 32, 3), dtype=np.uint8)
    (pixels,) = _session(repo, "preprocess").run(None, {"IMAGE": image})
    expected = ((image / 255.0 - np.array(CHANNEL_MEAN)) / np.array(CHANNEL_STD)).transpose(0, 3, 1, 2)
    assert pixels.dtype == np.float32 and pixels.shape == (2, 3, 32, 32)
    np.testing.assert_allclose(pixels, expected, rtol=1e-5, atol=1e-5)


def test_postprocess_is_top_k(repo: Path) -> None:
    probs = np.random.default_rng(1).random((4, 10), dtype=np.float32)
    scores, classes = _session(repo, "postprocess").run(None, {"PROBS": probs})
    order = np.argsort(-probs, axis=1)[:, :TOP_K]
    np.testing.assert_array_equal(classes, order)
    np.testing.assert_array_equal(scores, np.take_along_axis(probs, order, axis=1))


def test_classify_is_an_ensemble_of_the_three(repo: Path) -> None:
    config = text_format.Parse((repo / "classify" / "config.pbtxt").read_text(), mc.ModelConfig())
    assert config.platform == "ensemble" and (repo / "classify" / "1").is_dir()
    plan = build_plan(config)
    assert [s.model for s in plan.steps] == ["preprocess", "cnn", "postprocess"]
    assert [len(w) for w in plan.waves] == [1, 1, 1]
    assert plan.outputs == ("SCORES", "CLASSES")
    assert "classify" in example_names()
