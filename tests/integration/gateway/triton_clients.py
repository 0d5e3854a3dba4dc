"""Client-side helpers of the tests that put the gateway in front of a real
Triton server (test_triton_gateway.py): tritonclient clients, inputs and
reference checks, a server's own inference counts, bounded polling."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from models.triton import python_model_source

WAIT_S = 30.0
Module = Any  # tritonclient.grpc or tritonclient.http
Client = Any


def grpc_client(url: str) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(url)


def http_client(url: str) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(url)


def mlp_input(rows: int, seed: int) -> dict[str, np.ndarray]:
    return {"INPUT": np.random.default_rng(seed).standard_normal((rows, 64)).astype(np.float32)}


def infer(module: Module, client: Client, model: str, feeds: dict[str, np.ndarray], **kwargs: Any) -> Any:
    datatypes = {np.dtype(np.float32): "FP32", np.dtype(np.int32): "INT32", np.dtype(np.int64): "INT64"}
    inputs = []
    for name, array in feeds.items():
        tensor = module.InferInput(name, list(array.shape), datatypes[array.dtype])
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return client.infer(model, inputs, **kwargs)


def assert_outputs(result: Any, expected: dict[str, np.ndarray]) -> None:
    for name, want in expected.items():
        got = result.as_numpy(name)
        assert got is not None and got.shape == want.shape, f"output {name}: {got!r}"
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def inference_count(url: str, model: str, version: str = "", headers: dict[str, str] | None = None) -> int:
    """Rows a server (Triton or our worker) has run for ``model``, read from that server directly."""
    client = grpc_client(url)
    try:
        stats = client.get_inference_statistics(model, version, headers=headers).model_stats
        return sum(s.inference_count for s in stats)
    finally:
        client.close()


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        # Polling a condition with a deadline, not a sleep standing in for readiness.
        time.sleep(0.05)


def worker_section(gateway_http: str, model: str = "") -> list[dict[str, Any]]:
    client = http_client(gateway_http)
    try:
        return client.get_inference_statistics(model, query_params={"workers": "true"})["workers"]
    finally:
        client.close()


def status_of(call: Callable[[], Any]) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as err:
        call()
    return str(err.value.status()), err.value.message() or ""


def override_files(model_repo: Path, versions: list[str]) -> dict[str, bytes]:
    files = {}
    for version in versions:
        files[f"file:{version}/model.py"] = python_model_source().encode()
        files[f"file:{version}/model.onnx"] = (model_repo / "mlp" / "1" / "model.onnx").read_bytes()
    return files
