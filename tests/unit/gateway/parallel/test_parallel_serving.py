"""Serving split models, without sockets: placement, the tensor x pipeline
split, the remote shard runner, logical-model config, and the registry
driven against a fake cluster whose workers run shards with ONNX Runtime."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2, service_pb2

from gateway.config import load_config
from gateway.fleet.cluster import ModelInfo, WorkerModel, WorkerState, WorkerStatus
from gateway.parallel.logical import (
    LogicalSpec,
    ParallelConfigError,
    read_source,
    signature,
)
from gateway.parallel.placement import place
from gateway.parallel.remote import (
    RemoteShards,
    arrays_from_request,
    needed_outputs,
    response_from_arrays,
)
from gateway.parallel.serving import ParallelModels
from gateway.parallel.shard_placement import DIGEST_PARAM
from gateway.settings import ConfigError, GatewayConfig, WorkerSpec
from protos import codec
from protos.errors import InvalidArgument, Unavailable
from splitter import PlanExecutor, verify_split
from splitter.layout_split import split_layout
from splitter.probe import cpu_session


@pytest.fixture(scope="module")
def encoder(model_repo: Path) -> onnx.ModelProto:
    return onnx.load(str(model_repo / "encoder" / "1" / "model.onnx"))


def tokens(rows: int = 3, seq: int = 9, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 100, size=(rows, seq)).astype(np.int64)


def unsplit(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    return cpu_session(model).run(["HIDDEN"], {"TOKENS": x})[0]


# ---- placement -------------------------------------------------------------------

WORKERS = [f"10.0.0.{i}:8001" for i in range(1, 7)]


def test_placement_is_deterministic_and_one_slot_per_worker_when_there_are_enough() -> None:
    a = place("m", 2, 2, WORKERS[:4])
    assert a == place("m", 2, 2, list(reversed(WORKERS[:4])))
    assert sorted(a) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert len(set(a.values())) == 4
    # Another model name hashes differently (with 6 workers, some choice differs).
    assert any(place(f"m{i}", 1, 2, WORKERS) != place("m", 1, 2, WORKERS) for i in range(5))


def test_placement_with_few_workers_keeps_ranks_and_copies_apart() -> None:
    a = place("m", 2, 2, WORKERS[:2])
    assert a[(0, 0)] != a[(0, 1)] and a[(1, 0)] != a[(1, 1)]  # a group's ranks on distinct workers
    assert a[(0, 0)] != a[(1, 0)]  # two copies of one slot never share a worker here
    one = place("m", 1, 3, WORKERS[:1])
    assert set(one.values()) == {WORKERS[0]}
    assert place("m", 1, 2, []) == {}


def test_placement_is_sticky_and_moves_only_what_was_lost() -> None:
    before = place("m", 2, 2, WORKERS[:5])
    lost = before[(0, 1)]
    keep = {k: a for k, a in before.items() if a != lost}
    after = place("m", 2, 2, [w for w in WORKERS[:5] if w != lost], current=keep)
    assert {k: a for k, a in after.items() if k != (0, 1)} == keep
    assert after[(0, 1)] != lost and after[(0, 1)] not in keep.values()  # the spare worker


def test_placement_spreads_models_by_load() -> None:
    first = place("a", 1, 2, WORKERS[:4])
    load = Counter(first.values())
    second = place("b", 1, 2, WORKERS[:4], load=load)
    assert not set(first.values()) & set(second.values())


# ---- splitting for serving -------------------------------------------------------------


def test_tensor_times_pipeline_split_matches_the_unsplit_model(encoder: onnx.ModelProto) -> None:
    layout = split_layout(encoder, 2, 2, name="enc")
    report = verify_split(encoder, layout.result)
    assert report.max_abs_error <= 1e-4
    assert layout.plan.tensor_parallel == 2 and layout.plan.pipeline_parallel == 2
    assert len(layout.slots) == 4
    named = [s for slot in layout.slots for s in slot]
    assert sorted(named) == sorted(layout.result.models)  # slots partition the shards
    for slot in layout.slots:  # one stage and one rank per slot
        assert len({(n.split(".")[2], n.split(".")[4]) for n in slot}) == 1
    assert [seg.index for seg in layout.plan.segments] == list(range(len(layout.plan.segments)))


def test_plain_layouts(encoder: onnx.ModelProto) -> None:
    assert split_layout(encoder, 1, 1, name="e").slots == (("e.pp1.s0",),)
    tp = split_layout(encoder, 2, 1, name="e")
    assert [len(s) for s in tp.slots] == [len(tp.plan.segments)] * 2
    assert tp.slot_of("e.tp2.r1.s0") == 1


# ---- the remote runner ------------------------------------------------------------------


class LocalSender:
    """A router stand-in: runs the shard named in the request with ONNX Runtime."""

    def __init__(self, models: dict[str, onnx.ModelProto]) -> None:
        self.sessions = {name: cpu_session(m) for name, m in models.items()}
        self.requests: list[service_pb2.ModelInferRequest] = []
        self.down: set[str] = set()

    async def infer(self, model: str, version: str, request: service_pb2.ModelInferRequest, deadline: float | None
                    ) -> service_pb2.ModelInferResponse:
        if model in self.down:
            raise Unavailable(f"no healthy replica of model '{model}'")
        self.requests.append(request)
        feeds = arrays_from_request(request)
        names = [o.name for o in request.outputs]
        values = await asyncio.to_thread(self.sessions[model].run, names, feeds)
        response = service_pb2.ModelInferResponse(model_name=model)
        for name, value in zip(names, values):
            dt, shape, raw = codec.encode(value)
            response.outputs.add(name=name, datatype=dt, shape=shape)
            response.raw_output_contents.append(raw)
        return response


async def test_remote_runner_matches_and_skips_what_only_rank_zero_sends(encoder: onnx.ModelProto) -> None:
    layout = split_layout(encoder, 2, 1, name="e")
    sender = LocalSender(layout.result.models)
    needed = needed_outputs(layout.plan)
    runner = RemoteShards(sender, needed, None)
    x = tokens()
    out = await PlanExecutor(layout.plan, runner).run({"TOKENS": x})
    np.testing.assert_allclose(out["HIDDEN"], unsplit(encoder, x), atol=1e-4)
    last = layout.plan.segments[-1]
    assert needed[last.shards[1].name] == ()  # rank 1's copy of the output is never needed
    called = [r.model_name for r in sender.requests]
    assert last.shards[0].name in called and last.shards[1].name not in called
    assert runner.timing.calls == len(called) and runner.timing.bytes_sent > 0
    assert len(runner.timing.segments) == len(layout.plan.segments)


def test_response_keeps_requested_outputs_only() -> None:
    request = service_pb2.ModelInferRequest(model_name="m", id="7")
    request.outputs.add(name="B")
    response = response_from_arrays(request, "1", {"A": np.zeros(2, np.float32), "B": np.ones(3, np.int64)}, ["A", "B"])
    assert [o.name for o in response.outputs] == ["B"] and response.id == "7"
    assert codec.decode("INT64", [3], response.raw_output_contents[0]).tolist() == [1, 1, 1]


# ---- config and signature -----------------------------------------------------------------


@pytest.mark.parametrize("entry, message", [
    ("{from: encoder, path: x.onnx}", "exactly one of"),
    ("{tensor_parallel: 2}", "exactly one of"),
    ("{from: encoder, tensor_parallel: 0}", "tensor_parallel"),
    ("{from: encoder, replicas: two}", "replicas"),
    ("{from: encoder, max_inflight: -1}", "max_inflight"),
])
def test_bad_logical_model_settings_are_config_errors(tmp_path: Path, entry: str, message: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(f"models:\n  enc: {entry}\n")
    with pytest.raises(ConfigError, match=message):
        load_config(path)


def test_logical_settings_paths_and_batching_keys(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("model_repository: repo\nmodels:\n  a: {path: m.onnx, pipeline_parallel: 2, max_queue_size: 5}\n"
                    "  b: {mode: fixed}\n")
    config = load_config(path)
    assert config.model_repository == str((tmp_path / "repo").resolve())
    assert config.models["a"]["path"] == str((tmp_path / "m.onnx").resolve())
    assert set(config.logical_models()) == {"a"}
    assert config.batching_settings("a") == {"max_queue_size": 5}


def test_signature_without_a_served_source(model_repo: Path, encoder: onnx.ModelProto) -> None:
    spec = LogicalSpec.from_settings("enc2", {"from": "encoder", "tensor_parallel": 2})
    data, repo_config = read_source(spec, str(model_repo))
    assert data == encoder.SerializeToString() and repo_config is not None
    plan = split_layout(encoder, 2, 1, name="enc2").plan
    config, metadata = signature(spec, plan, None, repo_config)
    assert config.name == "enc2" and config.max_batch_size == repo_config.max_batch_size > 0
    assert [list(i.dims) for i in config.input] == [[-1]]
    assert [(t.name, t.datatype, list(t.shape)) for t in metadata.outputs] == [("HIDDEN", "FP32", [-1, -1, 64])]
    assert "infergate_logical" in config.parameters and metadata.versions == ["1"]
    bare = LogicalSpec.from_settings("enc3", {"path": "x.onnx", "max_batch_size": 4})
    assert signature(bare, plan, None, None)[0].max_batch_size == 4
    with pytest.raises(ParallelConfigError, match="model_repository"):
        read_source(spec, "")
    with pytest.raises(ParallelConfigError, match="no model.onnx"):
        read_source(LogicalSpec.from_settings("x", {"from": "nothing"}), str(model_repo))


# ---- the registry, against a fake cluster ------------------------------------------------


class FakeClient:
    def __init__(self, address: str) -> None:
        self.address = address
        self.loaded: dict[str, model_config_pb2.ModelConfig] = {}
        self.files: dict[str, bytes] = {}
        self.loads = 0
        self.refuse = False

    async def load(self, name: str, parameters: dict, timeout_s: float | None = None) -> None:
        if self.refuse:
            raise InvalidArgument("this worker does not take overrides")
        self.loads += 1
        config = model_config_pb2.ModelConfig()
        json_format.Parse(parameters["config"].string_param, config)
        self.loaded[name] = config
        self.files[name] = parameters["file:1/model.onnx"].bytes_param

    async def unload(self, name: str, parameters: dict | None = None, timeout_s: float | None = None) -> None:
        self.loaded.pop(name, None)


class FakeCluster:
    """The cluster surface the registry uses; a worker's models are what its fake client loaded."""

    def __init__(self, n: int, source: ModelInfo) -> None:
        self.states = [WorkerState(WorkerSpec(f"127.0.0.1:{9000 + i}"), FakeClient(f"127.0.0.1:{9000 + i}"))  # type: ignore[arg-type]
                       for i in range(n)]
        for w in self.states:
            w.state = WorkerStatus.READY
        self.source = source
        self.listeners: list = []

    def workers(self) -> list[WorkerState]:
        return list(self.states)

    def worker(self, address: str) -> WorkerState | None:
        return next((w for w in self.states if w.address == address), None)

    def model(self, name: str) -> ModelInfo | None:
        return self.source if name == self.source.name else None

    def healthy(self, name: str, version: str = "") -> tuple[WorkerState, ...]:
        return tuple(w for w in self.states if w.state is WorkerStatus.READY and name in w.models)

    def on_change(self, listener):
        self.listeners.append(listener)
        return lambda: self.listeners.remove(listener)

    async def refresh(self, address: str | None = None) -> None:
        for w in self.states:
            if address is None or w.address == address:
                w.models = {n: WorkerModel(n, ("1",), c, service_pb2.ModelMetadataResponse(name=n))
                            for n, c in w.client.loaded.items()}  # type: ignore[attr-defined]

    def kill(self, index: int) -> None:
        self.states[index].state = WorkerStatus.DOWN
        self.states[index].client.loaded.clear()  # type: ignore[attr-defined]
        self.states[index].models = {}


class ClusterSender(LocalSender):
    """Routes like the router: only to READY workers that hold the shard."""

    def __init__(self, cluster: FakeCluster) -> None:
        super().__init__({})
        self.cluster = cluster

    async def infer(self, model, version, request, deadline):
        hosts = self.cluster.healthy(model)
        if not hosts:
            raise Unavailable(f"no healthy replica of model '{model}'")
        if model not in self.sessions:
            self.sessions[model] = cpu_session(onnx.load_from_string(hosts[0].client.files[model]))  # type: ignore[attr-defined]
        return await super().infer(model, version, request, deadline)


def source_info(model_repo: Path) -> ModelInfo:
    from google.protobuf import text_format

    config = text_format.Parse((model_repo / "encoder" / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    metadata = service_pb2.ModelMetadataResponse(name="encoder", versions=["1"], platform="onnxruntime_onnx")
    metadata.inputs.add(name="TOKENS", datatype="INT64", shape=[-1, -1])
    metadata.outputs.add(name="HIDDEN", datatype="FP32", shape=[-1, -1, 64])
    return ModelInfo("encoder", ("1",), config, metadata, ())


def registry(model_repo: Path, workers: int, **settings: object) -> tuple[ParallelModels, FakeCluster, ClusterSender]:
    """The star path (the gateway runs every shard): peer groups need real workers (integration tests)."""
    settings.setdefault("collectives", "gateway")
    config = GatewayConfig(models={"enc": {"from": "encoder", **settings}}, model_repository=str(model_repo))
    cluster = FakeCluster(workers, source_info(model_repo))
    sender = ClusterSender(cluster)
    models = ParallelModels(config.logical_models(), cluster, sender, model_repository=config.model_repository,
                            max_inflight_per_replica=config.batching.max_inflight_per_replica)
    return models, cluster, sender  # type: ignore[arg-type]


def batch_request(x: np.ndarray) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="enc")
    dt, shape, raw = codec.encode(x)
    request.inputs.add(name="TOKENS", datatype=dt, shape=shape)
    request.raw_input_contents.append(raw)
    return request


def hidden(response: service_pb2.ModelInferResponse) -> np.ndarray:
    (out,), (raw,) = response.outputs, response.raw_output_contents
    assert out.name == "HIDDEN"
    return codec.decode(out.datatype, list(out.shape), raw)


async def test_registry_places_each_slot_on_its_own_worker_and_serves(model_repo: Path, encoder: onnx.ModelProto) -> None:
    models, cluster, _ = registry(model_repo, 4, tensor_parallel=2, replicas=2)
    await models.start()
    try:
        layout = models.layout("enc")
        for w in cluster.states:  # each worker holds exactly one rank's shards, with their digest
            held = set(w.client.loaded)  # type: ignore[attr-defined]
            assert held in [set(slot) for slot in layout.slots]
            assert all(DIGEST_PARAM in c.parameters for c in w.client.loaded.values())  # type: ignore[attr-defined]
        info = models.model("enc")
        assert info is not None and info.config.max_batch_size == 16 and info.metadata.name == "enc"
        x = tokens()
        response = await models.infer("enc", "", batch_request(x), None)
        np.testing.assert_allclose(hidden(response), unsplit(encoder, x), atol=1e-4)
        assert response.model_version == "1"
        stats = models.stats()["enc"]
        assert stats.batches == 1 and stats.shard_calls > 0 and stats.plan_s >= stats.remote_s > 0
        # A restart finds every shard in place (same digest): nothing is pushed again.
        loads = sum(w.client.loads for w in cluster.states)  # type: ignore[attr-defined]
        await models._reconcile(models._served["enc"], urgent=True)
        assert sum(w.client.loads for w in cluster.states) == loads  # type: ignore[attr-defined]
        assert [e.state for e in models.index_entries()] == ["READY"]
    finally:
        await models.stop()


async def test_registry_re_places_a_lost_slot_and_reruns_the_batch(model_repo: Path, encoder: onnx.ModelProto) -> None:
    models, cluster, _ = registry(model_repo, 3, tensor_parallel=2)
    await models.start()
    try:
        placement = models.placement("enc")
        victim = next(i for i, w in enumerate(cluster.states) if w.address == placement[(0, 1)])
        cluster.kill(victim)
        assert [e.state for e in models.index_entries()] == ["UNAVAILABLE"]
        x = tokens(seed=3)
        response = await models.infer("enc", "", batch_request(x), asyncio.get_running_loop().time() + 30)
        np.testing.assert_allclose(hidden(response), unsplit(encoder, x), atol=1e-4)
        moved = models.placement("enc")
        assert moved[(0, 0)] == placement[(0, 0)] and moved[(0, 1)] not in (placement[(0, 1)], placement[(0, 0)])
        stats = models.stats()["enc"]
        assert stats.retries == 1 and stats.replaced == 1
    finally:
        await models.stop()


async def test_a_worker_that_refuses_shards_is_passed_over(model_repo: Path) -> None:
    models, cluster, _ = registry(model_repo, 3, pipeline_parallel=2)
    first = place("enc", 1, 2, [w.address for w in cluster.states])
    refusing = next(w for w in cluster.states if w.address == first[(0, 0)])
    refusing.client.refuse = True  # type: ignore[attr-defined]
    await models.start()
    try:
        await models._reconcile(models._served["enc"], urgent=False)
        assert refusing.address not in models.placement("enc").values()
        assert len(set(models.placement("enc").values())) == 2
    finally:
        await models.stop()


async def test_unload_and_load(model_repo: Path) -> None:
    models, cluster, _ = registry(model_repo, 2, tensor_parallel=2)
    await models.start()
    try:
        await models.unload("enc")
        assert models.model("enc") is None and not any(w.client.loaded for w in cluster.states)  # type: ignore[attr-defined]
        await models.load("enc")
        assert models.model("enc") is not None
        assert all(w.client.loaded for w in cluster.states)  # type: ignore[attr-defined]
    finally:
        await models.stop()


async def test_registry_serves_tensor_times_pipeline(model_repo: Path, encoder: onnx.ModelProto) -> None:
    models, _, _ = registry(model_repo, 4, tensor_parallel=2, pipeline_parallel=2)
    await models.start()
    try:
        assert len(set(models.placement("enc").values())) == 4  # (stage, rank) slots on distinct workers
        x = tokens(2, 5, seed=9)
        response = await models.infer("enc", "", batch_request(x), None)
        np.testing.assert_allclose(hidden(response), unsplit(encoder, x), atol=1e-4)
    finally:
        await models.stop()
