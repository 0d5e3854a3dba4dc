"""The gRPC frontend served by a real grpc.aio server on 127.0.0.1 (port 0), in
process, around a fake InferenceCore, driven by the real tritonclient (sync
and asyncio) and by raw stubs where the wire itself is checked.

The server runs on the test's event loop, so the sync client is called
through ``asyncio.to_thread``.
"""

from __future__ import annotations

import asyncio
import queue
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aiogrpcclient
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from gateway.frontends.grpc_api import SERVICE_NAME, GrpcFrontend, add_grpc_services
from gateway.types import InferRequest, InferResponse, Tensor
from protos import codec
from protos.errors import InvalidArgument, ModelNotFound, Overloaded

WAIT_S = 10.0  # bound on waiting for an event that must happen; never a timing assert
GRPC_TIMEOUT_ROUNDING_S = 1.0


class FakeCore:
    """Models: ``echo`` (each input back as ``<name>_out``), ``sum`` (A+B, FP32),
    ``gate`` (waits for ``gate_open``), ``slow`` (never answers), ``fail``
    (raises what the ``raise`` parameter names)."""

    def __init__(self) -> None:
        self.requests: list[InferRequest] = []
        self.seen_at: dict[str, float] = {}  # request id -> loop.time() when the core got it
        self.started = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.gate_open = asyncio.Event()
        self.loads: list[tuple[str, dict[str, service_pb2.ModelRepositoryParameter]]] = []
        self.unloads: list[tuple[str, bool]] = []

    async def infer(self, request: InferRequest) -> InferResponse:
        self.requests.append(request)
        self.seen_at[request.id] = asyncio.get_running_loop().time()
        if request.model == "echo":
            wanted = {o.name for o in request.outputs}
            outs = [Tensor(f"{t.name}_out", t.datatype, t.shape, t.data) for t in request.inputs]
            outs = [t for t in outs if not wanted or t.name in wanted]
        elif request.model == "sum":
            a, b = (codec.decode(t.datatype, t.shape, t.data) for t in request.inputs)
            dt, shape, raw = codec.encode(a + b)
            outs = [Tensor("SUM", dt, tuple(shape), raw)]
        elif request.model in ("gate", "slow"):
            self.started.set()
            try:
                await (self.gate_open.wait() if request.model == "gate" else asyncio.Event().wait())
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
            outs = []
        elif request.model == "dropped":  # the core's own wait was cancelled (e.g. a batcher closing)
            raise asyncio.CancelledError
        elif request.model == "fail":
            kind = request.parameters.get("raise")
            if kind == "overloaded":
                raise Overloaded("queue full", retry_after_s=2.5)
            if kind == "invalid":
                raise InvalidArgument("input 'A' has the wrong shape")
            raise RuntimeError("secret internal detail")
        else:
            raise ModelNotFound(f"unknown model '{request.model}'")
        return InferResponse(request.model, "1", request.id, outs, {"_internal": 1})

    def server_live(self) -> bool:
        return True

    def server_ready(self) -> bool:
        return True

    def server_metadata(self) -> service_pb2.ServerMetadataResponse:
        return service_pb2.ServerMetadataResponse(name="fake", version="9", extensions=["model_repository"])

    def model_ready(self, name: str, version: str = "") -> bool:
        return name == "echo"

    def _known(self, name: str) -> None:
        if name != "echo":
            raise ModelNotFound(f"unknown model '{name}'")

    def model_metadata(self, name: str, version: str = "") -> service_pb2.ModelMetadataResponse:
        self._known(name)
        md = service_pb2.ModelMetadataResponse(name=name, versions=["1"], platform="onnxruntime_onnx")
        md.inputs.add(name="A", datatype="FP32", shape=[-1, 3])
        return md

    def model_config(self, name: str, version: str = "") -> model_config_pb2.ModelConfig:
        self._known(name)
        return model_config_pb2.ModelConfig(name=name, max_batch_size=8)

    async def model_statistics(self, name: str = "", version: str = "") -> service_pb2.ModelStatisticsResponse:
        stats = service_pb2.ModelStatisticsResponse()
        stats.model_stats.add(name=name or "echo", version="1", inference_count=5)
        return stats

    async def repository_index(self, ready_only: bool = False) -> service_pb2.RepositoryIndexResponse:
        index = service_pb2.RepositoryIndexResponse()
        index.models.add(name="echo", version="1", state="READY")
        if not ready_only:
            index.models.add(name="cold", state="UNAVAILABLE")
        return index

    async def load_model(self, name: str, parameters: dict[str, service_pb2.ModelRepositoryParameter]) -> None:
        self.loads.append((name, parameters))

    async def unload_model(self, name: str, unload_dependents: bool = False) -> None:
        self.unloads.append((name, unload_dependents))


@dataclass
class Served:
    core: FakeCore
    frontend: GrpcFrontend
    url: str


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    core = FakeCore()
    server = grpc.aio.server()
    frontend = add_grpc_services(server, core)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    frontend.set_serving(True)
    try:
        yield Served(core, frontend, f"127.0.0.1:{port}")
    finally:
        await server.stop(grace=None)


@pytest.fixture
async def stub(served: Served) -> AsyncIterator[service_pb2_grpc.GRPCInferenceServiceStub]:
    async with grpc.aio.insecure_channel(served.url) as channel:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)


def _input(name: str, arr: np.ndarray) -> grpcclient.InferInput:
    inp = grpcclient.InferInput(name, list(arr.shape), codec.datatype_of(arr.dtype))
    inp.set_data_from_numpy(arr)
    return inp


ARRAYS = {
    "F32": np.arange(6, dtype=np.float32).reshape(2, 3),
    "F16": np.array([[0.5, -1.5]], dtype=np.float16),
    "I64": np.array([[-(2**40)], [7]], dtype=np.int64),
    "U8": np.array([1, 2, 255], dtype=np.uint8),
    "B": np.array([[True, False, True]], dtype=np.bool_),
    "S": np.array([[b"hello", b""], [b"\x00\xff", "\u00e9".encode()]], dtype=np.object_),
}


# ---- inference ---------------------------------------------------------------


async def test_infer_raw_sync_client_round_trips_datatypes(served: Served) -> None:
    def call() -> grpcclient.InferResult:
        with grpcclient.InferenceServerClient(served.url) as client:
            inputs = [_input(n, a) for n, a in ARRAYS.items()]
            return client.infer("echo", inputs, request_id="r-7")

    result = await asyncio.to_thread(call)
    assert result.get_response().id == "r-7"
    for name, arr in ARRAYS.items():
        out = result.as_numpy(f"{name}_out")
        assert out.dtype == arr.dtype or name == "S"
        assert out.shape == arr.shape
        assert out.tolist() == arr.tolist()
    (request,) = served.core.requests
    assert [t.datatype for t in request.inputs] == ["FP32", "FP16", "INT64", "UINT8", "BOOL", "BYTES"]
    assert request.inputs[0].shape == (2, 3) and request.deadline is None
    assert "_internal" not in result.get_response().parameters


async def test_infer_typed_contents_raw_stub(served: Served, stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
    pb = service_pb2.ModelInferRequest(model_name="echo", id="typed")
    typed = {
        "F32": ("FP32", np.array([1.5, -2.0], np.float32)),
        "I16": ("INT16", np.array([-300, 300], np.int16)),
        "B": ("BOOL", np.array([False, True], np.bool_)),
        "S": ("BYTES", np.array([b"a", b"bc"], np.object_)),
    }
    for name, (datatype, arr) in typed.items():
        pb.inputs.add(name=name, datatype=datatype, shape=[2]).contents.CopyFrom(
            codec.raw_to_contents(datatype, codec.encode(arr)[2])
        )
    response = await stub.ModelInfer(pb)
    assert response.id == "typed"
    # Outputs always travel as raw contents, each with datatype and shape.
    assert len(response.raw_output_contents) == len(typed)
    for out, raw, (name, (datatype, arr)) in zip(response.outputs, response.raw_output_contents, typed.items()):
        assert (out.name, out.datatype, list(out.shape)) == (f"{name}_out", datatype, [2])
        assert codec.decode(datatype, [2], raw).tolist() == arr.tolist()


async def test_sum_with_asyncio_client_and_requested_output(served: Served) -> None:
    a = np.random.default_rng(0).random((4, 5), dtype=np.float32)
    b = np.ones((4, 5), np.float32)
    async with aiogrpcclient.InferenceServerClient(served.url) as client:
        result = await client.infer(
            "sum", [_input("A", a), _input("B", b)], outputs=[aiogrpcclient.InferRequestedOutput("SUM")],
            priority=1, timeout=5_000_000, parameters={"note": "x"},
        )  # fmt: skip
    np.testing.assert_array_equal(result.as_numpy("SUM"), a + b)
    (request,) = served.core.requests
    assert (request.priority, request.timeout_us, request.parameters) == (1, 5_000_000, {"note": "x"})
    assert [o.name for o in request.outputs] == ["SUM"]


@pytest.mark.parametrize(
    ("build", "code", "text"),
    [
        ("partial_raw", grpc.StatusCode.INVALID_ARGUMENT, "every input"),
        ("reserved", grpc.StatusCode.INVALID_ARGUMENT, "reserved"),
        ("unknown_model", grpc.StatusCode.NOT_FOUND, "unknown model"),
        ("invalid", grpc.StatusCode.INVALID_ARGUMENT, "wrong shape"),
        ("crash", grpc.StatusCode.INTERNAL, "internal error in the gateway: RuntimeError: secret internal detail"),
        ("overloaded", grpc.StatusCode.UNAVAILABLE, "queue full"),
    ],
)
async def test_errors_map_to_codes(
    served: Served,
    stub: service_pb2_grpc.GRPCInferenceServiceStub,
    caplog: pytest.LogCaptureFixture,
    build: str,
    code: grpc.StatusCode,
    text: str,
) -> None:
    pb = service_pb2.ModelInferRequest(model_name="fail")
    pb.inputs.add(name="A", datatype="FP32", shape=[1])
    pb.raw_input_contents.append(np.zeros(1, np.float32).tobytes())
    if build == "partial_raw":
        pb.inputs.add(name="B", datatype="FP32", shape=[1])
    elif build == "reserved":
        pb.parameters["triton_x"].bool_param = True
    elif build == "unknown_model":
        pb.model_name = "nope"
    else:
        pb.parameters["raise"].string_param = build
    call = stub.ModelInfer(pb)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == code
    assert text in info.value.details()
    if build != "crash":
        assert "secret" not in info.value.details()
    trailing = dict(await call.trailing_metadata() or ())
    assert trailing.get("retry-after") == ("3" if build == "overloaded" else None)
    # Unexpected errors: the cause to the client, the traceback in the log.
    logged = [r for r in caplog.records if r.exc_info and "secret internal detail" in str(r.exc_info[1])]
    assert len(logged) == (1 if build == "crash" else 0)
    if build in ("partial_raw", "reserved"):
        assert served.core.requests == []  # rejected before the core


async def test_trace_settings_answer_tritons_defaults(served: Served) -> None:
    def call() -> dict:
        with grpcclient.InferenceServerClient(served.url) as client:
            return client.get_trace_settings(as_json=True)["settings"]

    settings = await asyncio.to_thread(call)
    assert settings["trace_level"] == {"value": ["OFF"]}
    assert settings["trace_rate"] == {"value": ["1000"]} and settings["trace_mode"] == {"value": ["triton"]}


# ---- deadlines and cancellation --------------------------------------------------


async def test_client_deadline_reaches_core_and_expires(served: Served) -> None:
    async with aiogrpcclient.InferenceServerClient(served.url) as client:
        with pytest.raises(InferenceServerException) as info:
            await client.infer("slow", [_input("A", np.zeros(1, np.float32))], request_id="d", client_timeout=1.0)
    assert info.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    (request,) = served.core.requests
    assert request.deadline is not None
    # gRPC rounds a timeout up on the wire (coarser units for longer ones), hence the slack.
    assert 0.0 < request.deadline - served.core.seen_at["d"] <= 1.0 + GRPC_TIMEOUT_ROUNDING_S
    # The expired RPC cancelled the core's work.
    await asyncio.wait_for(served.core.cancelled.wait(), WAIT_S)


async def test_tighter_request_timeout_leaves_deadline_to_core(served: Served) -> None:
    async with aiogrpcclient.InferenceServerClient(served.url) as client:
        await client.infer("echo", [_input("A", np.zeros(1, np.float32))], timeout=100, client_timeout=60.0)
        await client.infer("echo", [_input("A", np.zeros(1, np.float32))], timeout=90_000_000, client_timeout=60.0)
    loose, tight = served.core.requests
    assert loose.timeout_us == 100 and loose.deadline is None
    # From the client's 60 s, not the request's 90 s timeout.
    assert tight.deadline is not None
    assert 0.0 < tight.deadline - served.core.seen_at[tight.id] <= 60.0 + GRPC_TIMEOUT_ROUNDING_S


async def test_client_cancel_cancels_core(served: Served, stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
    pb = service_pb2.ModelInferRequest(model_name="slow")
    call = stub.ModelInfer(pb)
    await asyncio.wait_for(served.core.started.wait(), WAIT_S)
    assert not served.core.cancelled.is_set()
    call.cancel()
    await asyncio.wait_for(served.core.cancelled.wait(), WAIT_S)


# ---- streaming --------------------------------------------------------------------


async def test_sync_stream_errors_in_stream_and_ids(served: Served) -> None:
    def call() -> list[tuple[str | None, str | None]]:
        got: queue.Queue = queue.Queue()
        with grpcclient.InferenceServerClient(served.url) as client:
            client.start_stream(callback=lambda result, error: got.put((result, error)))
            client.async_stream_infer("echo", [_input("F32", ARRAYS["F32"])], request_id="a")
            client.async_stream_infer("missing", [_input("F32", ARRAYS["F32"])], request_id="b")
            client.async_stream_infer("echo", [_input("S", ARRAYS["S"])], request_id="c")
            items = [got.get(timeout=WAIT_S) for _ in range(3)]
            client.stop_stream()
        out = []
        for result, error in items:
            if error is not None:
                out.append((None, error.message()))
            else:
                name = result.get_response().outputs[0].name
                assert result.as_numpy(name).tolist() == ARRAYS[name[:-4]].tolist()
                out.append((result.get_response().id, None))
        return out

    out = await asyncio.to_thread(call)
    assert sorted(i for i, _ in out if i) == ["a", "c"]
    assert [e for _, e in out if e] == ["unknown model 'missing'"]


async def test_stream_answers_as_requests_complete(served: Served) -> None:
    sent = asyncio.Queue()

    async def requests() -> AsyncIterator[dict]:
        while (item := await sent.get()) is not None:
            yield item

    arr = np.zeros(1, np.float32)
    seen: list[str] = []

    async def converse() -> None:
        async with aiogrpcclient.InferenceServerClient(served.url) as client:
            responses = client.stream_infer(requests())
            sent.put_nowait({"model_name": "gate", "inputs": [_input("A", arr)], "request_id": "first"})
            sent.put_nowait({"model_name": "echo", "inputs": [_input("A", arr)], "request_id": "second"})
            sent.put_nowait({"model_name": "fail", "inputs": [_input("A", arr)], "request_id": "third",
                             "parameters": {"raise": "invalid"}})  # fmt: skip
            async for result, error in responses:
                seen.append(error.message() if error else result.get_response().id)
                if len(seen) == 2:
                    # "first" is still held at the gate: the stream did not wait for it.
                    assert sorted(seen) == ["input 'A' has the wrong shape", "second"]
                    served.core.gate_open.set()
                    sent.put_nowait(None)  # half-close: the stream ends once "first" is written

    # A stream that answered in request order would stall at the gate: bounded, it fails instead.
    await asyncio.wait_for(converse(), WAIT_S)
    assert seen[2:] == ["first"]


async def test_cancel_from_core(served: Served, stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.ModelInfer(service_pb2.ModelInferRequest(model_name="dropped"), timeout=WAIT_S)
    assert info.value.code() == grpc.StatusCode.CANCELLED

    async def requests() -> AsyncIterator[service_pb2.ModelInferRequest]:
        yield service_pb2.ModelInferRequest(model_name="dropped", id="x")
        yield service_pb2.ModelInferRequest(model_name="echo", id="y")

    # In a stream it is one request's error; the stream goes on and ends normally.
    got = [(r.infer_response.id, r.error_message) async for r in stub.ModelStreamInfer(requests(), timeout=WAIT_S)]
    assert sorted(got) == [("x", "the request was cancelled"), ("y", "")]


async def test_stream_cancel_cancels_core(served: Served, stub: service_pb2_grpc.GRPCInferenceServiceStub) -> None:
    async def requests() -> AsyncIterator[service_pb2.ModelInferRequest]:
        yield service_pb2.ModelInferRequest(model_name="slow", id="s")
        await asyncio.Event().wait()  # keep the stream open

    call = stub.ModelStreamInfer(requests())
    await asyncio.wait_for(served.core.started.wait(), WAIT_S)
    call.cancel()
    await asyncio.wait_for(served.core.cancelled.wait(), WAIT_S)


# ---- metadata, repository, health ----------------------------------------------------


async def test_metadata_config_statistics_repository_sync_client(served: Served) -> None:
    def call() -> None:
        with grpcclient.InferenceServerClient(served.url) as client:
            assert client.is_server_live() and client.is_server_ready()
            assert client.get_server_metadata().name == "fake"
            assert client.is_model_ready("echo") and not client.is_model_ready("other")
            assert client.get_model_metadata("echo").inputs[0].shape == [-1, 3]
            assert client.get_model_config("echo").config.max_batch_size == 8
            assert client.get_inference_statistics("echo").model_stats[0].inference_count == 5
            assert [m.name for m in client.get_model_repository_index().models] == ["echo", "cold"]
            client.load_model("echo", config='{"max_batch_size": 4}', files={"file:1/model.onnx": b"\x01\x02"})
            client.unload_model("echo", unload_dependents=True)
            with pytest.raises(InferenceServerException) as info:
                client.get_model_config("other")
            assert info.value.status() == "StatusCode.NOT_FOUND"

    await asyncio.to_thread(call)
    ((name, params),) = served.core.loads
    assert name == "echo"
    assert params["config"].string_param == '{"max_batch_size": 4}'
    assert params["file:1/model.onnx"].bytes_param == b"\x01\x02"
    assert served.core.unloads == [("echo", True)]


async def test_repository_index_ready_only_asyncio_client(served: Served) -> None:
    async with aiogrpcclient.InferenceServerClient(served.url) as client:
        index = await client.get_model_repository_index(as_json=True)
        assert [m["name"] for m in index["models"]] == ["echo", "cold"]
    stub_index = await _call_ready_index(served.url)
    assert [m.name for m in stub_index.models] == ["echo"]


async def _call_ready_index(url: str) -> service_pb2.RepositoryIndexResponse:
    async with grpc.aio.insecure_channel(url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        return await stub.RepositoryIndex(service_pb2.RepositoryIndexRequest(ready=True))


async def test_health_service_and_set_serving(served: Served) -> None:
    async with grpc.aio.insecure_channel(served.url) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        infer = service_pb2_grpc.GRPCInferenceServiceStub(channel)

        async def status(service: str) -> int:
            return (await health.Check(health_pb2.HealthCheckRequest(service=service))).status

        serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
        watch = health.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
        assert (await asyncio.wait_for(watch.read(), WAIT_S)).status == serving
        assert [await status(""), await status(SERVICE_NAME)] == [serving, serving]
        assert (await infer.ServerReady(service_pb2.ServerReadyRequest())).ready
        served.frontend.set_serving(False)
        assert (await asyncio.wait_for(watch.read(), WAIT_S)).status == not_serving
        assert [await status(""), await status(SERVICE_NAME)] == [not_serving, not_serving]
        assert not (await infer.ServerReady(service_pb2.ServerReadyRequest())).ready
        assert (await infer.ServerLive(service_pb2.ServerLiveRequest())).live
        served.frontend.set_serving(True)
        assert (await asyncio.wait_for(watch.read(), WAIT_S)).status == serving
        assert await status(SERVICE_NAME) == serving
        watch.cancel()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await status("no.such.Service")
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_not_serving_until_set() -> None:
    server = grpc.aio.server()
    frontend = add_grpc_services(server, FakeCore())
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            check = health_pb2_grpc.HealthStub(channel).Check
            ready = service_pb2_grpc.GRPCInferenceServiceStub(channel).ServerReady
            assert (await check(health_pb2.HealthCheckRequest())).status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert not (await ready(service_pb2.ServerReadyRequest())).ready
            frontend.set_serving(True)
            assert (await check(health_pb2.HealthCheckRequest())).status == health_pb2.HealthCheckResponse.SERVING
            assert (await ready(service_pb2.ServerReadyRequest())).ready
    finally:
        await server.stop(grace=None)
