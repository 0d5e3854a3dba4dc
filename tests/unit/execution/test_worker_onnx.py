"""Unit tests for execution/backends/onnx.py: Triton-style config auto-complete,
device choice and sessions (real ONNX Runtime on the CPU, no sockets)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest
from google.protobuf import text_format
from onnx import TensorProto, helper
from tritonclient.grpc import model_config_pb2 as mc

from protos.errors import InvalidArgument
from tests.poison_models import pair_model
from execution.backends.base import BackendOptions, Placement, create_backend
from execution.backends.onnx import DEFAULT_MAX_BATCH_SIZE, OnnxBackend, default_intra_op_threads
from execution.devices import cuda_device_count


def add_model(first_dim: int | str = "batch", elem: int = TensorProto.FLOAT, width: int = 4) -> onnx.ModelProto:
    """Y = A + B, Z = A - B over [first_dim, width]."""
    shape = [first_dim, width]
    graph = helper.make_graph(
        [helper.make_node("Add", ["A", "B"], ["Y"]), helper.make_node("Sub", ["A", "B"], ["Z"])],
        "add",
        [helper.make_tensor_value_info("A", elem, shape), helper.make_tensor_value_info("B", elem, shape)],
        [helper.make_tensor_value_info("Y", elem, shape), helper.make_tensor_value_info("Z", elem, shape)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


def write_model(model_dir: Path, model: onnx.ModelProto, version: int = 1) -> Path:
    version_dir = model_dir / str(version)
    version_dir.mkdir(parents=True, exist_ok=True)
    (version_dir / "model.onnx").write_bytes(model.SerializeToString())
    return version_dir


@pytest.fixture(scope="module")
def backend() -> Iterator[OnnxBackend]:
    b = OnnxBackend(BackendOptions(device="cpu", intra_op_threads=1, execution_threads=2))
    yield b
    b.close()


def _tensors(tensors: list[mc.ModelInput] | list[mc.ModelOutput]) -> list[tuple[str, int, list[int]]]:
    return [(t.name, t.data_type, list(t.dims)) for t in tensors]


def test_empty_config_is_completed_with_batching(tmp_path: Path, backend: OnnxBackend) -> None:
    version_dir = write_model(tmp_path / "m", add_model())
    config = backend.complete_config(mc.ModelConfig(name="m"), version_dir)
    assert config.max_batch_size == DEFAULT_MAX_BATCH_SIZE
    assert _tensors(config.input) == [("A", mc.TYPE_FP32, [4]), ("B", mc.TYPE_FP32, [4])]
    assert _tensors(config.output) == [("Y", mc.TYPE_FP32, [4]), ("Z", mc.TYPE_FP32, [4])]
    assert (config.backend, config.platform) == ("onnxruntime", "onnxruntime_onnx")
    assert config.default_model_filename == "model.onnx"  # named in the config, as Triton's /config shows it


def test_fixed_first_dim_means_no_batching(tmp_path: Path, backend: OnnxBackend) -> None:
    version_dir = write_model(tmp_path / "m", add_model(first_dim=3, elem=TensorProto.INT64))
    config = backend.complete_config(mc.ModelConfig(name="m"), version_dir)
    assert config.max_batch_size == 0
    assert _tensors(config.input)[0] == ("A", mc.TYPE_INT64, [3, 4])


def test_given_batch_size_is_kept_and_outputs_are_filled(tmp_path: Path, backend: OnnxBackend) -> None:
    version_dir = write_model(tmp_path / "m", add_model())
    config = text_format.Parse(
        'name: "m" max_batch_size: 16 input { name: "A" data_type: TYPE_FP32 dims: 4 }'
        ' input { name: "B" data_type: TYPE_FP32 dims: -1 }',
        mc.ModelConfig(),
    )
    config = backend.complete_config(config, version_dir)
    assert config.max_batch_size == 16
    assert _tensors(config.input)[1] == ("B", mc.TYPE_FP32, [-1])  # what the config says stays
    assert _tensors(config.output) == [("Y", mc.TYPE_FP32, [4]), ("Z", mc.TYPE_FP32, [4])]


@pytest.mark.parametrize(
    "config_text, fragment",
    [
        ('input { name: "NOPE" data_type: TYPE_FP32 dims: [-1, 4] }', "unexpected input 'NOPE'"),
        ('max_batch_size: 2 input { name: "A" data_type: TYPE_INT32 dims: 4 }', "TYPE_INT32 in the config but TYPE_FP32"),
        ('max_batch_size: 2 input { name: "A" data_type: TYPE_FP32 dims: 5 }', "dims [5] in the config"),
        ('max_batch_size: 2 input { name: "A" data_type: TYPE_FP32 dims: [4, 1] }', "dims [4, 1] in the config"),
        ('max_batch_size: 2 input { name: "A" data_type: TYPE_FP32 dims: 4 }', "config lists no input ['B']"),
        ('backend: "pytorch"', "backend 'pytorch'"),
    ],
)
def test_configs_that_disagree_with_the_model_fail(
    tmp_path: Path, backend: OnnxBackend, config_text: str, fragment: str
) -> None:
    version_dir = write_model(tmp_path / "m", add_model())
    config = text_format.Parse(f'name: "m" {config_text}', mc.ModelConfig())
    with pytest.raises(InvalidArgument) as info:
        backend.complete_config(config, version_dir)
    assert fragment in info.value.message


def test_batching_needs_a_dynamic_first_dim(tmp_path: Path, backend: OnnxBackend) -> None:
    version_dir = write_model(tmp_path / "m", add_model(first_dim=3))
    with pytest.raises(InvalidArgument, match="fixed first dim"):
        backend.complete_config(mc.ModelConfig(name="m", max_batch_size=8), version_dir)


def test_unreadable_and_missing_model_files(tmp_path: Path, backend: OnnxBackend) -> None:
    version_dir = tmp_path / "m" / "1"
    version_dir.mkdir(parents=True)
    with pytest.raises(InvalidArgument, match="not found"):
        backend.complete_config(mc.ModelConfig(name="m"), version_dir)
    (version_dir / "model.onnx").write_bytes(b"\x00garbage\xff" * 10)
    with pytest.raises(InvalidArgument, match="not a valid ONNX model"):
        backend.complete_config(mc.ModelConfig(name="m"), version_dir)
    config = mc.ModelConfig(name="m", max_batch_size=2)
    with pytest.raises(InvalidArgument, match="cannot load"):
        backend.load(tmp_path / "m", version_dir, config, Placement("cpu"))


async def test_instance_runs_the_model_in_a_thread(tmp_path: Path, backend: OnnxBackend) -> None:
    version_dir = write_model(tmp_path / "m", add_model())
    config = backend.complete_config(mc.ModelConfig(name="m"), version_dir)
    instance = backend.load(tmp_path / "m", version_dir, config, Placement("cpu"))
    a = np.arange(8, dtype=np.float32).reshape(2, 4)
    b = np.full((2, 4), 0.5, dtype=np.float32)
    outputs = await instance.infer({"A": a, "B": b}, ["Z"])
    assert list(outputs) == ["Z"]
    np.testing.assert_array_equal(outputs["Z"], a - b)
    instance.close()
    with pytest.raises(InvalidArgument, match="unloaded"):
        await instance.infer({"A": a, "B": b}, ["Y"])


async def test_a_refused_request_answers_with_onnx_runtimes_words_and_prints_nothing(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    # Our log at info, as a worker runs by default; the refusal itself is logged at debug.
    caplog.set_level(logging.INFO, logger="execution.backends.onnx")
    caplog.set_level(logging.DEBUG, logger="execution.backends.run_errors")
    quiet = OnnxBackend(BackendOptions(device="cpu", intra_op_threads=1, execution_threads=1))
    try:
        version_dir = write_model(tmp_path / "pair", pair_model())
        config = quiet.complete_config(mc.ModelConfig(name="pair", max_batch_size=0), version_dir)
        instance = quiet.load(tmp_path / "pair", version_dir, config, Placement("cpu"))
        capfd.readouterr()
        with pytest.raises(InvalidArgument) as refused:
            await instance.infer({"A": np.ones((2, 4), np.float32), "B": np.ones((3, 4), np.float32)}, ["SUM"])
    finally:
        quiet.close()
    cause = "Attempting to broadcast an axis by a dimension other than 1. 2 by 3"
    assert cause in refused.value.message
    # ONNX Runtime writes to the process's stderr itself: nothing of it there, coloured or not.
    printed = capfd.readouterr()
    assert "onnxruntime" not in printed.err and "\x1b[" not in printed.err, printed.err
    assert any(cause in r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG)


def test_auto_device_and_thread_defaults() -> None:
    auto = create_backend("onnx", BackendOptions(device="auto"))
    try:
        expected = "cuda" if cuda_device_count() and "CUDAExecutionProvider" in auto.providers else "cpu"
        assert auto.device == expected
        assert auto.providers[-1] == "CPUExecutionProvider"
        assert auto.intra_op_threads >= 1 and auto.execution_threads >= 1
        # A model with no instance group fills the pool: alone, it uses every core.
        assert auto.cpu_instances == auto.execution_threads
        assert "CPUExecutionProvider" in auto.describe()
    finally:
        auto.close()
    assert default_intra_op_threads(16, "cpu") == 4
    assert default_intra_op_threads(2, "cpu") == 1
    assert default_intra_op_threads(16, "cuda") == 1


@pytest.mark.skipif(cuda_device_count() > 0, reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="--device cuda"):
        create_backend("onnx", BackendOptions(device="cuda"))


def test_unknown_backend_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="unknown backend 'tpu'"):
        create_backend("tpu", BackendOptions())
