"""Unit tests of protos.codec: round trips of every datatype through raw bytes
and row splits (JSON: test_json_codec.py; typed contents: test_contents_codec.py); byte-for-byte agreement with
tritonclient's BYTES encoding; and that each malformed input raises
CodecError with a message saying what is wrong."""

from __future__ import annotations

import struct

import ml_dtypes
import numpy as np
import pytest
import tritonclient.utils as tc_utils
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from protos import codec, json_codec
from protos.errors import InvalidArgument

FIXED = ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
         "FP16", "FP32", "FP64", "BF16"]  # fmt: skip
ALL = FIXED + ["BYTES"]
FEW = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SHAPES = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=4)
BF16 = np.dtype(ml_dtypes.bfloat16)


def _finite_bf16_bits(bits: int) -> bool:
    return (bits & 0x7F80) != 0x7F80


@st.composite
def tensors(draw, datatype: str, shape=SHAPES, finite: bool = False, text: bool = False) -> np.ndarray:
    """An array of ``datatype``; ``finite`` leaves out NaN and inf, ``text`` makes BYTES valid UTF-8."""
    dims = draw(shape)
    count = int(np.prod(dims, dtype=np.int64))
    if datatype == "BYTES":
        element = st.text(max_size=8) if text else st.binary(max_size=12)
        items = draw(st.lists(element, min_size=count, max_size=count))
        if text:
            items = [s.encode("utf-8") for s in items]
        arr = np.empty(count, dtype=np.object_)
        arr[:] = items
        return arr.reshape(dims)
    if datatype == "BF16":
        bits = st.integers(0, 0xFFFF).filter(_finite_bf16_bits) if finite else st.integers(0, 0xFFFF)
        return draw(hnp.arrays(np.uint16, dims, elements=bits)).view(BF16)
    dtype = codec.numpy_dtype(datatype)
    if finite and dtype.kind == "f":
        elements = hnp.from_dtype(dtype, allow_nan=False, allow_infinity=False)
        return draw(hnp.arrays(dtype, dims, elements=elements))
    return draw(hnp.arrays(dtype, dims))


def same_tensor(a: np.ndarray, b: np.ndarray) -> bool:
    if a.dtype == np.object_:
        return a.shape == b.shape and a.tolist() == b.tolist()
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


# --- datatypes --------------------------------------------------------------


def test_codec_error_is_a_client_error() -> None:
    assert issubclass(codec.CodecError, InvalidArgument)
    assert codec.CodecError("x").http_status == 400


@pytest.mark.parametrize("datatype", ALL)
def test_datatype_table_is_inverse_of_datatype_of(datatype: str) -> None:
    assert codec.datatype_of(codec.numpy_dtype(datatype)) == datatype
    assert codec.DATATYPES[datatype] == codec.numpy_dtype(datatype)


@pytest.mark.parametrize(
    ("dtype", "datatype"),
    [(np.float32, "FP32"), (">i8", "INT64"), (np.bool_, "BOOL"), ("S4", "BYTES"), ("U3", "BYTES"),
     (object, "BYTES"), (BF16, "BF16"), (np.float16, "FP16"), (np.uint64, "UINT64")],
)  # fmt: skip
def test_datatype_of(dtype: object, datatype: str) -> None:
    assert codec.datatype_of(dtype) == datatype


@pytest.mark.parametrize("dtype", [np.complex64, "M8[s]", [("a", "i4")]])
def test_datatype_of_unsupported(dtype: object) -> None:
    with pytest.raises(codec.CodecError, match="no KServe datatype"):
        codec.datatype_of(dtype)


def test_unknown_datatype_everywhere() -> None:
    calls = [
        lambda: codec.numpy_dtype("FP8"),
        lambda: codec.byte_size("FP8", [1]),
        lambda: codec.decode("FP8", [1], b"\0"),
        lambda: codec.validate_raw("FP8", [1], b"\0"),
        lambda: json_codec.json_to_raw("FP8", [1], [1]),
        lambda: json_codec.raw_to_json("FP8", [1], b"\0"),
        lambda: codec.split_rows("FP8", [1], b"\0", [1]),
    ]
    for call in calls:
        with pytest.raises(codec.CodecError, match="unknown datatype 'FP8'; expected one of BOOL"):
            call()


def test_element_count_and_byte_size() -> None:
    assert codec.element_count([]) == 1
    assert codec.element_count([2, 0, 3]) == 0
    assert codec.element_count((np.int64(2), 3)) == 6
    assert codec.byte_size("FP32", [1, 64]) == 256
    assert codec.byte_size("BF16", [3]) == 6
    assert codec.byte_size("BOOL", [5]) == 5
    assert codec.byte_size("BYTES", [5]) is None
    with pytest.raises(codec.CodecError, match="negative dim"):
        codec.element_count([1, -1])
    with pytest.raises(codec.CodecError, match="negative dim"):
        codec.byte_size("BYTES", [-1])
    with pytest.raises(codec.CodecError, match="non-integer dim"):
        codec.element_count([1.5])


# --- raw round trips ----------------------------------------------------------


@pytest.mark.parametrize("datatype", ALL)
@FEW
@given(data=st.data())
def test_encode_decode_round_trip(datatype: str, data: st.DataObject) -> None:
    arr = data.draw(tensors(datatype))
    got_type, shape, raw = codec.encode(arr)
    assert (got_type, shape) == (datatype, list(arr.shape))
    if datatype != "BYTES":
        assert len(raw) == codec.byte_size(datatype, shape)
    codec.validate_raw(datatype, shape, raw)
    back = codec.decode(datatype, shape, raw)
    assert same_tensor(back, arr)
    assert codec.decode(datatype, shape, memoryview(raw)).shape == arr.shape


STRUCT_FORMAT = {"BOOL": "?", "UINT8": "B", "UINT16": "H", "UINT32": "I", "UINT64": "Q", "INT8": "b",
                 "INT16": "h", "INT32": "i", "INT64": "q", "FP16": "e", "FP32": "f", "FP64": "d"}  # fmt: skip


@pytest.mark.parametrize("datatype", FIXED)
def test_fixed_size_wire_bytes(datatype: str) -> None:
    """Raw tensors are little-endian, whatever dtype the caller's array has."""
    values = [True, False] if datatype == "BOOL" else [1, 2]
    if datatype == "BF16":
        wire, native = struct.pack("<2H", 0x3F80, 0x4000), np.array(values, BF16)
    else:
        wire = struct.pack("<2" + STRUCT_FORMAT[datatype], *values)
        native = np.array(values, tc_utils.triton_to_np_dtype(datatype))
        assert codec.encode(native.astype(native.dtype.newbyteorder(">")))[2] == wire
    assert codec.encode(native)[2] == wire
    assert codec.decode(datatype, [2], wire).tolist() == values


def test_encode_makes_little_endian_row_major_bytes() -> None:
    arr = np.arange(12, dtype=">f4").reshape(3, 4)
    expected = np.arange(12, dtype="<f4").reshape(3, 4)
    assert codec.encode(arr)[2] == expected.tobytes()
    assert codec.encode(arr.T)[2] == np.ascontiguousarray(expected.T).tobytes()
    assert codec.encode(expected[:, ::2])[2] == np.ascontiguousarray(expected[:, ::2]).tobytes()


def test_str_and_bytes_arrays_encode_as_utf8() -> None:
    assert codec.encode(np.array(["a", "é"]))[2] == b"\x01\0\0\0a\x02\0\0\0\xc3\xa9"
    assert codec.encode(np.array([b"ab", b""]))[2] == b"\x02\0\0\0ab\0\0\0\0"
    mixed = np.array([b"\0\xff", "x", bytearray(b"y")], dtype=object)
    assert codec.deserialize_bytes_tensor(codec.serialize_bytes_tensor(mixed)).tolist() == [b"\0\xff", b"x", b"y"]


def test_serialize_rejects_non_bytes_element() -> None:
    with pytest.raises(codec.CodecError, match="element 1 is int; elements must be bytes or str"):
        codec.serialize_bytes_tensor(np.array([b"a", 3], dtype=object))


@settings(max_examples=40, deadline=None)
@given(items=st.lists(st.binary(max_size=16) | st.text(max_size=8), min_size=1, max_size=12))
def test_bytes_encoding_matches_tritonclient(items: list[bytes | str]) -> None:
    arr = np.empty(len(items), dtype=np.object_)
    arr[:] = items
    arr = arr.reshape(1, -1) if len(items) % 2 else arr.reshape(2, -1)
    ours = codec.serialize_bytes_tensor(arr)
    assert ours == tc_utils.serialize_byte_tensor(arr).item()
    assert codec.deserialize_bytes_tensor(ours).tolist() == tc_utils.deserialize_bytes_tensor(ours).tolist()


@settings(max_examples=20, deadline=None)
@given(items=st.lists(st.binary(min_size=1, max_size=6), min_size=1, max_size=6))
def test_numpy_bytes_array_matches_tritonclient(items: list[bytes]) -> None:
    arr = np.array(items, dtype=np.bytes_)
    assert codec.serialize_bytes_tensor(arr) == tc_utils.serialize_byte_tensor(arr).item()


# --- malformed BYTES and sizes ------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "count", "message"),
    [
        (b"\x05\0\0\0abc", None, "claims 5 bytes but only 3 remain"),
        (b"\x01\0\0\0a\x02\0", None, "truncated inside a length prefix at byte 5"),
        (b"\x01\0\0\0a", 2, "holds 1 elements, expected 2"),
        (b"\x01\0\0\0a\0\0\0\0", 1, "4 trailing bytes after 1 elements"),
        (b"\xff\xff\xff\xff", 1, "claims 4294967295 bytes"),
        (b"x", 0, "1 trailing bytes after 0 elements"),
    ],
)
def test_deserialize_malformed_bytes(raw: bytes, count: int | None, message: str) -> None:
    with pytest.raises(codec.CodecError, match=message):
        codec.deserialize_bytes_tensor(raw, count)


@settings(max_examples=40, deadline=None)
@given(items=st.lists(st.binary(max_size=8), min_size=1, max_size=6), data=st.data())
def test_every_truncation_of_bytes_is_rejected(items: list[bytes], data: st.DataObject) -> None:
    arr = np.empty(len(items), dtype=np.object_)
    arr[:] = items
    raw = codec.serialize_bytes_tensor(arr)
    cut = data.draw(st.integers(0, len(raw) - 1))
    with pytest.raises(codec.CodecError, match="BYTES"):
        codec.deserialize_bytes_tensor(raw[:cut], len(items))
    with pytest.raises(codec.CodecError, match="input 'T'"):
        codec.validate_raw("BYTES", [len(items)], raw[:cut], name="T")
    with pytest.raises(codec.CodecError, match="input 'T'"):
        codec.decode("BYTES", [len(items)], raw[:cut], name="T")


def test_validate_raw_messages() -> None:
    with pytest.raises(codec.CodecError) as info:
        codec.validate_raw("FP32", [1, 64], b"\0" * 255, name="X")
    assert str(info.value) == "input byte size mismatch for input 'X'. Expected 256, got 255 (FP32 [1,64] takes 256 bytes)"
    with pytest.raises(codec.CodecError) as info:
        codec.validate_raw("FP32", [1, 64], b"\0" * 255, name="X", model="mlp")
    assert str(info.value).startswith("input byte size mismatch for input 'X' for model 'mlp'. Expected 256, got 255")
    with pytest.raises(codec.CodecError, match=r"^output byte size mismatch for output 'Y'. Expected 0, got 8 "):
        codec.validate_raw("INT64", [0, 3], b"\0" * 8, name="Y", role="output")
    # Triton's order: the element count's overflow, then the byte size's, before the data is counted.
    with pytest.raises(codec.CodecError, match=r"^input 'Z' for model 'm': shape \[4611686018427387904,64\] causes "
                                               r"total element count to exceed maximum size of 9223372036854775807$"):
        codec.validate_raw("FP32", [2**62, 64], b"", name="Z", model="m")
    with pytest.raises(codec.CodecError, match=r"^byte size overflow for input 'Z' for model 'm': FP32 \[1152921504606846978,4\]"):
        codec.validate_raw("FP32", [2**60 + 2, 4], b"", name="Z", model="m")
    with pytest.raises(codec.CodecError, match="causes total element count to exceed maximum size of"):
        codec.validate_raw("BYTES", [2**40, 2**40], b"", name="Z")
    with pytest.raises(codec.CodecError, match=r"^tensor: BYTES \[1\] has 1 bytes after its 1 elements$"):
        codec.validate_raw("BYTES", [1], b"\0\0\0\0x")
    with pytest.raises(codec.CodecError, match="ends after 1 of 2 elements"):
        codec.validate_raw("BYTES", [2], b"\0\0\0\0")
    with pytest.raises(codec.CodecError, match=r"^byte size mismatch for tensor. Expected 16, got 8 \(FP64 \[2\]"):
        codec.decode("FP64", [2], b"\0" * 8)


# --- batching -------------------------------------------------------------------


@st.composite
def row_counts(draw, batch: int) -> list[int]:
    cuts = sorted(draw(st.lists(st.integers(0, batch), max_size=4)))
    bounds = [0, *cuts, batch]
    return [b - a for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("datatype", ALL)
@FEW
@given(data=st.data())
def test_split_rows_inverts_concat_rows(datatype: str, data: st.DataObject) -> None:
    shape = hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=5)
    arr = data.draw(tensors(datatype, shape=shape))
    _, dims, raw = codec.encode(arr)
    rows = data.draw(row_counts(arr.shape[0]))
    parts = codec.split_rows(datatype, dims, raw, rows)
    assert len(parts) == len(rows)
    assert codec.concat_rows(parts) == raw
    start = 0
    for part, n in zip(parts, rows):
        assert bytes(part) == codec.encode(arr[start : start + n])[2]
        start += n
    assert codec.concat_rows([codec.encode(arr[:1])[2], codec.encode(arr[1:])[2]]) == raw


def test_split_rows_errors() -> None:
    raw = np.zeros((4, 2), np.float32).tobytes()
    with pytest.raises(codec.CodecError, match=r"row counts \[1, 2\] do not add up to the batch size 4"):
        codec.split_rows("FP32", [4, 2], raw, [1, 2])
    with pytest.raises(codec.CodecError, match="do not add up"):
        codec.split_rows("FP32", [4, 2], raw, [5, -1])
    with pytest.raises(codec.CodecError, match="scalar"):
        codec.split_rows("FP32", [], raw[:4], [1])
    with pytest.raises(codec.CodecError, match=r"Expected 32, got 31 \(FP32 \[4,2\]"):
        codec.split_rows("FP32", [4, 2], raw[:-1], [2, 2])
    good = codec.serialize_bytes_tensor(np.array([b"a", b"bb"], dtype=object))
    with pytest.raises(codec.CodecError, match="claims 2 bytes but only 1 remain"):
        codec.split_rows("BYTES", [2], good[:-1], [1, 1])
    with pytest.raises(codec.CodecError, match="3 trailing bytes"):
        codec.split_rows("BYTES", [2], good + b"xyz", [1, 1])
    with pytest.raises(codec.CodecError, match="ends after 2 of 3 elements"):
        codec.split_rows("BYTES", [3], good, [3])


def test_split_rows_is_zero_copy() -> None:
    raw = bytearray(np.arange(6, dtype=np.int32).tobytes())
    first, second = codec.split_rows("INT32", [3, 2], raw, [1, 2])
    raw[0] = 9
    assert first[0] == 9 and len(second) == 16
    assert struct.unpack("<2i", first) == (9, 1)
