"""Unit tests of the simulated accelerator backend: options, latency model,
output shapes and datatypes for every example model, timer bookkeeping (with
a fake clock), config completion, and the worker's ``--sim-*`` flags."""

from __future__ import annotations

import argparse
import asyncio
import random
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper
from tritonclient.grpc import model_config_pb2 as mc

from protos.errors import InvalidArgument
from execution.backends import sim
from execution.backends.base import BackendOptions, Placement, create_backend
from execution.repository import read_config
from workers.server import _backend_options, add_arguments

EXAMPLES = Path(__file__).resolve().parents[3] / "models"
CPU = Placement("cpu")


def backend(clock: sim.Clock | None = None, **extra: str) -> sim.SimBackend:
    return sim.SimBackend(BackendOptions(extra=extra), clock)


def example_config(name: str) -> mc.ModelConfig:
    # config.pbtxt alone: the model files are not built for unit tests.
    return read_config(EXAMPLES / name, name)


def example_inputs(name: str, batch: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    if name == "simple":
        return {n: rng.integers(0, 9, (batch, 16), dtype=np.int32) for n in ("INPUT0", "INPUT1")}
    if name == "mlp":
        return {"INPUT": rng.standard_normal((batch, 64), dtype=np.float32)}
    if name == "cnn":
        return {"IMAGE": rng.standard_normal((batch, 3, 32, 32), dtype=np.float32)}
    return {"TOKENS": rng.integers(0, 1000, (batch, 7), dtype=np.int64)}


EXPECTED = {
    "simple": lambda n: {"OUTPUT0": ((n, 16), np.int32), "OUTPUT1": ((n, 16), np.int32)},
    "mlp": lambda n: {"OUTPUT": ((n, 10), np.float32)},
    "cnn": lambda n: {"PROBS": ((n, 10), np.float32)},
    "encoder": lambda n: {"HIDDEN": ((n, 7, 64), np.float32)},  # seq len 7 taken from TOKENS
}


def load(b: sim.SimBackend, config: mc.ModelConfig, tmp_path: Path) -> sim.SimInstance:
    config = b.complete_config(config, tmp_path / "1")
    return b.load(tmp_path, tmp_path / "1", config, CPU)


# --- options and latency model ---------------------------------------------------------


def test_options_parse_and_reject_nonsense() -> None:
    s = sim.SimSettings.from_options({"latency_ms": "5", "per_row_us": "40", "jitter_pct": "10", "fill": "random", "seed": "3"})
    assert s.latency == sim.LatencyModel(5.0, 40.0, 10.0) and (s.fill, s.seed) == ("random", 3)
    assert sim.SimSettings.from_options({}).latency == sim.LatencyModel()
    for bad in ({"latncy_ms": "5"}, {"latency_ms": "x"}, {"latency_ms": "-1"}, {"jitter_pct": "100"}, {"fill": "ones"}):
        with pytest.raises(InvalidArgument):
            sim.SimSettings.from_options(bad)


def test_latency_model_is_a_plus_n_b_within_the_jitter() -> None:
    model = sim.LatencyModel(latency_ms=5.0, per_row_us=100.0)
    assert model.mean_s(1) == pytest.approx(0.0051)
    assert model.mean_s(32) == pytest.approx(0.0082)
    jittery = sim.LatencyModel(latency_ms=10.0, per_row_us=0.0, jitter_pct=20.0)
    rng = random.Random(1)
    samples = [jittery.sample_s(4, rng) for _ in range(2000)]
    assert all(0.008 <= s <= 0.012 for s in samples)
    assert min(samples) < 0.0085 and max(samples) > 0.0115  # the spread is used, not just the mean
    assert np.mean(samples) == pytest.approx(0.010, rel=0.02)


def test_registry_builds_the_sim_backend() -> None:
    b = create_backend("sim", BackendOptions(extra={"latency_ms": "2"}))
    assert isinstance(b, sim.SimBackend) and "2 ms" in b.describe()
    assert b.gpu_count() == 0
    assert sim.SimBackend(BackendOptions(extra={"gpus": "2"})).gpu_count() == 2
    with pytest.raises(InvalidArgument):
        sim.SimBackend(BackendOptions(device="cuda"))


def test_worker_flags_feed_the_backend_options() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([
        "--model-repository", "m", "--backend", "sim", "--backend-option", "fill=random",
        "--sim-latency-ms", "5", "--sim-per-row-us", "12.5", "--sim-jitter-pct", "3",
    ])  # fmt: skip
    extra = _backend_options(args).extra
    assert dict(extra) == {"fill": "random", "latency_ms": "5.0", "per_row_us": "12.5", "jitter_pct": "3.0"}
    settings = sim.SimSettings.from_options(extra)
    assert settings.latency == sim.LatencyModel(5.0, 12.5, 3.0)
    plain = parser.parse_args(["--model-repository", "m"])
    assert dict(_backend_options(plain).extra) == {}


# --- outputs --------------------------------------------------------------------------------


def test_output_shape_rules() -> None:
    assert sim.output_shape([-1, 64], True, [(3, 11)]) == (3, 11, 64)
    assert sim.output_shape([10], True, [(5, 64)]) == (5, 10)
    assert sim.output_shape([4, -1], False, [(2, 9)]) == (4, 9)
    # dim i comes from the first input (in config order) that has a dim i; else 1
    assert sim.output_shape([-1, -1, 2], True, [(2,), (2, 6)]) == (2, 6, 1, 2)
    assert sim.output_shape([-1, -1], True, [(2, 3), (2, 6, 8)]) == (2, 3, 8)
    assert sim.output_shape([-1], False, []) == (1,)


@pytest.mark.parametrize("name", sorted(EXPECTED))
@pytest.mark.parametrize("batch", [1, 3])
async def test_every_example_model_gets_outputs_of_its_shape_and_dtype(name: str, batch: int, tmp_path: Path) -> None:
    instance = load(backend(latency_ms="0"), example_config(name), tmp_path)
    expected = EXPECTED[name](batch)
    outputs = await instance.infer(example_inputs(name, batch), list(expected))
    assert {k: (v.shape, v.dtype) for k, v in outputs.items()} == {k: (s, np.dtype(d)) for k, (s, d) in expected.items()}
    assert all(not v.any() for v in outputs.values())  # zeros by default


async def test_only_the_requested_outputs_come_back(tmp_path: Path) -> None:
    instance = load(backend(latency_ms="0"), example_config("simple"), tmp_path)
    outputs = await instance.infer(example_inputs("simple", 2), ["OUTPUT1"])
    assert list(outputs) == ["OUTPUT1"]


async def test_random_fill_is_seeded(tmp_path: Path) -> None:
    def fresh() -> sim.SimInstance:
        return load(backend(latency_ms="0", fill="random", seed="9"), example_config("mlp"), tmp_path)

    a = (await fresh().infer(example_inputs("mlp", 4), ["OUTPUT"]))["OUTPUT"]
    b = (await fresh().infer(example_inputs("mlp", 4), ["OUTPUT"]))["OUTPUT"]
    assert a.dtype == np.float32 and a.std() > 0.1
    np.testing.assert_array_equal(a, b)


async def test_bytes_and_non_batching_models(tmp_path: Path) -> None:
    config = mc.ModelConfig(name="text", max_batch_size=0)
    config.input.add(name="IN", data_type=mc.TYPE_FP32, dims=[2, -1])
    config.output.add(name="WORDS", data_type=mc.TYPE_STRING, dims=[-1])
    config.output.add(name="FLAGS", data_type=mc.TYPE_BOOL, dims=[3])
    instance = load(backend(latency_ms="0", fill="random"), config, tmp_path)
    out = await instance.infer({"IN": np.zeros((2, 5), np.float32)}, ["WORDS", "FLAGS"])
    assert out["WORDS"].shape == (2,) and out["WORDS"].dtype == np.object_ and out["WORDS"][0] == b""
    assert out["FLAGS"].shape == (3,) and out["FLAGS"].dtype == np.bool_


async def test_closed_instance_refuses_work(tmp_path: Path) -> None:
    instance = load(backend(latency_ms="0"), example_config("mlp"), tmp_path)
    instance.close()
    with pytest.raises(InvalidArgument):
        await instance.infer(example_inputs("mlp", 1), ["OUTPUT"])


# --- timing bookkeeping (fake clock: no wall-clock asserts) ---------------------------------


class FakeClock:
    """Each sleep lasts what it asked for plus ``overshoot_s``, at once."""

    def __init__(self, overshoot_s: float = 0.0) -> None:
        self.t = 100.0
        self.overshoot_s = overshoot_s
        self.requested: list[float] = []

    def now(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        self.requested.append(seconds)
        self.t += seconds + self.overshoot_s
        await asyncio.sleep(0)


@pytest.mark.parametrize("batch", [1, 8, 32])
async def test_a_batch_of_n_rows_waits_a_plus_n_b(batch: int, tmp_path: Path) -> None:
    fake_time = FakeClock()
    instance = load(backend(fake_time, latency_ms="5", per_row_us="100"), example_config("mlp"), tmp_path)
    await instance.infer(example_inputs("mlp", batch), ["OUTPUT"])
    assert fake_time.requested == [pytest.approx(0.005 + batch * 0.0001)]


async def test_timer_error_is_carried_into_the_next_sleep_but_capped(tmp_path: Path) -> None:
    fake_time = FakeClock()
    instance = load(backend(fake_time, latency_ms="5"), example_config("mlp"), tmp_path)
    fake_time.overshoot_s = 0.0005  # timers that fire late: the next sleeps are shortened to compensate
    for _ in range(2):
        await instance.infer(example_inputs("mlp", 1), ["OUTPUT"])
    assert fake_time.requested == [pytest.approx(0.005), pytest.approx(0.0045)]
    fake_time.overshoot_s = 0.050  # a busy loop: repaid only up to the cap
    for _ in range(3):
        await instance.infer(example_inputs("mlp", 1), ["OUTPUT"])
    assert fake_time.requested[-1] == pytest.approx(0.005 - sim.TIMER_SLACK_S)


class GateClock(FakeClock):
    """A sleep returns only once ``expected`` sleeps are pending at the same time."""

    def __init__(self, expected: int) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.expected = expected

    async def sleep(self, seconds: float) -> None:
        self.requested.append(seconds)
        if len(self.requested) == self.expected:
            self.gate.set()
        await self.gate.wait()


async def test_waiting_batches_do_not_block_the_event_loop(tmp_path: Path) -> None:
    # Two instances "run" at once on one loop: both waits are pending together,
    # which a sleep holding the thread (time.sleep) could never allow.
    clock = GateClock(expected=2)
    b = backend(clock, latency_ms="3")
    first, second = (load(b, example_config("mlp"), tmp_path) for _ in range(2))
    runs = (first.infer(example_inputs("mlp", 1), ["OUTPUT"]), second.infer(example_inputs("mlp", 1), ["OUTPUT"]))
    await asyncio.wait_for(asyncio.gather(*runs), timeout=10)
    assert clock.requested == [pytest.approx(0.003)] * 2


def test_the_real_clock_waits_on_the_event_loop() -> None:
    assert asyncio.iscoroutinefunction(sim.LoopClock.sleep)
    assert sim.SimBackend(BackendOptions())._clock.__class__ is sim.LoopClock


# --- config completion ----------------------------------------------------------------------


def test_declared_config_needs_no_model_file(tmp_path: Path) -> None:
    config = backend().complete_config(example_config("encoder"), tmp_path / "1")
    assert [(t.name, list(t.dims)) for t in config.output] == [("HIDDEN", [-1, 64])]
    assert (config.backend, config.platform) == ("onnxruntime", "onnxruntime_onnx")


def test_missing_signature_is_read_from_the_onnx_graph(tmp_path: Path) -> None:
    graph = helper.make_graph(
        [helper.make_node("Identity", ["X"], ["Y"])], "g",
        [helper.make_tensor_value_info("X", TensorProto.INT64, ["b", 4])],
        [helper.make_tensor_value_info("Y", TensorProto.INT64, ["b", 4])],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "model.onnx").write_bytes(model.SerializeToString())
    config = backend().complete_config(mc.ModelConfig(name="ident"), tmp_path / "1")
    assert config.max_batch_size == sim.DEFAULT_MAX_BATCH_SIZE
    assert [(t.name, t.data_type, list(t.dims)) for t in config.input] == [("X", mc.TYPE_INT64, [4])]
    assert [(t.name, t.data_type, list(t.dims)) for t in config.output] == [("Y", mc.TYPE_INT64, [4])]


def test_missing_signature_and_no_model_file_is_a_clear_error(tmp_path: Path) -> None:
    config = mc.ModelConfig(name="bare", max_batch_size=4)
    config.input.add(name="X", data_type=mc.TYPE_FP32, dims=[4])
    with pytest.raises(InvalidArgument, match="config.pbtxt"):
        backend().complete_config(config, tmp_path / "1")
