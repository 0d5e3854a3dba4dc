"""Triton's model_warmup on the worker, with a fake backend: samples (zero,
random, input file; batch size; count) run on every instance before the
version is installed, so the model is never READY un-warmed; a sample the
model refuses, or a bad sample, fails the load and leaves nothing loaded."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pytest
from tritonclient.grpc import model_config_pb2 as mc

from protos.errors import InvalidArgument
from execution.backends.base import Placement
from execution.manager import ModelManager
from execution.repository import ModelRepository

CONFIG = """
name: "m"
max_batch_size: 4
input { name: "X" data_type: TYPE_FP32 dims: 2 }
input { name: "I" data_type: TYPE_INT64 dims: 3 }
output { name: "Y" data_type: TYPE_FP32 dims: 2 }
instance_group { count: 2 kind: KIND_CPU }
"""


class RecordingInstance:
    def __init__(self, backend: RecordingBackend) -> None:
        self.placement = Placement("cpu")
        self.backend = backend
        self.closed = False

    async def infer(self, inputs: Mapping[str, np.ndarray], output_names: Sequence[str]) -> dict[str, np.ndarray]:
        manager = self.backend.manager
        self.backend.runs.append((id(self), {k: v.copy() for k, v in inputs.items()},
                                  manager is not None and manager.is_ready("m")))
        if (inputs["X"] < 0).any():
            raise InvalidArgument("X must not be negative")
        return {name: inputs["X"] for name in output_names}

    def close(self) -> None:
        self.closed = True


class RecordingBackend:
    name = "fake"
    platform = "fake"
    default_model_filename = "model.bin"
    cpu_instances = 1
    execution_threads = 0

    def __init__(self) -> None:
        self.manager: ModelManager | None = None
        self.instances: list[RecordingInstance] = []
        self.runs: list[tuple[int, dict[str, np.ndarray], bool]] = []

    def gpu_count(self) -> int:
        return 0

    def describe(self) -> str:
        return "fake"

    def complete_config(self, config: mc.ModelConfig, version_dir: Path) -> mc.ModelConfig:
        return config

    def load(self, model_dir: Path, version_dir: Path, config: mc.ModelConfig, placement: Placement) -> RecordingInstance:
        instance = RecordingInstance(self)
        self.instances.append(instance)
        return instance

    def close(self) -> None:
        pass


def _manager(tmp_path: Path, warmup: str) -> tuple[ModelManager, RecordingBackend]:
    model = tmp_path / "repo" / "m"
    (model / "1").mkdir(parents=True)
    (model / "1" / "model.bin").write_text("1")
    (model / "config.pbtxt").write_text(CONFIG + warmup)
    (model / "warmup").mkdir()
    (model / "warmup" / "x.bin").write_bytes(np.array([[1.5, 2.5]] * 2, dtype=np.float32).tobytes())
    (model / "warmup" / "neg.bin").write_bytes(np.array([[-1.0, 0.0]], dtype=np.float32).tobytes())
    backend = RecordingBackend()
    manager = ModelManager(ModelRepository(tmp_path / "repo"), backend, staging_root=tmp_path / "staging")
    backend.manager = manager
    return manager, backend


SAMPLES = """
model_warmup { name: "zeros" batch_size: 1 count: 2
  inputs { key: "X" value { data_type: TYPE_FP32 dims: 2 zero_data: true } }
  inputs { key: "I" value { data_type: TYPE_INT64 dims: 3 random_data: true } } }
model_warmup { name: "file" batch_size: 2
  inputs { key: "X" value { data_type: TYPE_FP32 dims: 2 input_data_file: "x.bin" } }
  inputs { key: "I" value { data_type: TYPE_INT64 dims: 3 zero_data: true } } }
"""


async def test_samples_run_on_every_instance_before_the_model_is_ready(tmp_path: Path) -> None:
    manager, backend = _manager(tmp_path, SAMPLES)
    try:
        await manager.load("m")
        assert manager.is_ready("m")
        # 2 instances x (zeros twice + file once); never while the model was READY.
        assert len(backend.runs) == 6
        assert not any(ready for _, _, ready in backend.runs)
        assert {instance for instance, _, _ in backend.runs} == {id(i) for i in backend.instances}
        zeros = [inputs for _, inputs, _ in backend.runs if inputs["X"].shape == (1, 2)]
        files = [inputs for _, inputs, _ in backend.runs if inputs["X"].shape == (2, 2)]
        assert len(zeros) == 4 and len(files) == 2
        assert not zeros[0]["X"].any() and zeros[0]["I"].dtype == np.int64 and zeros[0]["I"].shape == (1, 3)
        np.testing.assert_array_equal(files[0]["X"], [[1.5, 2.5], [1.5, 2.5]])
        # Warmup runs are not requests: the statistics stay empty.
        assert manager.statistics("m")[0].execution_count == 0
    finally:
        await manager.close()


@pytest.mark.parametrize(
    ("warmup", "words"),
    [
        ('model_warmup { name: "neg" batch_size: 1 inputs { key: "X" value { data_type: TYPE_FP32 dims: 2 '
         'input_data_file: "neg.bin" } } inputs { key: "I" value { data_type: TYPE_INT64 dims: 3 zero_data: true } } }',
         "warmup sample 'neg' failed on version 1: X must not be negative"),
        ('model_warmup { name: "big" batch_size: 9 inputs { key: "X" value { data_type: TYPE_FP32 dims: 2 '
         'zero_data: true } } }', "batch_size must be 1..4"),
        ('model_warmup { name: "gone" batch_size: 1 inputs { key: "X" value { data_type: TYPE_FP32 dims: 2 '
         'input_data_file: "missing.bin" } } }', "cannot read warmup/missing.bin"),
        ('model_warmup { name: "short" batch_size: 1 inputs { key: "X" value { data_type: TYPE_FP32 dims: 4 '
         'input_data_file: "neg.bin" } } }', "does not hold a FP32[1, 4] tensor"),
        ('model_warmup { name: "esc" batch_size: 1 inputs { key: "X" value { data_type: TYPE_FP32 dims: 2 '
         'input_data_file: "../config.pbtxt" } } }', "inside 'warmup/'"),
        ('model_warmup { name: "who" batch_size: 1 inputs { key: "Z" value { data_type: TYPE_FP32 dims: 2 '
         'zero_data: true } } }', "unknown inputs ['Z']"),
    ],
)
async def test_a_failing_warmup_fails_the_load(tmp_path: Path, warmup: str, words: str) -> None:
    manager, backend = _manager(tmp_path, warmup)
    try:
        with pytest.raises(InvalidArgument, match="failed to load 'm'") as info:
            await manager.load("m")
        assert words in info.value.message
        assert not manager.is_ready("m")
        assert all(i.closed for i in backend.instances)
        [row] = await manager.index()
        assert row.state == "UNAVAILABLE" and words in row.reason
    finally:
        await manager.close()
