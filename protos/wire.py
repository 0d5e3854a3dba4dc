"""Large KServe inference messages with their tensor bytes kept out of protobuf.

A ``ModelInferRequest`` carries its tensors in ``raw_input_contents`` (a
``ModelInferResponse`` in ``raw_output_contents``): repeated ``bytes``
fields of the top-level message. Parsing such a message with protobuf copies
every tensor into the message, reading a field copies it again into a Python
``bytes``, and building the next hop's message and serializing it copy it
twice more. For large messages the gateway instead:

- :func:`parse_infer_request`: scans the top-level fields of the wire bytes,
  keeps the raw contents as ``memoryview`` slices of them (no copy) and parses
  only the rest (names, shapes, parameters) with protobuf;
- :class:`RawInferRequest` (and :class:`RawInferResponse`): a message
  header plus raw contents kept aside,
  whose ``SerializeToString`` writes the header and appends each raw entry in
  protobuf's own wire form, with one join -- the same bytes protobuf would
  write for the whole message (fields may come in another order, which
  protobuf parsers accept).

Small messages (under :data:`SPLIT_MIN_BYTES`) take the plain protobuf path:
there the scan would cost more than the copies it saves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2

Buffer = bytes | bytearray | memoryview

RAW_INPUT_FIELD = service_pb2.ModelInferRequest.DESCRIPTOR.fields_by_name["raw_input_contents"].number
RAW_OUTPUT_FIELD = service_pb2.ModelInferResponse.DESCRIPTOR.fields_by_name["raw_output_contents"].number
# Below this many bytes a message is parsed and written by protobuf alone.
SPLIT_MIN_BYTES = 64 * 1024

_LENGTH_DELIMITED = 2


def _varint(data: memoryview, pos: int) -> tuple[int, int]:
    """The varint at ``pos`` and the position after it."""
    value = shift = 0
    end = len(data)
    while True:
        if pos >= end:
            raise DecodeError("truncated message: a varint runs past the end")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise DecodeError("malformed varint: more than 10 bytes")


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def split_field(data: Buffer, number: int) -> tuple[bytes, list[memoryview]]:
    """``data`` (one serialized message) without field ``number``, and that field's entries.

    The field must be a repeated length-delimited one (``bytes``); each entry
    comes back as a ``memoryview`` slice of ``data``, in wire order. The rest
    keeps every other field's bytes as they were, for protobuf to parse.
    Raises ``DecodeError`` on a malformed message, as protobuf would.
    """
    mv = memoryview(data).cast("B")
    end = len(mv)
    parts: list[memoryview] = []
    rest: list[memoryview] = []
    kept_from = pos = 0
    while pos < end:
        start = pos
        key, pos = _varint(mv, pos)
        wire_type = key & 7
        if key >> 3 == 0:
            raise DecodeError("malformed message: field number 0")
        if wire_type == 0:
            _, pos = _varint(mv, pos)
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        elif wire_type == _LENGTH_DELIMITED:
            size, body = _varint(mv, pos)
            pos = body + size
            if pos <= end and key >> 3 == number:
                if kept_from < start:
                    rest.append(mv[kept_from:start])
                parts.append(mv[body:pos])
                kept_from = pos
        else:  # groups (3, 4) are not in these messages; anything else is corrupt
            raise DecodeError(f"malformed message: wire type {wire_type}")
        if pos > end:
            raise DecodeError("truncated message: a field runs past the end")
    if kept_from < end:
        rest.append(mv[kept_from:end])
    return b"".join(rest), parts


def field_pieces(number: int, parts: Sequence[Buffer]) -> list[Buffer]:
    """``parts`` as entries of repeated bytes field ``number``, in wire form (to join)."""
    tag = _encode_varint((number << 3) | _LENGTH_DELIMITED)
    pieces: list[Buffer] = []
    for part in parts:
        pieces.append(tag + _encode_varint(memoryview(part).nbytes))
        pieces.append(part)
    return pieces


@dataclass(slots=True)
class RawInferRequest:
    """A ``ModelInferRequest`` whose ``raw_input_contents`` are kept beside it, not in it.

    ``header`` holds everything else (its own ``raw_input_contents`` empty);
    ``raw`` the entries, bytes or memoryviews, in order. It serializes to the
    wire form of the whole message, so it goes to any KServe server as is.
    """

    header: service_pb2.ModelInferRequest
    raw: list[Buffer] = field(default_factory=list)

    @property
    def id(self) -> str:
        return self.header.id

    def SerializeToString(self) -> bytes:  # noqa: N802 -- protobuf's name: grpc serializers call it
        return b"".join([self.header.SerializeToString(), *field_pieces(RAW_INPUT_FIELD, self.raw)])

    def to_message(self) -> service_pb2.ModelInferRequest:
        """A plain protobuf message (copies the raw contents): for code that reads them."""
        pb = service_pb2.ModelInferRequest()
        pb.CopyFrom(self.header)
        pb.raw_input_contents.extend(bytes(r) for r in self.raw)
        return pb


@dataclass(slots=True)
class RawInferResponse:
    """A ``ModelInferResponse`` whose ``raw_output_contents`` are kept beside it (see :class:`RawInferRequest`)."""

    header: service_pb2.ModelInferResponse
    raw: list[Buffer] = field(default_factory=list)

    def SerializeToString(self) -> bytes:  # noqa: N802 -- protobuf's name: grpc serializers call it
        return b"".join([self.header.SerializeToString(), *field_pieces(RAW_OUTPUT_FIELD, self.raw)])

    def to_message(self) -> service_pb2.ModelInferResponse:
        pb = service_pb2.ModelInferResponse()
        pb.CopyFrom(self.header)
        pb.raw_output_contents.extend(bytes(r) for r in self.raw)
        return pb


def parse_infer_request(data: bytes) -> service_pb2.ModelInferRequest | RawInferRequest:
    """A serialized ``ModelInferRequest``: parsed by protobuf when small, else split (no copy of the tensors)."""
    if len(data) < SPLIT_MIN_BYTES:
        return service_pb2.ModelInferRequest.FromString(data)
    rest, raw = split_field(data, RAW_INPUT_FIELD)
    return RawInferRequest(service_pb2.ModelInferRequest.FromString(rest), list(raw))


@dataclass(slots=True)
class ReceivedInferRequest:
    """A ``ModelInferRequest`` as received: its wire bytes, and the message parsed from them.

    ``message`` is what :func:`parse_infer_request` makes of ``data``; ``data``
    is kept so that a call the gateway need not read goes on as it came
    (the relay lane, ``gateway.core.relay``).
    """

    data: bytes
    message: service_pb2.ModelInferRequest | RawInferRequest

    @property
    def header(self) -> service_pb2.ModelInferRequest:
        """Everything but the raw contents (all of it for a small message, whose raw contents stay in it)."""
        message = self.message
        return message.header if isinstance(message, RawInferRequest) else message

    @property
    def id(self) -> str:
        return self.header.id


def receive_infer_request(data: bytes) -> ReceivedInferRequest:
    """A serialized ``ModelInferRequest`` parsed (:func:`parse_infer_request`), its bytes kept beside."""
    return ReceivedInferRequest(data, parse_infer_request(data))


Serializable = (service_pb2.ModelInferRequest | service_pb2.ModelInferResponse | RawInferRequest | RawInferResponse
                | bytes)


def serialize(message: Serializable) -> bytes:
    """A serializer for grpc: a protobuf message, one with its raw contents kept aside, or a message's
    bytes as another server wrote them (a relayed answer), which go out unchanged."""
    if isinstance(message, bytes):
        return message
    return message.SerializeToString()
