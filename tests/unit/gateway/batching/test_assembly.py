"""Unit tests of gateway.batching.assembly and of the gRPC frontend's response
encoding: a large request's tensors pass to the worker call as they are (no
copy into protobuf) and the bytes sent equal the message built the plain way;
small ones and callers that read the message get plain protobuf; large
outputs go out kept aside with the same wire bytes."""

from __future__ import annotations

import numpy as np
from tritonclient.grpc import service_pb2

from gateway.batching.assembly import build_batch_request, split_batch_response
from gateway.frontends.grpc_wire import encode_infer_response
from gateway.types import InferRequest, InferResponse, RequestedOutput, Tensor
from protos import wire

ROW_FLOATS = 4096  # 16 KiB a row


def request(rid: str, rows: int, seed: int) -> InferRequest:
    data = np.random.default_rng(seed).standard_normal((rows, ROW_FLOATS)).astype(np.float32).tobytes()
    return InferRequest("m", "1", rid, [Tensor("X", "FP32", (rows, ROW_FLOATS), memoryview(data))],
                        [RequestedOutput("Y")], rows=rows)  # fmt: skip


def parsed(message: service_pb2.ModelInferRequest | wire.RawInferRequest) -> service_pb2.ModelInferRequest:
    return service_pb2.ModelInferRequest.FromString(wire.serialize(message))


def test_a_large_request_alone_passes_its_tensor_through_uncopied() -> None:
    r = request("a", 8, 0)  # 128 KiB
    out = build_batch_request("m", "1", [r], [8], True)
    assert isinstance(out, wire.RawInferRequest)
    assert out.raw[0] is r.inputs[0].data  # the very view the frontend made: no copy
    plain = build_batch_request("m", "1", [r], [8], True, raw_aside=False)
    assert isinstance(plain, service_pb2.ModelInferRequest)
    assert parsed(out) == plain  # what the worker receives is unchanged
    assert plain.id == "a" and list(plain.inputs[0].shape) == [8, ROW_FLOATS] and plain.outputs[0].name == "Y"


def test_large_requests_batched_join_once_and_send_the_same_message() -> None:
    batch = [request("a", 3, 1), request("b", 5, 2)]
    out = build_batch_request("m", "1", batch, [3, 5], True)
    assert isinstance(out, wire.RawInferRequest)
    plain = build_batch_request("m", "1", batch, [3, 5], True, raw_aside=False)
    assert parsed(out) == plain
    assert plain.raw_input_contents[0] == bytes(batch[0].inputs[0].data) + bytes(batch[1].inputs[0].data)
    assert list(plain.inputs[0].shape) == [8, ROW_FLOATS] and plain.id == ""


def test_a_small_request_is_plain_protobuf() -> None:
    small = InferRequest("m", "1", "s", [Tensor("X", "FP32", (1, 4), memoryview(b"\x00" * 16))], [], rows=1)
    out = build_batch_request("m", "1", [small], [1], True)
    assert isinstance(out, service_pb2.ModelInferRequest)
    assert list(out.raw_input_contents) == [b"\x00" * 16]


def test_split_of_a_batch_gives_each_request_its_rows() -> None:
    batch = [request("a", 3, 1), request("b", 5, 2)]
    response = service_pb2.ModelInferResponse(model_name="m", model_version="1")
    response.outputs.add(name="Y", datatype="FP32", shape=[8, ROW_FLOATS])
    response.raw_output_contents.append(bytes(batch[0].inputs[0].data) + bytes(batch[1].inputs[0].data))
    answers = split_batch_response(response, batch, [3, 5], True)
    assert [bytes(a.outputs[0].data) for a in answers] == [bytes(r.inputs[0].data) for r in batch]
    assert [a.outputs[0].shape for a in answers] == [(3, ROW_FLOATS), (5, ROW_FLOATS)]


def test_large_outputs_go_out_kept_aside_with_the_same_wire_bytes() -> None:
    r = request("a", 8, 3)
    big = bytes(r.inputs[0].data)
    resp = InferResponse("m", "1", "a", [Tensor("Y", "FP32", (8, ROW_FLOATS), big), Tensor("Z", "INT8", (1,), b"\x07")])
    aside = encode_infer_response(resp, r, raw_aside=True)
    assert isinstance(aside, wire.RawInferResponse)
    assert aside.raw[0] is big  # appended to nothing: written once, by the serializer's join
    plain = encode_infer_response(resp, r)
    assert isinstance(plain, service_pb2.ModelInferResponse)
    assert service_pb2.ModelInferResponse.FromString(wire.serialize(aside)) == plain
    assert list(plain.raw_output_contents) == [big, b"\x07"] and plain.id == "a"
