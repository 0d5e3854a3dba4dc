"""Split models of the families tiny probe sizes got wrong, served end to
end: ``infergate up`` with two workers and a repository holding a conv text
recognizer (sequence = width / 8) and a recurrent model (scalar sample
rate, state batched on axis 1, ``max_batch_size: 0``), declared as TP2 and
PP2 logical models; the recurrent one with ``input_shapes`` and
``input_values`` in the gateway config.

Checked through tritonclient (gRPC): outputs equal ONNX Runtime on the
unsplit model at widths and lengths the splitter never used, and the
recurrent logical model stays unbatched like its source.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient

from tests.fixtures import model_families
from tests.harness import Proc, start

pytestmark = pytest.mark.timeout(180)

TOLERANCE = 1e-4
HIDDEN = model_families.RECURRENT_HIDDEN
RECOGNIZER_CONFIG = """name: "recognizer"
platform: "onnxruntime_onnx"
max_batch_size: 8
input { name: "image" data_type: TYPE_FP32 dims: [3, 48, -1] }
output { name: "logits" data_type: TYPE_FP32 dims: [-1, 40] }
"""
VAD_CONFIG = """name: "vad"
platform: "onnxruntime_onnx"
max_batch_size: 0
input { name: "audio" data_type: TYPE_FP32 dims: [-1, -1] }
input { name: "sr" data_type: TYPE_INT64 dims: [] }
input { name: "state" data_type: TYPE_FP32 dims: [2, -1, 64] }
output { name: "prob" data_type: TYPE_FP32 dims: [-1, 1] }
output { name: "state_out" data_type: TYPE_FP32 dims: [2, -1, 64] }
"""
LOGICAL = {
    "recognizer_tp2": "{from: recognizer, tensor_parallel: 2}",
    "recognizer_pp2": "{from: recognizer, pipeline_parallel: 2}",
    "vad_tp2": "{from: vad, tensor_parallel: 2, input_shapes: {audio: 'batch,samples:256'}, input_values: {sr: sr.npy}}",
}


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("families")
    for name, model, config in (("recognizer", model_families.recognizer(), RECOGNIZER_CONFIG),
                                ("vad", model_families.recurrent(), VAD_CONFIG)):
        (root / "repo" / name / "1").mkdir(parents=True)
        onnx.save(model, str(root / "repo" / name / "1" / "model.onnx"))
        (root / "repo" / name / "config.pbtxt").write_text(config)
    return root


@pytest.fixture(scope="module")
def cluster(repo: Path) -> Iterator[Proc]:
    np.save(repo / "sr.npy", np.array(model_families.SAMPLE_RATE, dtype=np.int64))
    config = repo / "gateway.yaml"
    config.write_text("models:\n" + "".join(f"  {name}: {value}\n" for name, value in LOGICAL.items()))
    proc = start(["up", "--workers", "2", "--model-repository", str(repo / "repo"),
                  "--http-port", "0", "--grpc-port", "0", "--config", str(config)])
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def client(cluster: Proc) -> Iterator[grpcclient.InferenceServerClient]:
    c = grpcclient.InferenceServerClient(f"127.0.0.1:{cluster.ready['grpc_port']}")
    try:
        yield c
    finally:
        c.close()


def session(repo: Path, name: str) -> ort.InferenceSession:
    return ort.InferenceSession(str(repo / "repo" / name / "1" / "model.onnx"), providers=["CPUExecutionProvider"])


def infer(client: grpcclient.InferenceServerClient, model: str, feeds: dict[str, np.ndarray], outputs: list[str]) -> list[np.ndarray]:
    tensors = []
    for name, array in feeds.items():
        datatype = "INT64" if array.dtype == np.int64 else "FP32"
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    result = client.infer(model, tensors, outputs=[grpcclient.InferRequestedOutput(o) for o in outputs])
    return [result.as_numpy(o) for o in outputs]


@pytest.mark.parametrize("model", ["recognizer_tp2", "recognizer_pp2"])
def test_recognizer_split_serves_every_width(client: grpcclient.InferenceServerClient, repo: Path, model: str) -> None:
    reference = session(repo, "recognizer")
    rng = np.random.default_rng(3)
    for rows, width in [(1, 100), (2, 320), (1, 57), (3, 640)]:
        image = rng.standard_normal((rows, 3, 48, width)).astype(np.float32)
        (want,) = reference.run(["logits"], {"image": image})
        (got,) = infer(client, model, {"image": image}, ["logits"])
        assert got.shape == want.shape == (rows, (width + 7) // 8, 40)
        np.testing.assert_allclose(got, want, atol=TOLERANCE, rtol=0, err_msg=f"{model} width {width}")


def test_recurrent_split_with_state_on_axis_one(client: grpcclient.InferenceServerClient, repo: Path) -> None:
    config = client.get_model_config("vad_tp2").config
    assert config.max_batch_size == 0  # follows the source: unbatched
    reference = session(repo, "vad")
    rng = np.random.default_rng(4)
    for rows, samples in [(1, 512), (3, 1024), (2, 4096)]:
        audio = rng.standard_normal((rows, samples)).astype(np.float32)
        state = rng.standard_normal((2, rows, HIDDEN)).astype(np.float32)
        feeds = {"audio": audio, "sr": np.array(model_families.SAMPLE_RATE, dtype=np.int64), "state": state}
        want = reference.run(["prob", "state_out"], feeds)
        got = infer(client, "vad_tp2", feeds, ["prob", "state_out"])
        for g, w, name in zip(got, want, ["prob", "state_out"]):
            np.testing.assert_allclose(g, w, atol=TOLERANCE, rtol=0, err_msg=f"{name} at {rows}x{samples}")
