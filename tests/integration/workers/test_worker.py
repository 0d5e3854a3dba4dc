"""Integration tests for ``infergate worker``: a real worker process on
127.0.0.1 (ephemeral port, ready file) driven with the real tritonclient gRPC
clients, sync and asyncio, plus raw gRPC stubs where tritonclient cannot
build the request (typed contents, bad byte counts). Its lifecycle (SIGTERM,
explicit mode, health): test_worker_lifecycle.py."""

from __future__ import annotations

import asyncio
import json
import queue
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
from grpc_health.v1 import health_pb2, health_pb2_grpc
from onnx import TensorProto, helper
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from tests.harness import Proc, start_worker, worker_url
from execution.backends.onnx import default_intra_op_threads
from execution.devices import cpu_count

pytestmark = pytest.mark.timeout(120)

RNG = np.random.default_rng(7)


def example_inputs(model: str, batch: int) -> dict[str, np.ndarray]:
    if model == "simple":
        return {n: RNG.integers(-1000, 1000, (batch, 16), dtype=np.int32) for n in ("INPUT0", "INPUT1")}
    if model == "mlp":
        return {"INPUT": RNG.standard_normal((batch, 64), dtype=np.float32)}
    if model == "cnn":
        return {"IMAGE": RNG.standard_normal((batch, 3, 32, 32), dtype=np.float32)}
    return {"TOKENS": RNG.integers(0, 1000, (batch, 11), dtype=np.int64)}


def infer_inputs(arrays: dict[str, np.ndarray]) -> list[grpcclient.InferInput]:
    inputs = []
    for name, array in arrays.items():
        tensor = grpcclient.InferInput(name, list(array.shape), {np.int32: "INT32", np.int64: "INT64", np.float32: "FP32"}[array.dtype.type])
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def reference(model_repo: Path, model: str, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(str(model_repo / model / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, arrays)))


def assert_matches(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    if want.dtype.kind == "f":
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    else:
        np.testing.assert_array_equal(got, want)


def status_of(info: pytest.ExceptionInfo[InferenceServerException]) -> str:
    return str(info.value.status())


@pytest.fixture(scope="module")
def worker(model_repo: Path) -> Iterator[Proc]:
    proc = start_worker(model_repo)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(worker: Proc) -> Iterator[grpcclient.InferenceServerClient]:
    c = grpcclient.InferenceServerClient(worker_url(worker))
    yield c
    c.close()


@pytest.fixture(scope="module")
def stub(worker: Proc) -> Iterator[service_pb2_grpc.GRPCInferenceServiceStub]:
    with grpc.insecure_channel(worker_url(worker)) as channel:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)


def good_simple(client: grpcclient.InferenceServerClient) -> None:
    arrays = example_inputs("simple", 2)
    result = client.infer("simple", infer_inputs(arrays))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), arrays["INPUT0"] + arrays["INPUT1"])


# --- health and metadata ------------------------------------------------------------------


def test_health_and_server_metadata(worker: Proc, client: grpcclient.InferenceServerClient) -> None:
    assert client.is_server_live() and client.is_server_ready()
    metadata = client.get_server_metadata()
    assert metadata.name == "infergate-worker" and metadata.version
    assert {"model_repository", "statistics", "model_configuration"} <= set(metadata.extensions)
    with grpc.insecure_channel(worker_url(worker)) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "inference.GRPCInferenceService"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert worker.ready["pid"] == worker.pid


def test_model_metadata_and_config(client: grpcclient.InferenceServerClient) -> None:
    assert client.is_model_ready("mlp") and client.is_model_ready("mlp", "1")
    assert not client.is_model_ready("mlp", "2") and not client.is_model_ready("nope")
    metadata = client.get_model_metadata("encoder")
    assert (metadata.name, list(metadata.versions), metadata.platform) == ("encoder", ["1"], "onnxruntime_onnx")
    assert [(t.name, t.datatype, list(t.shape)) for t in metadata.inputs] == [("TOKENS", "INT64", [-1, -1])]
    assert [(t.name, t.datatype, list(t.shape)) for t in metadata.outputs] == [("HIDDEN", "FP32", [-1, -1, 64])]
    config = client.get_model_config("mlp").config
    assert config.max_batch_size == 64 and config.HasField("dynamic_batching")
    # No instance group in the file: one CPU instance per execution thread (cores / intra-op
    # threads), stated back as the model's execution slots for the gateway.
    (group,) = config.instance_group
    if group.kind == mc.ModelInstanceGroup.KIND_CPU:
        threads = cpu_count() // default_intra_op_threads(cpu_count(), "cpu")
        assert group.count == threads
        assert config.parameters["execution_slots"].string_value == str(threads)


# --- inference ------------------------------------------------------------------------------


@pytest.mark.parametrize("model, batch", [("simple", 3), ("mlp", 5), ("cnn", 2), ("encoder", 3)])
def test_outputs_match_onnxruntime(client: grpcclient.InferenceServerClient, model_repo: Path, model: str, batch: int) -> None:
    arrays = example_inputs(model, batch)
    result = client.infer(model, infer_inputs(arrays), request_id=f"{model}-1")
    assert result.get_response().id == f"{model}-1"
    for name, want in reference(model_repo, model, arrays).items():
        assert_matches(result.as_numpy(name), want)


async def test_asyncio_client_concurrent_requests(worker: Proc, model_repo: Path) -> None:
    models = ["simple", "mlp", "cnn", "encoder"] * 3
    batches = [example_inputs(m, 1 + i % 3) for i, m in enumerate(models)]
    async with aioclient.InferenceServerClient(worker_url(worker)) as client:
        assert await client.is_server_ready()
        results = await asyncio.gather(*(client.infer(m, infer_inputs(a)) for m, a in zip(models, batches)))
    for model, arrays, result in zip(models, batches, results):
        for name, want in reference(model_repo, model, arrays).items():
            assert_matches(result.as_numpy(name), want)


def test_only_requested_outputs_come_back_raw(client: grpcclient.InferenceServerClient) -> None:
    arrays = example_inputs("simple", 1)
    result = client.infer("simple", infer_inputs(arrays), outputs=[grpcclient.InferRequestedOutput("OUTPUT1")])
    response = result.get_response()
    assert [o.name for o in response.outputs] == ["OUTPUT1"]
    assert len(response.raw_output_contents) == 1 and not response.outputs[0].HasField("contents")
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), arrays["INPUT0"] - arrays["INPUT1"])


def test_typed_contents_are_accepted(stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    request = service_pb2.ModelInferRequest(model_name="simple")
    for name, values in (("INPUT0", a), ("INPUT1", a * 3)):
        request.inputs.add(name=name, datatype="INT32", shape=[1, 16]).contents.int_contents.extend(values.ravel().tolist())
    response = stub.ModelInfer(request)
    out = dict(zip([o.name for o in response.outputs], response.raw_output_contents))
    np.testing.assert_array_equal(np.frombuffer(out["OUTPUT0"], np.int32), (a * 4).ravel())


def test_statistics_move_with_requests(client: grpcclient.InferenceServerClient) -> None:
    def snapshot() -> service_pb2.ModelStatistics:
        [stats] = client.get_inference_statistics("mlp").model_stats
        return stats

    before = snapshot()
    for batch in (4, 4, 4, 1):
        client.infer("mlp", infer_inputs(example_inputs("mlp", batch)))
    with pytest.raises(InferenceServerException):
        client.infer("mlp", infer_inputs(example_inputs("mlp", 65)))
    after = snapshot()
    assert (after.name, after.version) == ("mlp", "1")
    assert after.inference_count - before.inference_count == 13
    assert after.execution_count - before.execution_count == 4
    s, b = after.inference_stats, before.inference_stats
    assert s.success.count - b.success.count == 4 and s.fail.count - b.fail.count == 1
    for phase in ("queue", "compute_input", "compute_infer", "compute_output"):
        assert getattr(s, phase).count - getattr(b, phase).count == 4
    assert s.compute_infer.ns > b.compute_infer.ns
    by_size = {x.batch_size: x for x in after.batch_stats}
    old_size = {x.batch_size: x.compute_infer.count for x in before.batch_stats}
    assert by_size[4].compute_infer.count - old_size.get(4, 0) == 3
    assert by_size[1].compute_infer.count - old_size.get(1, 0) == 1
    assert after.last_inference >= before.last_inference > 0 or before.execution_count == 0
    every = client.get_inference_statistics().model_stats
    assert {"simple", "mlp", "cnn", "encoder"} <= {m.name for m in every}


# --- bad requests ----------------------------------------------------------------------------


def _simple(**changes: object) -> tuple[str, str, list[grpcclient.InferInput], list[grpcclient.InferRequestedOutput] | None]:
    arrays = example_inputs("simple", 2)
    inputs = infer_inputs(arrays)
    model, version, outputs = "simple", "", None
    if "model" in changes:
        model = str(changes["model"])
    if "version" in changes:
        version = str(changes["version"])
    if changes.get("drop"):
        inputs = inputs[:1]
    if changes.get("rename"):
        inputs[1] = grpcclient.InferInput("INPUT7", [2, 16], "INT32")
        inputs[1].set_data_from_numpy(arrays["INPUT1"])
    if changes.get("dtype"):
        inputs[1] = grpcclient.InferInput("INPUT1", [2, 16], "FP32")
        inputs[1].set_data_from_numpy(arrays["INPUT1"].astype(np.float32))
    if "shape" in changes:
        shape = list(changes["shape"])  # type: ignore[call-overload]
        inputs = infer_inputs({n: np.zeros(shape, np.int32) for n in ("INPUT0", "INPUT1")})
    if changes.get("output"):
        outputs = [grpcclient.InferRequestedOutput("OUTPUT9")]
    return model, version, inputs, outputs


@pytest.mark.parametrize(
    "changes, code, fragment",
    [
        ({"model": "nope"}, "NOT_FOUND", "Request for unknown model: 'nope' is not found"),
        ({"version": "9"}, "NOT_FOUND", "'simple' version 9 is not found"),
        ({"drop": True}, "INVALID_ARGUMENT", "missing required input(s) ['INPUT1']"),
        ({"rename": True}, "INVALID_ARGUMENT", "unexpected inference input 'INPUT7'"),
        ({"dtype": True}, "INVALID_ARGUMENT", "data-type is 'FP32', but model 'simple' expects 'INT32'"),
        ({"shape": [2, 4, 4]}, "INVALID_ARGUMENT", "Expected [-1,16], got [2,4,4]"),
        ({"shape": [2, 15]}, "INVALID_ARGUMENT", "Expected [-1,16], got [2,15]"),
        ({"shape": [9, 16]}, "INVALID_ARGUMENT", "batch-size must be <= 8"),
        ({"output": True}, "INVALID_ARGUMENT", "unexpected inference output 'OUTPUT9'"),
    ],
)
def test_bad_request_gets_its_code_and_the_next_one_works(
    client: grpcclient.InferenceServerClient, changes: dict[str, object], code: str, fragment: str
) -> None:
    model, version, inputs, outputs = _simple(**changes)
    with pytest.raises(InferenceServerException) as info:
        client.infer(model, inputs, model_version=version, outputs=outputs)
    assert status_of(info) == f"StatusCode.{code}"
    assert fragment in info.value.message()
    good_simple(client)


def test_wrong_byte_count_is_invalid_argument(
    stub: service_pb2_grpc.GRPCInferenceServiceStub, client: grpcclient.InferenceServerClient
) -> None:
    request = service_pb2.ModelInferRequest(model_name="simple")
    for name in ("INPUT0", "INPUT1"):
        request.inputs.add(name=name, datatype="INT32", shape=[1, 16])
        request.raw_input_contents.append(bytes(60))
    with pytest.raises(grpc.RpcError) as info:
        stub.ModelInfer(request)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "input byte size mismatch for input 'INPUT0' for model 'simple'. Expected 64, got 60" in info.value.details()
    good_simple(client)


def test_stream_answers_in_stream_and_reports_errors_in_stream(client: grpcclient.InferenceServerClient) -> None:
    results: queue.Queue[tuple[object, object]] = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        arrays = example_inputs("simple", 2)
        client.async_stream_infer("simple", infer_inputs(arrays), request_id="good-1")
        client.async_stream_infer("simple", infer_inputs(example_inputs("simple", 9)), request_id="bad")
        client.async_stream_infer("nope", infer_inputs(arrays), request_id="unknown")
        client.async_stream_infer("simple", infer_inputs(arrays), request_id="good-2")
        got = [results.get(timeout=30) for _ in range(4)]
    finally:
        client.stop_stream()
    goods = {r.get_response().id: r for r, e in got if e is None}
    errors = sorted(str(e) for r, e in got if e is not None)
    assert set(goods) == {"good-1", "good-2"}
    for result in goods.values():
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), arrays["INPUT0"] + arrays["INPUT1"])
    assert len(errors) == 2
    assert any("batch-size must be <= 8" in e for e in errors) and any("'nope' is not found" in e for e in errors)


# --- repository -------------------------------------------------------------------------------


def mul_model() -> onnx.ModelProto:
    """`simple`'s signature with OUTPUT0 = INPUT0 * INPUT1: new bytes, same interface."""
    shape = ["batch", 16]
    graph = helper.make_graph(
        [helper.make_node("Mul", ["INPUT0", "INPUT1"], ["OUTPUT0"]), helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"])],
        "mul",
        [helper.make_tensor_value_info(n, TensorProto.INT32, shape) for n in ("INPUT0", "INPUT1")],
        [helper.make_tensor_value_info(n, TensorProto.INT32, shape) for n in ("OUTPUT0", "OUTPUT1")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


def test_load_with_override_serves_the_new_bytes(client: grpcclient.InferenceServerClient, model_repo: Path) -> None:
    original = (model_repo / "simple" / "1" / "model.onnx").read_bytes()
    config = client.get_model_config("simple", as_json=True)["config"]
    client.load_model("simple", config=json.dumps(config), files={"file:1/model.onnx": mul_model().SerializeToString()})
    arrays = example_inputs("simple", 2)
    result = client.infer("simple", infer_inputs(arrays))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), arrays["INPUT0"] * arrays["INPUT1"])
    assert (model_repo / "simple" / "1" / "model.onnx").read_bytes() == original  # repository untouched
    client.load_model("simple")  # back to the repository's own model
    good_simple(client)


def test_load_new_model_with_override_then_unload(client: grpcclient.InferenceServerClient, model_repo: Path) -> None:
    config = client.get_model_config("mlp", as_json=True)["config"]
    config["name"] = "mlp_copy"
    config["instance_group"] = [{"count": 2, "kind": "KIND_CPU"}]
    files = {
        "file:1/model.onnx": (model_repo / "mlp" / "1" / "model.onnx").read_bytes(),
        # Past gRPC's default 4 MB message limit: the worker raises it, as Triton does.
        "file:1/extra/padding.bin": bytes(6 * 2**20),
    }
    client.load_model("mlp_copy", config=json.dumps(config), files=files)
    assert client.get_model_config("mlp_copy").config.instance_group[0].count == 2
    arrays = example_inputs("mlp", 6)
    np.testing.assert_array_equal(
        client.infer("mlp_copy", infer_inputs(arrays)).as_numpy("OUTPUT"),
        client.infer("mlp", infer_inputs(arrays)).as_numpy("OUTPUT"),
    )
    index = {(m["name"], m.get("state")) for m in client.get_model_repository_index(as_json=True)["models"]}
    assert ("mlp_copy", "READY") in index
    assert not (model_repo / "mlp_copy").exists()
    client.unload_model("mlp_copy")
    with pytest.raises(InferenceServerException) as info:
        client.infer("mlp_copy", infer_inputs(arrays))
    assert status_of(info) == "StatusCode.NOT_FOUND"


def test_unload_then_infer_fails_cleanly(client: grpcclient.InferenceServerClient) -> None:
    arrays = example_inputs("cnn", 1)
    client.unload_model("cnn")
    try:
        assert not client.is_model_ready("cnn")
        with pytest.raises(InferenceServerException) as info:
            client.infer("cnn", infer_inputs(arrays))
        assert status_of(info) == "StatusCode.UNAVAILABLE"
        assert "has no available versions" in info.value.message()
        rows = {m["name"]: m for m in client.get_model_repository_index(as_json=True)["models"]}
        assert (rows["cnn"]["state"], rows["cnn"]["reason"]) == ("UNAVAILABLE", "unloaded")
        assert client.is_server_live()
        good_simple(client)
    finally:
        client.load_model("cnn")
    assert client.infer("cnn", infer_inputs(arrays)).as_numpy("PROBS").shape == (1, 10)


def test_bad_loads_fail_and_the_server_stays_up(client: grpcclient.InferenceServerClient) -> None:
    config = json.dumps({"name": "broken", "max_batch_size": 1})
    with pytest.raises(InferenceServerException) as info:
        client.load_model("broken", config=config, files={"file:1/model.onnx": b"\x08\x01 not onnx \xff" * 50})
    assert status_of(info) == "StatusCode.INVALID_ARGUMENT"
    assert "failed to load 'broken'" in info.value.message()
    with pytest.raises(InferenceServerException) as info:
        client.load_model("ghost")
    assert status_of(info) == "StatusCode.NOT_FOUND"
    with pytest.raises(InferenceServerException) as info:
        client.load_model("mlp", config="{not json")
    assert status_of(info) == "StatusCode.INVALID_ARGUMENT"
    rows = {m["name"]: m for m in client.get_model_repository_index(as_json=True)["models"]}
    assert rows["broken"]["state"] == "UNAVAILABLE" and "ONNX" in rows["broken"]["reason"]
    assert rows["mlp"]["state"] == "READY"  # the failed reload left it serving
    assert client.is_server_ready()
    good_simple(client)
