"""Triton's classification extension through ``infergate up``: an output
requested with ``classification: K`` (HTTP ``parameters``, gRPC
``class_count``) comes back as its top K "value:index:label" strings, labels
read from the model's ``label_filename``.

Model: a copy of the example ``mlp`` (FP32 [64] -> FP32 [10], batching) whose
output names a labels file; expected answers come from the plain output of
the same request.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcclient_aio
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.harness import Proc, start
from tests.integration.gateway.e2e_cluster import grpc_url, http_url

pytestmark = pytest.mark.timeout(240)

LABELS = [f"class-{i}" for i in range(10)]


@pytest.fixture(scope="module")
def cluster(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    repo = tmp_path_factory.mktemp("classification-repo")
    shutil.copytree(model_repo / "mlp", repo / "mlp")
    (repo / "mlp" / "labels.txt").write_text("\n".join(LABELS) + "\n")
    config = (repo / "mlp" / "config.pbtxt").read_text()
    (repo / "mlp" / "config.pbtxt").write_text(
        config.replace('name: "OUTPUT"\n', 'name: "OUTPUT"\n  label_filename: "labels.txt"\n', 1))
    proc = start(["up", "--workers", "1", "--model-repository", str(repo), "--http-port", "0", "--grpc-port", "0"])
    try:
        yield proc
    finally:
        proc.stop()


def _batch(rows: int = 3) -> np.ndarray:
    return np.random.default_rng(7).standard_normal((rows, 64)).astype(np.float32)


def _expected(probs: np.ndarray, k: int) -> list[list[str]]:
    rows = []
    for row in probs:
        order = np.argsort(-row, kind="stable")[:k]
        rows.append([f"{row[i]:f}:{i}:{LABELS[i]}" for i in order])
    return rows


def _http_infer(proc: Proc, data: np.ndarray, params: dict | None, binary: bool = False) -> np.ndarray:
    client = httpclient.InferenceServerClient(http_url(proc))
    try:
        tensor = httpclient.InferInput("INPUT", list(data.shape), "FP32")
        tensor.set_data_from_numpy(data)
        out = httpclient.InferRequestedOutput("OUTPUT", binary_data=binary, class_count=(params or {}).get("k", 0))
        return client.infer("mlp", [tensor], outputs=[out]).as_numpy("OUTPUT")
    finally:
        client.close()


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_http_top_k_with_labels(cluster: Proc, binary: bool) -> None:
    data = _batch()
    probs = _http_infer(cluster, data, None)
    got = _http_infer(cluster, data, {"k": 3}, binary=binary)
    assert got.shape == (3, 3)
    decoded = [[v.decode() if isinstance(v, bytes) else v for v in row] for row in got.tolist()]
    assert decoded == _expected(probs, 3)


def test_grpc_class_count_and_k_beyond_the_row(cluster: Proc) -> None:
    data = _batch(2)
    client = grpcclient.InferenceServerClient(grpc_url(cluster))
    try:
        tensor = grpcclient.InferInput("INPUT", list(data.shape), "FP32")
        tensor.set_data_from_numpy(data)
        probs = client.infer("mlp", [tensor]).as_numpy("OUTPUT")
        result = client.infer("mlp", [tensor], outputs=[grpcclient.InferRequestedOutput("OUTPUT", class_count=50)])
        got = result.as_numpy("OUTPUT")
        assert result.get_output("OUTPUT").datatype == "BYTES"
        assert got.shape == (2, 10)  # k is at most the row's 10 classes
        assert [[v.decode() for v in row] for row in got.tolist()] == _expected(probs, 10)
    finally:
        client.close()


async def test_aio_grpc_classification_beside_a_plain_request(cluster: Proc) -> None:
    """Requests with and without classification share batches; each gets its own form back."""
    import asyncio

    client = grpcclient_aio.InferenceServerClient(grpc_url(cluster))
    try:
        data = _batch(1)
        tensor = grpcclient_aio.InferInput("INPUT", [1, 64], "FP32")
        tensor.set_data_from_numpy(data)
        plain, top = await asyncio.gather(
            client.infer("mlp", [tensor]),
            client.infer("mlp", [tensor], outputs=[grpcclient_aio.InferRequestedOutput("OUTPUT", class_count=1)]),
        )
        assert plain.as_numpy("OUTPUT").shape == (1, 10)
        assert [v.decode() for v in top.as_numpy("OUTPUT")[0]] == _expected(plain.as_numpy("OUTPUT"), 1)[0]
    finally:
        await client.close()


def test_classification_errors(cluster: Proc) -> None:
    client = httpclient.InferenceServerClient(http_url(cluster))
    try:
        tensor = httpclient.InferInput("INPUT", [1, 64], "FP32")
        tensor.set_data_from_numpy(_batch(1))
        out = httpclient.InferRequestedOutput("OUTPUT")
        out._parameters["classification"] = "three"
        with pytest.raises(InferenceServerException, match="Unable to set 'classification'"):
            client.infer("mlp", [tensor], outputs=[out])
        extensions = client.get_server_metadata()["extensions"]
        assert "classification" in extensions
    finally:
        client.close()
