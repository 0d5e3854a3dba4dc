"""Tests for models/build.py and models/graphs.py: the example repository's graphs, configs and CLI."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from infergate.cli import main as cli_main
from models.build import build_repository
from models.graphs import D_MODEL, MAX_SEQ_LEN, VOCAB_SIZE

NUMERIC_NAMES = ["simple", "mlp", "cnn", "encoder"]
STRING_NAMES = ["identity_string", "string_to_int"]
CLASSIFY_STEPS = ["preprocess", "postprocess"]
ONNX_NAMES = NUMERIC_NAMES + STRING_NAMES + CLASSIFY_STEPS
ENSEMBLE_NAMES = ["classify"]  # config only; see test_classify_models.py
SEQUENCE_NAMES = [
    "simple_sequence", "simple_dyna_sequence", "simple_string_dyna_sequence", "accumulate", "accumulate_seeded",
]  # see test_sequence_models.py
PYTHON_NAMES = ["square_int32", "repeat_int32"]  # config.pbtxt + 1/model.py; see tests/unit/models/test_python_models.py
GENERATIVE_NAMES = ["tiny_lm"]  # backend "generate"; see tests/unit/models/test_decoder_model.py
EXPECTED_NAMES = ONNX_NAMES + ENSEMBLE_NAMES + SEQUENCE_NAMES + PYTHON_NAMES + GENERATIVE_NAMES

# name -> (max_batch_size, dynamic_batching, inputs, outputs); tensors as (name, type, dims).
EXPECTED_CONFIGS: dict[str, tuple[int, bool, list[tuple[str, int, list[int]]], list[tuple[str, int, list[int]]]]] = {
    "simple": (
        8,
        False,
        [("INPUT0", mc.TYPE_INT32, [16]), ("INPUT1", mc.TYPE_INT32, [16])],
        [("OUTPUT0", mc.TYPE_INT32, [16]), ("OUTPUT1", mc.TYPE_INT32, [16])],
    ),
    "mlp": (64, True, [("INPUT", mc.TYPE_FP32, [64])], [("OUTPUT", mc.TYPE_FP32, [10])]),
    "cnn": (32, True, [("IMAGE", mc.TYPE_FP32, [3, 32, 32])], [("PROBS", mc.TYPE_FP32, [10])]),
    "encoder": (16, True, [("TOKENS", mc.TYPE_INT64, [-1])], [("HIDDEN", mc.TYPE_FP32, [-1, D_MODEL])]),
    "identity_string": (0, False, [("INPUT0", mc.TYPE_STRING, [-1])], [("OUTPUT0", mc.TYPE_STRING, [-1])]),
    "string_to_int": (8, True, [("INPUT0", mc.TYPE_STRING, [1])], [("OUTPUT0", mc.TYPE_INT64, [1])]),
    "preprocess": (32, True, [("IMAGE", mc.TYPE_UINT8, [32, 32, 3])], [("PIXELS", mc.TYPE_FP32, [3, 32, 32])]),
    "postprocess": (32, True, [("PROBS", mc.TYPE_FP32, [10])],
                    [("SCORES", mc.TYPE_FP32, [3]), ("CLASSES", mc.TYPE_INT64, [3])]),
}

NUMPY_DTYPES = {mc.TYPE_INT32: np.int32, mc.TYPE_INT64: np.int64, mc.TYPE_FP32: np.float32}


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("repo")
    assert build_repository(path) == EXPECTED_NAMES
    return path


def _config(repo: Path, name: str) -> mc.ModelConfig:
    return text_format.Parse((repo / name / "config.pbtxt").read_text(), mc.ModelConfig())


def _session(repo: Path, name: str) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(str(repo / name / "1" / "model.onnx"), options, providers=["CPUExecutionProvider"])


def _random_inputs(config: mc.ModelConfig, batch: int, seed: int, seq_len: int = 7) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {}
    for tensor in config.input:
        shape = [batch] + [seq_len if d == -1 else d for d in tensor.dims]
        if tensor.data_type == mc.TYPE_FP32:
            feeds[tensor.name] = rng.standard_normal(shape).astype(np.float32)
        else:
            high = VOCAB_SIZE if config.name == "encoder" else 1000
            feeds[tensor.name] = rng.integers(-high if tensor.data_type == mc.TYPE_INT32 else 0, high, shape).astype(
                NUMPY_DTYPES[tensor.data_type]
            )
    return feeds


def test_build_is_deterministic(repo: Path, tmp_path: Path) -> None:
    build_repository(tmp_path)
    first = sorted(p.relative_to(repo) for p in repo.rglob("*") if p.is_file())
    second = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert first == second
    assert len(first) == 2 * len(ONNX_NAMES) + len(ENSEMBLE_NAMES) + 2 * len(SEQUENCE_NAMES) + 1 + 2 * len(PYTHON_NAMES) + 2 * len(GENERATIVE_NAMES)  # + seed.bin
    for rel in first:
        assert (repo / rel).read_bytes() == (tmp_path / rel).read_bytes(), rel


def test_rebuild_in_place_keeps_files(repo: Path, tmp_path: Path) -> None:
    build_repository(tmp_path)
    onnx_path = tmp_path / "mlp" / "1" / "model.onnx"
    onnx_path.write_bytes(b"stale")
    build_repository(tmp_path)
    assert onnx_path.read_bytes() == (repo / "mlp" / "1" / "model.onnx").read_bytes()
    assert not list(tmp_path.rglob("*.tmp"))


@pytest.mark.parametrize("name", ONNX_NAMES)
def test_config_fields(repo: Path, name: str) -> None:
    config = _config(repo, name)
    max_batch_size, dynamic, inputs, outputs = EXPECTED_CONFIGS[name]
    assert config.name == name
    assert config.platform == "onnxruntime_onnx"
    assert config.backend == "onnxruntime"
    assert config.max_batch_size == max_batch_size
    assert config.HasField("dynamic_batching") == dynamic
    assert [(t.name, t.data_type, list(t.dims)) for t in config.input] == inputs
    assert [(t.name, t.data_type, list(t.dims)) for t in config.output] == outputs
    assert not config.instance_group  # the server picks its instances


@pytest.mark.parametrize("name", NUMERIC_NAMES)
def test_graph_matches_config_and_runs(repo: Path, name: str) -> None:
    model = onnx.load(str(repo / name / "1" / "model.onnx"))
    onnx.checker.check_model(model, full_check=True)
    assert model.ir_version == 10
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 17)]

    config = _config(repo, name)
    session = _session(repo, name)
    assert [i.name for i in session.get_inputs()] == [t.name for t in config.input]
    assert [o.name for o in session.get_outputs()] == [t.name for t in config.output]
    for meta, tensor in zip(session.get_inputs() + session.get_outputs(), list(config.input) + list(config.output)):
        # The batch dim is symbolic; the rest agree with config dims (-1 <-> symbolic).
        assert isinstance(meta.shape[0], str)
        assert [d if isinstance(d, int) else -1 for d in meta.shape[1:]] == list(tensor.dims)

    batch = 3
    feeds = _random_inputs(config, batch, seed=5)
    results = session.run(None, feeds)
    for result, tensor in zip(results, config.output):
        assert result.dtype == NUMPY_DTYPES[tensor.data_type]
        assert result.shape[0] == batch
        assert np.all(np.isfinite(result))
    # Rows are independent, so dynamic batching cannot change an answer.
    for row in range(batch):
        alone = session.run(None, {k: v[row : row + 1] for k, v in feeds.items()})
        for batched, single in zip(results, alone):
            np.testing.assert_allclose(batched[row : row + 1], single, rtol=1e-5, atol=1e-5)


def test_string_models_run(repo: Path) -> None:
    for name in STRING_NAMES:
        onnx.checker.check_model(onnx.load(str(repo / name / "1" / "model.onnx")), full_check=True)
    words = np.array(["", "A", "h\u00e9llo", "\u65e5\u672c"], dtype=np.object_)
    (same,) = _session(repo, "identity_string").run(None, {"INPUT0": words})
    assert same.tolist() == words.tolist()
    (numbers,) = _session(repo, "string_to_int").run(None, {"INPUT0": np.array([["42"], ["-7"]], dtype=np.object_)})
    assert numbers.dtype == np.int64 and numbers.tolist() == [[42], [-7]]


def test_simple_math(repo: Path) -> None:
    session = _session(repo, "simple")
    a = np.arange(32, dtype=np.int32).reshape(2, 16)
    b = np.full((2, 16), 7, dtype=np.int32)
    out0, out1 = session.run(["OUTPUT0", "OUTPUT1"], {"INPUT0": a, "INPUT1": b})
    np.testing.assert_array_equal(out0, a + b)
    np.testing.assert_array_equal(out1, a - b)


def test_cnn_outputs_probabilities(repo: Path) -> None:
    session = _session(repo, "cnn")
    (probs,) = session.run(None, _random_inputs(_config(repo, "cnn"), batch=4, seed=1))
    assert np.all(probs >= 0)
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, rtol=1e-5)
    assert probs.std(axis=1).min() > 1e-4, "softmax output should not be uniform"


@pytest.mark.parametrize("seq_len", [1, 5, MAX_SEQ_LEN])
def test_encoder_sequence_lengths(repo: Path, seq_len: int) -> None:
    session = _session(repo, "encoder")
    tokens = np.random.default_rng(seq_len).integers(0, VOCAB_SIZE, (2, seq_len), dtype=np.int64)
    (hidden,) = session.run(None, {"TOKENS": tokens})
    assert hidden.shape == (2, seq_len, D_MODEL)
    assert np.all(np.isfinite(hidden))


def test_encoder_uses_positions_and_context(repo: Path) -> None:
    session = _session(repo, "encoder")
    same = np.full((1, 4), 42, dtype=np.int64)
    (hidden,) = session.run(None, {"TOKENS": same})
    # Identical tokens at different positions must differ (positional embedding).
    assert not np.allclose(hidden[0, 0], hidden[0, 1], atol=1e-3)
    changed = same.copy()
    changed[0, 3] = 7
    (hidden2,) = session.run(None, {"TOKENS": changed})
    # Changing a later token changes an earlier position's state (unmasked attention).
    assert not np.allclose(hidden[0, 0], hidden2[0, 0], atol=1e-4)


def test_dense_weights_are_2d_initializers(repo: Path) -> None:
    for name in ("mlp", "encoder"):
        graph = onnx.load(str(repo / name / "1" / "model.onnx")).graph
        initializers = {t.name: t for t in graph.initializer}
        matmuls = [n for n in graph.node if n.op_type == "MatMul" and n.input[1] in initializers]
        assert matmuls, name
        assert all(len(initializers[n.input[1]].dims) == 2 for n in matmuls)
    encoder = onnx.load(str(repo / "encoder" / "1" / "model.onnx")).graph
    initializers = {t.name: onnx.numpy_helper.to_array(t) for t in encoder.initializer}
    reshape_shapes = [initializers[n.input[1]].tolist() for n in encoder.node if n.op_type == "Reshape"]
    assert reshape_shapes.count([0, 0, 4, 16]) == 6
    assert reshape_shapes.count([0, 0, D_MODEL]) == 2


def test_cli_build_and_list(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["models", "build", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(EXPECTED_NAMES)
    assert cli_main(["models", "list", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "simple: max_batch_size=8 inputs=[INPUT0:INT32[16], INPUT1:INT32[16]]" in out
    assert "encoder: max_batch_size=16 dynamic_batching" in out
    assert cli_main(["models", "list", str(tmp_path / "missing")]) == 1
