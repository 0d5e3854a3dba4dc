"""Unit tests of protos.json_codec: every datatype through Triton's JSON tensor
form and back, the value types it writes, and each malformed body refused in
Triton's words (element counts, nesting past 100, non-UTF-8 BYTES)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from protos import codec, json_codec
from tests.unit.protos.test_codec import ALL, BF16, FEW, tensors


@pytest.mark.parametrize("datatype", ALL)
@FEW
@given(data=st.data())
def test_json_round_trip(datatype: str, data: st.DataObject) -> None:
    arr = data.draw(tensors(datatype, finite=True, text=True))
    _, shape, raw = codec.encode(arr)
    flat = json_codec.raw_to_json(datatype, shape, raw)
    assert len(flat) == arr.size
    flat = json.loads(json.dumps(flat))
    assert json_codec.json_to_raw(datatype, shape, flat) == raw
    nested = np.array(flat, dtype=np.object_).reshape(arr.shape).tolist() if arr.ndim else flat
    assert json_codec.json_to_raw(datatype, shape, nested) == raw


def test_json_value_types() -> None:
    assert json_codec.raw_to_json("BOOL", [2], b"\x01\x00") == [True, False]
    assert json_codec.raw_to_json("FP16", [1], np.float16(1.5).tobytes()) == [1.5]
    assert json_codec.raw_to_json("BF16", [1], np.array([2.5], BF16).tobytes()) == [2.5]
    assert json_codec.raw_to_json("BYTES", [1], b"\x02\0\0\0\xc3\xa9") == ["é"]
    assert json_codec.json_to_raw("UINT64", [1], [2**64 - 1]) == b"\xff" * 8
    # numpy alone would turn this list into float64 and lose the low bits.
    big = [[0, 2**63 + 1]]
    assert json_codec.json_to_raw("UINT64", [1, 2], big) == np.array(big, np.uint64).tobytes()
    assert json_codec.json_to_raw("FP32", [2], [1, 2.5]) == np.array([1, 2.5], np.float32).tobytes()


def test_raw_to_json_non_utf8_bytes() -> None:
    raw = b"\x01\0\0\0\xff"
    with pytest.raises(codec.CodecError, match="output 'O': BYTES data is not valid UTF-8; request it as binary"):
        json_codec.raw_to_json("BYTES", [1], raw, name="O")
    assert json_codec.raw_to_json("BYTES", [1], raw, errors="replace") == ["\ufffd"]


@pytest.mark.parametrize(
    ("datatype", "shape", "data", "message"),
    [
        ("INT32", [2], [1.5, 2], "INT32 data must be integers that fit INT32"),
        ("INT32", [1], [True], "must be integers"),
        ("INT8", [2], [1, 300], "out of range for INT8"),
        ("UINT8", [1], [-1], "out of range for UINT8"),
        ("INT64", [1], [2**64], "out of range for INT64"),
        ("UINT64", [2], [-1, 2**63 + 1], "out of range for UINT64"),
        ("UINT64", [2], [0.5, 2**63 + 1], "integers that fit UINT64"),
        ("FP32", [1], ["1.0"], "FP32 data must be numbers"),
        ("FP32", [1], [None], "must be numbers"),
        ("BOOL", [2], [1, 0], "BOOL data must be true or false"),
        ("BYTES", [1], [1], "BYTES element 0 must be a string, got int"),
        ("FP32", [1], {"a": 1}, "'data' must be a list, got dict"),
    ],
)
def test_json_errors(datatype: str, shape: list[int], data: object, message: str) -> None:
    with pytest.raises(codec.CodecError, match=message) as info:
        json_codec.json_to_raw(datatype, shape, data, name="in")
    assert str(info.value).startswith("input 'in': ")


@pytest.mark.parametrize(
    ("datatype", "shape", "data", "got"),
    [("FP32", [3], [1, 2], 2), ("FP32", [3], [[1, 2], [3, 4]], 4), ("BYTES", [2], ["a"], 1), ("BYTES", [1], [["a", "b"]], 2)],
)
def test_json_element_count_mismatch_in_tritons_words(datatype: str, shape: list[int], data: object, got: int) -> None:
    # Too few and too many alike: Triton's whole message, nothing after it.
    with pytest.raises(codec.CodecError) as info:
        json_codec.json_to_raw(datatype, shape, data, name="in")
    assert str(info.value) == "Unable to parse 'data': Shape does not match true shape of 'data' field"


@pytest.mark.parametrize(
    ("shape", "words"),
    [([2**4, 2**60 + 2], "causes total element count to exceed maximum size of"),
     ([2**2, 2**60 + 2], "byte size overflow for input 'in'")],
    ids=["element-count", "byte-size"],
)
def test_json_overflow_checked_before_the_data_count(shape: list[int], words: str) -> None:
    # Triton's test_buffer_size_overflow: one value for a shape past int64 meets the overflow checks first.
    with pytest.raises(codec.CodecError, match=words):
        json_codec.json_to_raw("FP32", shape, [1.0], name="in")


def _nested(depth: int, values: list[object]) -> list[object]:
    data: list[object] = values
    for _ in range(depth - 1):
        data = [data]
    return data


@pytest.mark.parametrize("depth", [1, 32, 33, 64, 100])
def test_json_nesting_is_accepted_to_depth_100(depth: int) -> None:
    assert json_codec.json_to_raw("INT32", [2], _nested(depth, [1, 2])) == np.array([1, 2], np.int32).tobytes()
    assert json_codec.json_to_raw("BYTES", [1], _nested(depth, ["x"])) == b"\x01\0\0\0x"


@pytest.mark.parametrize("datatype", ["FP32", "BYTES"])
def test_json_nesting_deeper_than_100_is_refused(datatype: str) -> None:
    value: object = "x" if datatype == "BYTES" else 1.0
    for data in (_nested(101, [value]), [value, _nested(101, [value])]):  # rectangular, and ragged
        with pytest.raises(codec.CodecError, match=r"JSON nesting depth exceeds maximum allowed limit \(100\)$"):
            json_codec.json_to_raw(datatype, [1], data, name="in")
    # Far deeper than Python's recursion limit: still a clear error.
    with pytest.raises(codec.CodecError, match="nesting depth"):
        json_codec.json_to_raw(datatype, [1], _nested(5000, [value]), name="in")


def test_ragged_json_is_read_in_row_major_order_as_triton_does() -> None:
    raw = json_codec.json_to_raw("FP32", [3], [[1, 2], [3]], name="in")
    assert np.frombuffer(raw, np.float32).tolist() == [1.0, 2.0, 3.0]
