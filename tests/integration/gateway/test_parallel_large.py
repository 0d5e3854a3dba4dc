"""``encoder_large`` split TP2 and PP2 on peer collectives equals the unsplit
model through HTTP and gRPC (slow: builds a ~200 MB model and splits it)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from models.build import build_repository
from tests.harness import Proc, start

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

LOGICAL = {"encoder_large_tp2": "tensor_parallel: 2", "encoder_large_pp2": "pipeline_parallel: 2"}


@pytest.fixture(scope="module")
def large_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("large") / "models"
    build_repository(repo, large=True)
    return repo


@pytest.fixture(scope="module")
def cluster(large_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    config = tmp_path_factory.mktemp("large-config") / "gateway.yaml"
    config.write_text("models:\n" + "".join(f"  {n}: {{from: encoder_large, {s}}}\n" for n, s in LOGICAL.items()))
    proc = start(["up", "--workers", "2", "--model-repository", str(large_repo), "--http-port", "0",
                  "--grpc-port", "0", "--config", str(config)], timeout_s=300)
    try:
        yield proc
    finally:
        proc.stop()


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_encoder_large_splits_equal_the_unsplit_model(cluster: Proc, large_repo: Path, protocol: str) -> None:
    session = ort.InferenceSession(str(large_repo / "encoder_large" / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    module = grpcclient if protocol == "grpc" else httpclient
    port = cluster.ready["grpc_port" if protocol == "grpc" else "http_port"]
    client = module.InferenceServerClient(f"127.0.0.1:{port}", **({"network_timeout": 120} if protocol == "http" else {}))
    try:
        for seed, (rows, seq) in enumerate([(1, 128), (2, 37)]):
            x = np.random.default_rng(seed).integers(0, 1000, size=(rows, seq)).astype(np.int64)
            want = session.run(["HIDDEN"], {"TOKENS": x})[0]
            for name in LOGICAL:
                tensor = module.InferInput("TOKENS", list(x.shape), "INT64")
                tensor.set_data_from_numpy(x)
                got = client.infer(name, [tensor]).as_numpy("HIDDEN")
                np.testing.assert_allclose(got, want, atol=1e-4, rtol=0, err_msg=name)
    finally:
        client.close()
