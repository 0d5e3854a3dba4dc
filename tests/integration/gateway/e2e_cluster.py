"""The cluster behind the end-to-end gateway tests, and what they share:
``infergate up`` (two workers and a gateway) on the example models, ONNX
Runtime references run directly on the same files, the cluster's addresses,
inputs per model, and tritonclient tensors built from numpy arrays.

Used by ``test_gateway_e2e.py`` (inference, metadata, statistics, the
repository extension, batching) and ``test_gateway_e2e_edge.py`` (bad
requests, compression, the raw binary extension); each has its own
module-scoped ``cluster`` and ``references`` fixtures around
:func:`start_cluster` and :func:`onnx_references`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.harness import Proc, start

MODELS = ("simple", "mlp", "cnn", "encoder")
OUTPUTS = {"simple": ("OUTPUT0", "OUTPUT1"), "mlp": ("OUTPUT",), "cnn": ("PROBS",), "encoder": ("HIDDEN",)}
MAX_BATCH = {"simple": 8, "mlp": 64, "cnn": 32, "encoder": 16}
Arrays = dict[str, np.ndarray]


def start_cluster(model_repo: Path) -> Iterator[Proc]:
    """A two-worker cluster until resumed: the body of each test module's ``cluster`` fixture."""
    proc = start(["up", "--workers", "2", "--model-repository", str(model_repo), "--http-port", "0", "--grpc-port", "0"])
    try:
        assert len(proc.ready["workers"]) == 2
        yield proc
    finally:
        proc.stop()


def onnx_references(model_repo: Path) -> dict[str, Callable[[Arrays], Arrays]]:
    """Each model run by ONNX Runtime on the CPU, straight from the repository's files."""
    def reference(model: str) -> Callable[[Arrays], Arrays]:
        session = ort.InferenceSession(str(model_repo / model / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
        return lambda inputs: dict(zip(OUTPUTS[model], session.run(list(OUTPUTS[model]), inputs)))

    return {model: reference(model) for model in MODELS}


def http_url(proc: Proc) -> str:
    return f"127.0.0.1:{proc.ready['http_port']}"


def grpc_url(proc: Proc) -> str:
    return f"127.0.0.1:{proc.ready['grpc_port']}"


def worker_urls(proc: Proc) -> list[str]:
    return [w["address"] for w in proc.ready["workers"]]


def worker_headers(proc: Proc) -> dict[str, str]:
    """gRPC metadata that lets a test call the cluster's workers directly (their shared token)."""
    token_file = proc.ready.get("worker_token_file")
    if not token_file:
        return {}
    return {"authorization": f"Bearer {Path(token_file).read_text().strip()}"}


def make_inputs(model: str, rows: int, rng: np.random.Generator) -> Arrays:
    if model == "simple":
        return {
            "INPUT0": rng.integers(-1000, 1000, (rows, 16), dtype=np.int32),
            "INPUT1": rng.integers(-1000, 1000, (rows, 16), dtype=np.int32),
        }
    if model == "mlp":
        return {"INPUT": rng.standard_normal((rows, 64), dtype=np.float32)}
    if model == "cnn":
        return {"IMAGE": rng.standard_normal((rows, 3, 32, 32), dtype=np.float32)}
    return {"TOKENS": rng.integers(0, 1000, (rows, 7), dtype=np.int64)}


def assert_outputs_equal(got: Arrays, want: Arrays) -> None:
    assert set(got) == set(want)
    for name, expected in want.items():
        actual = got[name]
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, (name, actual.dtype, actual.shape)
        if expected.dtype == np.float32:
            np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5, err_msg=name)
        else:
            np.testing.assert_array_equal(actual, expected, err_msg=name)


def _triton_dtype(array: np.ndarray) -> str:
    return {np.dtype(np.int32): "INT32", np.dtype(np.int64): "INT64", np.dtype(np.float32): "FP32"}[array.dtype]


def http_inputs(inputs: Arrays, binary: bool) -> list[httpclient.InferInput]:
    result = []
    for name, array in inputs.items():
        tensor = httpclient.InferInput(name, list(array.shape), _triton_dtype(array))
        tensor.set_data_from_numpy(array, binary_data=binary)
        result.append(tensor)
    return result


def grpc_inputs(inputs: Arrays) -> list[grpcclient.InferInput]:
    result = []
    for name, array in inputs.items():
        tensor = grpcclient.InferInput(name, list(array.shape), _triton_dtype(array))
        tensor.set_data_from_numpy(array)
        result.append(tensor)
    return result
