"""Unit tests of protos.wire: a large message split with its raw contents kept
aside parses to what protobuf parses, the kept-aside form serializes to bytes
protobuf reads back as the same message, the tensors are views of the
received bytes (no copy), and malformed bytes raise protobuf's DecodeError."""

from __future__ import annotations

import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2

from protos import wire

FEW = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CONTENTS = st.lists(st.binary(max_size=300), max_size=4)


def request(raws: list[bytes], *, model: str = "m", rid: str = "r1") -> service_pb2.ModelInferRequest:
    pb = service_pb2.ModelInferRequest(model_name=model, model_version="2", id=rid)
    pb.parameters["priority"].int64_param = 3
    for i, raw in enumerate(raws):
        pb.inputs.add(name=f"IN{i}", datatype="UINT8", shape=[len(raw)])
    pb.raw_input_contents.extend(raws)
    pb.outputs.add(name="OUT")
    return pb


@FEW
@given(raws=CONTENTS, model=st.text(max_size=20))
def test_split_then_rejoin_is_the_message_protobuf_reads(raws: list[bytes], model: str) -> None:
    pb = request(raws, model=model)
    rest, parts = wire.split_field(pb.SerializeToString(), wire.RAW_INPUT_FIELD)
    header = service_pb2.ModelInferRequest.FromString(rest)
    assert list(header.raw_input_contents) == []
    assert [bytes(p) for p in parts] == raws
    joined = wire.RawInferRequest(header, list(parts)).SerializeToString()
    assert service_pb2.ModelInferRequest.FromString(joined) == pb


@FEW
@given(raws=CONTENTS)
def test_response_kept_aside_serializes_to_the_same_message(raws: list[bytes]) -> None:
    header = service_pb2.ModelInferResponse(model_name="m", id="x")
    for i, raw in enumerate(raws):
        header.outputs.add(name=f"O{i}", datatype="UINT8", shape=[len(raw)])
    whole = service_pb2.ModelInferResponse()
    whole.CopyFrom(header)
    whole.raw_output_contents.extend(raws)
    aside = wire.RawInferResponse(header, [memoryview(r) for r in raws])
    assert service_pb2.ModelInferResponse.FromString(aside.SerializeToString()) == whole
    assert aside.to_message() == whole


def test_large_request_keeps_its_tensors_as_views_of_the_received_bytes() -> None:
    big = bytes(range(256)) * (wire.SPLIT_MIN_BYTES // 256 + 1)
    data = request([big, b"small"]).SerializeToString()
    parsed = wire.parse_infer_request(data)
    assert isinstance(parsed, wire.RawInferRequest)
    assert parsed.id == "r1"
    assert parsed.header.model_name == "m" and [t.name for t in parsed.header.inputs] == ["IN0", "IN1"]
    assert all(isinstance(r, memoryview) and r.obj is data for r in parsed.raw)  # no copy
    assert [bytes(r) for r in parsed.raw] == [big, b"small"]
    assert parsed.to_message() == request([big, b"small"])
    # The serializer for grpc takes either form and writes the same message.
    assert service_pb2.ModelInferRequest.FromString(wire.serialize(parsed)) == request([big, b"small"])


def test_small_request_is_a_plain_protobuf_message() -> None:
    parsed = wire.parse_infer_request(request([b"abc"]).SerializeToString())
    assert isinstance(parsed, service_pb2.ModelInferRequest)
    assert list(parsed.raw_input_contents) == [b"abc"]


def test_large_entry_lengths_take_multibyte_varints() -> None:
    big = b"\x01" * (3 * 2**20 + 17)
    header = service_pb2.ModelInferRequest(model_name="m")
    out = wire.RawInferRequest(header, [big, memoryview(b"")]).SerializeToString()
    assert list(service_pb2.ModelInferRequest.FromString(out).raw_input_contents) == [big, b""]


@pytest.mark.parametrize(
    "data",
    [
        b"\x3a\x05ab",  # field 7 says 5 bytes, 2 follow
        b"\x3a",  # a length that never comes
        b"\x0a\x80",  # a varint cut short
        b"\x00\x01",  # field number 0
        b"\x0b\x01",  # wire type 3 (groups): not in these messages
    ],
)
def test_malformed_bytes_raise_decode_error(data: bytes) -> None:
    with pytest.raises(DecodeError):
        wire.split_field(data, wire.RAW_INPUT_FIELD)
    with pytest.raises(DecodeError):
        wire.parse_infer_request(data + b"\x12\x00" * wire.SPLIT_MIN_BYTES)
