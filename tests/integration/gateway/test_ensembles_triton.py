"""The example ``classify`` ensemble (preprocess -> cnn -> postprocess) with one
step on a real Triton Inference Server: our worker A serves ``preprocess`` and
the ensemble's config, our worker B serves ``cnn``, and Triton serves
``postprocess`` (its Python backend running the same ONNX graph, as
models/triton.py writes it). The gateway's answers must equal the three ONNX
models run by hand with ONNX Runtime, over HTTP and gRPC, and the Triton step
must really have run on Triton (its own statistics count the rows), and the
ensemble's statistics list its share like any other step's.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from models.triton import build_triton_repository
from tests.harness import Proc, start, start_worker, worker_url
from tests.integration.gateway.test_ensembles import by_hand
from tests.triton_harness import TritonProc, start_triton, triton_available

AVAILABLE, REASON = triton_available()

pytestmark = [
    pytest.mark.triton,
    pytest.mark.timeout(180),
    pytest.mark.skipif(not AVAILABLE, reason=f"no real Triton here: {REASON}"),
]

WAIT_S = 30.0


@pytest.fixture(scope="module")
def fleet(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, TritonProc]]:
    repo_a, repo_b = tmp_path_factory.mktemp("ens-a"), tmp_path_factory.mktemp("ens-b")
    for name in ("preprocess", "classify"):
        shutil.copytree(model_repo / name, repo_a / name)
    shutil.copytree(model_repo / "cnn", repo_b / "cnn")
    repo_triton = tmp_path_factory.mktemp("ens-triton")
    build_triton_repository(model_repo, repo_triton, ["postprocess"])
    procs: list[Proc] = []
    triton = start_triton(repo_triton, models=["postprocess"])
    try:
        procs.append(start_worker(repo_a))
        procs.append(start_worker(repo_b))
        workers = [arg for p in procs for arg in ("--worker", worker_url(p))]
        gateway = start(["gateway", *workers, "--worker", f"triton://{triton.grpc_url}",
                         "--http-port", "0", "--grpc-port", "0"])
        procs.append(gateway)
        yield gateway, triton
    finally:
        for proc in reversed(procs):
            proc.stop(check=False)
        triton.stop()


def _images(seed: int, rows: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (rows, 32, 32, 3), dtype=np.uint8)


def _triton_rows(triton: TritonProc) -> int:
    with grpcclient.InferenceServerClient(triton.grpc_url) as client:
        return sum(s.inference_count for s in client.get_inference_statistics("postprocess").model_stats)


def test_the_ensemble_with_a_triton_step_equals_its_steps_by_hand(
    fleet: tuple[Proc, TritonProc], model_repo: Path
) -> None:
    gateway, triton = fleet
    sent = 0
    for module, url in ((grpcclient, f"127.0.0.1:{gateway.ready['grpc_port']}"),
                        (httpclient, f"127.0.0.1:{gateway.ready['http_port']}")):
        client = module.InferenceServerClient(url)
        try:
            # The gateway learns the Triton worker's models by probing: wait until the ensemble is whole.
            deadline = time.monotonic() + WAIT_S
            while not client.is_model_ready("classify"):
                assert time.monotonic() < deadline, "classify not ready with its postprocess step on Triton"
                time.sleep(0.05)
            for seed, rows in ((1, 1), (2, 3)):
                images = _images(seed, rows)
                want_scores, want_classes = by_hand(model_repo, images)
                image = module.InferInput("IMAGE", list(images.shape), "UINT8")
                image.set_data_from_numpy(images)
                result = client.infer("classify", [image])
                np.testing.assert_allclose(result.as_numpy("SCORES"), want_scores, rtol=1e-5, atol=1e-6)
                np.testing.assert_array_equal(result.as_numpy("CLASSES"), want_classes)
                sent += rows
        finally:
            client.close()
    # Triton counts a request once it has released it, a moment after answering: polled.
    deadline = time.monotonic() + WAIT_S
    while _triton_rows(triton) < sent:
        assert time.monotonic() < deadline, f"Triton ran {_triton_rows(triton)} postprocess rows of {sent}"
        time.sleep(0.05)
    assert _triton_rows(triton) == sent  # every ensemble row's last step ran on Triton, once
    # The gateway's statistics of the ensemble list the Triton step's share like any other step's.
    with grpcclient.InferenceServerClient(f"127.0.0.1:{gateway.ready['grpc_port']}") as client:
        stats = client.get_inference_statistics("classify").model_stats
    assert [(s.name, s.version, s.inference_count, s.execution_count) for s in stats] == [
        ("classify", "1", sent, 4), ("preprocess", "1", sent, 4), ("cnn", "1", sent, 4), ("postprocess", "1", sent, 4)]
