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

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aiogrpcclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from protos import codec, contents_codec
from tests.integration.gateway.grpc_fake_core import Served, serve_grpc_fake_core

WAIT_S = 10.0  # bound on waiting for an event that must happen; never a timing assert
GRPC_TIMEOUT_ROUNDING_S = 1.0


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    async with serve_grpc_fake_core() as running:
        yield running



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
            contents_codec.raw_to_contents(datatype, codec.encode(arr)[2])
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
