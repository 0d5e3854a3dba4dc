"""Unit tests for execution/manager.py and execution/model.py with a fake backend:
lookups, the instance pool, overload, drain on unload, reload, override
staging and statistics. No sockets, no ONNX Runtime."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

import grpc
import numpy as np
import pytest
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2

from protos.errors import InferGateError, InvalidArgument
from protos.execution_slots import PARAMETER, execution_slots
from execution.backends.base import Placement
from execution.manager import ModelManager
from execution.repository import ModelRepository

CONFIG = """
name: "m"
max_batch_size: 4
input { name: "X" data_type: TYPE_FP32 dims: 2 }
output { name: "Y" data_type: TYPE_FP32 dims: 2 }
instance_group { count: %d kind: KIND_CPU }
"""
CONFIG_JSON = (
    '{"max_batch_size": 4, "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": [2]}],'
    ' "output": [{"name": "Y", "data_type": "TYPE_FP32", "dims": [2]}]}'
)


class FakeInstance:
    def __init__(self, backend: FakeBackend, placement: Placement, factor: float) -> None:
        self.placement = placement
        self.backend = backend
        self.factor = factor
        self.closed = False

    async def infer(self, inputs: Mapping[str, np.ndarray], output_names: Sequence[str]) -> dict[str, np.ndarray]:
        assert not self.closed, "infer on a closed instance"
        self.backend.running += 1
        self.backend.peak = max(self.backend.peak, self.backend.running)
        try:
            await self.backend.gate.wait()
        finally:
            self.backend.running -= 1
        return {name: inputs["X"] * self.factor for name in output_names}

    def close(self) -> None:
        self.closed = True


class FakeBackend:
    """Instances multiply X by the number in the version's model.bin; a gate holds executions."""

    name = "fake"
    platform = "fake"
    default_model_filename = "model.bin"

    def __init__(self, cpu_instances: int = 1, execution_threads: int = 0) -> None:
        self.cpu_instances = cpu_instances
        self.execution_threads = execution_threads
        self.instances: list[FakeInstance] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.running = 0
        self.peak = 0

    def gpu_count(self) -> int:
        return 0

    def describe(self) -> str:
        return "fake"

    def complete_config(self, config: mc.ModelConfig, version_dir: Path) -> mc.ModelConfig:
        if not (version_dir / "model.bin").is_file():
            raise InvalidArgument(f"no model.bin in version {version_dir.name}")
        return config

    def load(self, model_dir: Path, version_dir: Path, config: mc.ModelConfig, placement: Placement) -> FakeInstance:
        text = (version_dir / "model.bin").read_text()
        if not text.strip().isdigit():
            raise InvalidArgument(f"cannot read weights of version {version_dir.name}")
        instance = FakeInstance(self, placement, float(text))
        self.instances.append(instance)
        return instance

    def close(self) -> None:
        pass


def make_repo(root: Path, count: int = 1, factor: str = "2") -> Path:
    model = root / "repo" / "m"
    (model / "1").mkdir(parents=True)
    (model / "1" / "model.bin").write_text(factor)
    (model / "config.pbtxt").write_text(CONFIG % count)
    return root / "repo"


def request(batch: int = 1, version: str = "") -> service_pb2.ModelInferRequest:
    req = service_pb2.ModelInferRequest(model_name="m", model_version=version)
    req.inputs.add(name="X", datatype="FP32", shape=[batch, 2])
    req.raw_input_contents.append(np.arange(batch * 2, dtype=np.float32).tobytes())
    return req


def result(response: service_pb2.ModelInferResponse) -> np.ndarray:
    return np.frombuffer(response.raw_output_contents[0], np.float32)


async def settle() -> None:
    """Let every ready task run until it blocks (no wall-clock waiting)."""
    for _ in range(20):
        await asyncio.sleep(0)


@pytest.fixture
async def setup(tmp_path: Path) -> tuple[ModelManager, FakeBackend]:
    backend = FakeBackend()
    manager = ModelManager(ModelRepository(make_repo(tmp_path)), backend, staging_root=tmp_path / "staging", max_queue_size=1)
    await manager.load("m")
    yield manager, backend
    backend.gate.set()
    await manager.close()


async def test_load_infer_and_statistics(setup: tuple[ModelManager, FakeBackend]) -> None:
    manager, _ = setup
    response = await manager.get("m").infer(request(batch=3))
    assert response.model_version == "1"
    np.testing.assert_array_equal(result(response), np.arange(6, dtype=np.float32) * 2)
    with pytest.raises(InferGateError):
        await manager.get("m").infer(request(batch=5))
    [stats] = manager.statistics("m")
    assert (stats.name, stats.version, stats.inference_count, stats.execution_count) == ("m", "1", 3, 1)
    assert stats.inference_stats.success.count == 1 and stats.inference_stats.fail.count == 1
    assert [b.batch_size for b in stats.batch_stats] == [3]
    assert stats.last_inference > 0


async def test_lookup_errors_use_triton_codes(setup: tuple[ModelManager, FakeBackend]) -> None:
    manager, _ = setup
    cases = [("nope", "", grpc.StatusCode.NOT_FOUND, "'nope' is not found"), ("m", "7", grpc.StatusCode.NOT_FOUND, "version 7")]
    for name, version, code, fragment in cases:
        with pytest.raises(InferGateError) as info:
            manager.get(name, version)
        assert info.value.grpc_code == code and fragment in info.value.message
    assert manager.get("m", "1") is manager.get("m")
    await manager.unload("m")
    with pytest.raises(InferGateError, match="has no available versions") as info:
        manager.get("m")
    assert info.value.grpc_code == grpc.StatusCode.UNAVAILABLE
    rows = await manager.index()
    assert [(r.name, r.state, r.reason) for r in rows] == [("m", "UNAVAILABLE", "unloaded")]
    assert await manager.index(ready_only=True) == []


async def test_one_instance_runs_one_request_at_a_time_and_the_queue_is_bounded(
    setup: tuple[ModelManager, FakeBackend],
) -> None:
    manager, backend = setup
    backend.gate.clear()
    first = asyncio.create_task(manager.get("m").infer(request()))
    second = asyncio.create_task(manager.get("m").infer(request()))
    await settle()
    assert backend.running == 1
    with pytest.raises(InferGateError, match="Exceeds maximum queue size") as info:
        await manager.get("m").infer(request())  # max_queue_size=1 and one already waits
    assert info.value.grpc_code == grpc.StatusCode.UNAVAILABLE
    backend.gate.set()
    await asyncio.gather(first, second)
    assert backend.peak == 1
    [stats] = manager.statistics("m")
    assert stats.execution_count == 2 and stats.inference_stats.queue.count == 2


async def test_instance_count_sets_concurrency(tmp_path: Path) -> None:
    backend = FakeBackend()
    manager = ModelManager(ModelRepository(make_repo(tmp_path, count=3)), backend, staging_root=tmp_path / "s")
    await manager.load("m")
    backend.gate.clear()
    tasks = [asyncio.create_task(manager.get("m").infer(request())) for _ in range(5)]
    await settle()
    assert backend.running == 3
    backend.gate.set()
    await asyncio.gather(*tasks)
    assert backend.peak == 3 and len(backend.instances) == 3
    await manager.close()
    assert all(i.closed for i in backend.instances)


@pytest.mark.parametrize(
    ("count", "cpu_instances", "execution_threads", "instances", "slots"),
    [
        (3, 1, 0, 3, 3),  # the config's count; no shared pool: every instance runs
        (3, 1, 2, 3, 2),  # a pool of two threads runs two at once, whatever the instances
        (0, 4, 4, 4, 4),  # no instance_group: the backend's per-core default
    ],
)
async def test_served_config_states_the_execution_slots(
    tmp_path: Path, count: int, cpu_instances: int, execution_threads: int, instances: int, slots: int
) -> None:
    repo = make_repo(tmp_path, count=max(count, 1))
    if count == 0:
        config = (repo / "m" / "config.pbtxt").read_text()
        (repo / "m" / "config.pbtxt").write_text(config.replace("instance_group { count: 1 kind: KIND_CPU }", ""))
    backend = FakeBackend(cpu_instances, execution_threads)
    manager = ModelManager(ModelRepository(repo), backend, staging_root=tmp_path / "s")
    await manager.load("m")
    config = manager.get("m").config
    assert sum(g.count for g in config.instance_group) == instances == len(backend.instances)
    assert config.parameters[PARAMETER].string_value == str(slots)
    assert execution_slots(config) == slots
    await manager.close()


async def test_unload_waits_for_in_flight_requests_then_releases(setup: tuple[ModelManager, FakeBackend]) -> None:
    manager, backend = setup
    backend.gate.clear()
    in_flight = asyncio.create_task(manager.get("m").infer(request()))
    await settle()
    unloading = asyncio.create_task(manager.unload("m"))
    await settle()
    assert not unloading.done() and not backend.instances[0].closed
    with pytest.raises(InferGateError, match="no available versions"):
        manager.get("m")  # no new work reaches it while it drains
    assert [r.state for r in await manager.index()] == ["UNLOADING"]
    backend.gate.set()
    np.testing.assert_array_equal(result(await in_flight), [0.0, 2.0])
    await unloading
    assert backend.instances[0].closed


async def test_reload_swaps_versions_and_a_failed_reload_keeps_serving(
    setup: tuple[ModelManager, FakeBackend], tmp_path: Path
) -> None:
    manager, backend = setup
    old = backend.instances[0]
    (tmp_path / "repo" / "m" / "2").mkdir()
    (tmp_path / "repo" / "m" / "2" / "model.bin").write_text("10")
    await manager.load("m")
    assert old.closed
    response = await manager.get("m").infer(request())
    assert response.model_version == "2"
    np.testing.assert_array_equal(result(response), [0.0, 10.0])
    with pytest.raises(InferGateError, match="version 1 is not found"):
        manager.get("m", "1")  # latest policy: only version 2 now

    (tmp_path / "repo" / "m" / "2" / "model.bin").write_text("corrupt")
    with pytest.raises(InvalidArgument, match="failed to load 'm': cannot read weights of version 2"):
        await manager.load("m")
    np.testing.assert_array_equal(result(await manager.get("m").infer(request())), [0.0, 10.0])
    assert [(r.version, r.state) for r in await manager.index()] == [("2", "READY")]


async def test_load_with_override_uses_a_private_copy(setup: tuple[ModelManager, FakeBackend], tmp_path: Path) -> None:
    manager, _ = setup
    await manager.load("shard", config_json=CONFIG_JSON.replace("{", '{"name": "shard", ', 1), files={"1/model.bin": b"5"})
    req = request()
    req.model_name = "shard"
    np.testing.assert_array_equal(result(await manager.get("shard").infer(req)), [0.0, 5.0])
    assert not (tmp_path / "repo" / "shard").exists()
    staged = list((tmp_path / "staging").iterdir())
    assert len(staged) == 1 and (staged[0] / "1" / "model.bin").read_bytes() == b"5"
    assert {r.name for r in await manager.index()} == {"m", "shard"}

    # Override of a repository model's bytes, then back to the repository's own.
    await manager.load("m", config_json=CONFIG_JSON, files={"1/model.bin": b"3"})
    np.testing.assert_array_equal(result(await manager.get("m").infer(request())), [0.0, 3.0])
    await manager.load("m")
    np.testing.assert_array_equal(result(await manager.get("m").infer(request())), [0.0, 2.0])
    assert (tmp_path / "repo" / "m" / "1" / "model.bin").read_text() == "2"

    await manager.unload("shard")
    assert list((tmp_path / "staging").iterdir()) == []
    with pytest.raises(InferGateError, match="is not found"):
        manager.get("shard")
    assert {r.name for r in await manager.index()} == {"m"}


async def test_load_waiting_on_an_unload_that_drops_the_model_still_lands(
    setup: tuple[ModelManager, FakeBackend],
) -> None:
    manager, backend = setup
    config = CONFIG_JSON.replace("{", '{"name": "shard", ', 1)
    await manager.load("shard", config_json=config, files={"1/model.bin": b"5"})
    backend.gate.clear()
    req = request()
    req.model_name = "shard"
    in_flight = asyncio.create_task(manager.get("shard").infer(req))
    await settle()
    unloading = asyncio.create_task(manager.unload("shard"))  # takes the lock, then drains
    await settle()
    reloading = asyncio.create_task(manager.load("shard", config_json=config, files={"1/model.bin": b"7"}))
    await settle()
    backend.gate.set()
    await asyncio.gather(in_flight, unloading, reloading)
    np.testing.assert_array_equal(result(await manager.get("shard").infer(req)), [0.0, 7.0])
    assert [(r.name, r.state) for r in await manager.index() if r.name == "shard"] == [("shard", "READY")]


async def test_failed_loads(setup: tuple[ModelManager, FakeBackend], tmp_path: Path) -> None:
    manager, _ = setup
    with pytest.raises(InferGateError, match="failed to poll from model repository") as info:
        await manager.load("absent")
    assert info.value.grpc_code == grpc.StatusCode.NOT_FOUND
    with pytest.raises(InvalidArgument, match="failed to load 'bad'"):
        await manager.load("bad", config_json=CONFIG_JSON.replace("{", '{"name": "bad", ', 1), files={"1/model.bin": b"x"})
    rows = {r.name: r for r in await manager.index()}
    assert "absent" not in rows
    assert rows["bad"].state == "UNAVAILABLE" and "cannot read weights" in rows["bad"].reason
    assert list((tmp_path / "staging").iterdir()) == []
    with pytest.raises(InvalidArgument, match="not a valid ModelConfig"):
        await manager.load("m", config_json="{not json")
    assert manager.is_ready("m")


async def test_cancelled_caller_does_not_abort_the_load(setup: tuple[ModelManager, FakeBackend]) -> None:
    manager, backend = setup
    await manager.unload("m")
    caller = asyncio.create_task(manager.load("m"))
    await asyncio.sleep(0)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    await manager.close()  # waits for the load the manager owns
    assert len(backend.instances) == 2  # the second load ran to the end...
    assert backend.instances[1].closed and not manager.is_ready("m")  # ...and close released it


async def test_the_load_line_says_what_runs_each_version(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    repo = make_repo(tmp_path, count=2)
    ensemble = repo / "e"
    (ensemble / "1").mkdir(parents=True)
    (ensemble / "config.pbtxt").write_text(
        'name: "e" platform: "ensemble" max_batch_size: 4\n'
        'input { name: "X" data_type: TYPE_FP32 dims: 2 }\noutput { name: "Y" data_type: TYPE_FP32 dims: 2 }\n'
        'ensemble_scheduling { step { model_name: "m" model_version: -1 input_map { key: "X" value: "X" }'
        ' output_map { key: "Y" value: "Y" } } }\n')
    manager = ModelManager(ModelRepository(repo), FakeBackend(), staging_root=tmp_path / "staging")
    caplog.set_level(logging.INFO, logger="execution.manager")
    try:
        await manager.load("m")
        await manager.load("e")
    finally:
        await manager.close()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("loaded model")]
    assert lines == [
        "loaded model m versions [1], 2 instance(s) each on cpu (fake)",
        "loaded model e versions [1], no instances here: an ensemble's steps run as their own models, called by the gateway",
    ]
