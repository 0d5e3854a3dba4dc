"""``infergate worker --backend sim``: a real worker process serving the
example repository with the simulated accelerator, driven with tritonclient.
Asserts shapes, datatypes and statistics, never timings; the repository copy
it serves has no model files at all."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tests.harness import Proc, start_worker, worker_url

pytestmark = pytest.mark.timeout(120)

RNG = np.random.default_rng(11)
DATATYPES = {np.int32: "INT32", np.int64: "INT64", np.float32: "FP32"}


def example_inputs(model: str, batch: int) -> dict[str, np.ndarray]:
    if model == "simple":
        return {n: RNG.integers(-5, 5, (batch, 16), dtype=np.int32) for n in ("INPUT0", "INPUT1")}
    if model == "mlp":
        return {"INPUT": RNG.standard_normal((batch, 64), dtype=np.float32)}
    if model == "cnn":
        return {"IMAGE": RNG.standard_normal((batch, 3, 32, 32), dtype=np.float32)}
    return {"TOKENS": RNG.integers(0, 1000, (batch, 13), dtype=np.int64)}


# Per model: output name -> (shape for a batch of n, numpy dtype). The encoder's
# sequence dim follows the 13 tokens sent.
EXPECTED = {
    "simple": lambda n: {"OUTPUT0": ((n, 16), np.int32), "OUTPUT1": ((n, 16), np.int32)},
    "mlp": lambda n: {"OUTPUT": ((n, 10), np.float32)},
    "cnn": lambda n: {"PROBS": ((n, 10), np.float32)},
    "encoder": lambda n: {"HIDDEN": ((n, 13, 64), np.float32)},
}


@pytest.fixture(scope="module")
def configs_only(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example repository without any .onnx file: the sim needs only the configs."""
    target = tmp_path_factory.mktemp("sim-repo") / "models"
    shutil.copytree(model_repo, target, ignore=shutil.ignore_patterns("*.onnx"))
    assert not list(target.rglob("*.onnx")) and (target / "mlp" / "1").is_dir()
    return target


@pytest.fixture(scope="module")
def worker(configs_only: Path) -> Iterator[Proc]:
    proc = start_worker(
        configs_only, "--backend", "sim", "--sim-latency-ms", "1", "--sim-per-row-us", "20", "--sim-jitter-pct", "10",
        "--backend-option", "fill=random",
    )  # fmt: skip
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(worker: Proc) -> Iterator[grpcclient.InferenceServerClient]:
    c = grpcclient.InferenceServerClient(worker_url(worker))
    yield c
    c.close()


def test_every_example_model_is_ready_with_its_config(client: grpcclient.InferenceServerClient) -> None:
    assert client.is_server_ready()
    for model in EXPECTED:
        assert client.is_model_ready(model), model
    metadata = client.get_model_metadata("encoder")
    assert [(t.name, t.datatype, list(t.shape)) for t in metadata.outputs] == [("HIDDEN", "FP32", [-1, -1, 64])]
    assert client.get_model_config("mlp").config.max_batch_size == 64


@pytest.mark.parametrize("model", sorted(EXPECTED))
@pytest.mark.parametrize("batch", [1, 4])
def test_outputs_have_the_declared_shapes_and_datatypes(client: grpcclient.InferenceServerClient, model: str, batch: int) -> None:
    arrays = example_inputs(model, batch)
    inputs = []
    for name, array in arrays.items():
        tensor = grpcclient.InferInput(name, list(array.shape), DATATYPES[array.dtype.type])
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    result = client.infer(model, inputs)
    expected = EXPECTED[model](batch)
    got = {o.name: (tuple(o.shape), o.datatype) for o in result.get_response().outputs}
    assert got == {name: (shape, DATATYPES[dtype]) for name, (shape, dtype) in expected.items()}
    for name, (shape, dtype) in expected.items():
        array = result.as_numpy(name)
        assert array.shape == shape and array.dtype == dtype
    if model in ("mlp", "cnn", "encoder"):
        assert result.as_numpy(next(iter(expected))).std() > 0  # fill=random reached the backend


def test_statistics_count_the_simulated_executions(client: grpcclient.InferenceServerClient) -> None:
    before = client.get_inference_statistics("mlp").model_stats[0]
    tensor = grpcclient.InferInput("INPUT", [3, 64], "FP32")
    tensor.set_data_from_numpy(np.zeros((3, 64), np.float32))
    for _ in range(2):
        client.infer("mlp", [tensor])
    after = client.get_inference_statistics("mlp").model_stats[0]
    assert after.execution_count - before.execution_count == 2
    assert after.inference_count - before.inference_count == 6
    assert after.inference_stats.compute_infer.ns > before.inference_stats.compute_infer.ns
