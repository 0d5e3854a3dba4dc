"""Triton's model_warmup on a real worker with ONNX Runtime: the example
``cnn`` (random-data sample) loads, is READY and serves; ``bad_warmup`` (the
example ``string_to_int`` with a warmup file holding a string that is no
number) fails its load before it is ever READY, and the repository index
says which sample failed and why."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from protos import codec
from tests.harness import Proc, start_worker, worker_url

pytestmark = pytest.mark.timeout(120)

BAD_SAMPLE = """
model_warmup {
  name: "not_a_number"
  batch_size: 1
  inputs { key: "INPUT0" value { data_type: TYPE_STRING dims: 1 input_data_file: "text.bin" } }
}
"""


@pytest.fixture(scope="module")
def worker(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    root = tmp_path_factory.mktemp("warmup-repo")
    shutil.copytree(model_repo / "cnn", root / "cnn")
    shutil.copytree(model_repo / "string_to_int", root / "bad_warmup")
    config = (root / "bad_warmup" / "config.pbtxt").read_text().replace('name: "string_to_int"', 'name: "bad_warmup"')
    (root / "bad_warmup" / "config.pbtxt").write_text(config + BAD_SAMPLE)
    (root / "bad_warmup" / "warmup").mkdir()
    (root / "bad_warmup" / "warmup" / "text.bin").write_bytes(codec.serialize_bytes_tensor(np.array([b"abc"], dtype=object)))
    proc = start_worker(root)
    try:
        yield proc
    finally:
        proc.stop()


def test_a_warmed_up_model_is_ready_and_serves(worker: Proc, model_repo: Path) -> None:
    assert "model_warmup" in (model_repo / "cnn" / "config.pbtxt").read_text()
    with grpcclient.InferenceServerClient(worker_url(worker)) as client:
        assert client.is_model_ready("cnn")
        image = np.zeros((1, 3, 32, 32), dtype=np.float32)
        inp = grpcclient.InferInput("IMAGE", list(image.shape), "FP32")
        inp.set_data_from_numpy(image)
        assert client.infer("cnn", [inp]).as_numpy("PROBS").shape == (1, 10)
        # The warmup runs are not requests.
        assert client.get_inference_statistics("cnn").model_stats[0].execution_count == 1


def test_a_refused_warmup_sample_fails_the_load(worker: Proc) -> None:
    with grpcclient.InferenceServerClient(worker_url(worker)) as client:
        assert not client.is_model_ready("bad_warmup")
        rows = {m.name: m for m in client.get_model_repository_index().models}
        assert rows["bad_warmup"].state == "UNAVAILABLE"
        assert "warmup sample 'not_a_number' failed on version 1" in rows["bad_warmup"].reason
