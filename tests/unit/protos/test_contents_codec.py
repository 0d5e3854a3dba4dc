"""Unit tests of protos.contents_codec: every datatype with a typed contents
field through ``InferTensorContents`` and back, the field each one uses, and
each malformed contents refused with a message saying what is wrong."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2

from protos import codec, contents_codec
from tests.unit.protos.test_codec import FEW, same_tensor, tensors

# The typed contents field the KServe v2 proto assigns to each datatype.
CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents",
}  # fmt: skip


def test_unknown_datatype() -> None:
    for call in (lambda: contents_codec.contents_to_raw("FP8", [1], service_pb2.InferTensorContents()),
                 lambda: contents_codec.raw_to_contents("FP8", b"\0")):
        with pytest.raises(codec.CodecError, match="unknown datatype 'FP8'; expected one of BOOL"):
            call()


@pytest.mark.parametrize("datatype", sorted(CONTENTS_FIELD))
@FEW
@given(data=st.data())
def test_contents_round_trip(datatype: str, data: st.DataObject) -> None:
    arr = data.draw(tensors(datatype))
    _, shape, raw = codec.encode(arr)
    contents = contents_codec.raw_to_contents(datatype, raw)
    assert [f.name for f, _ in contents.ListFields()] == ([CONTENTS_FIELD[datatype]] if arr.size else [])
    # Through the wire, as a client would send it.
    contents = service_pb2.InferTensorContents.FromString(contents.SerializeToString())
    back = codec.decode(datatype, shape, contents_codec.contents_to_raw(datatype, shape, contents))
    if arr.dtype.kind == "f":  # Python floats may quiet a signalling NaN
        assert np.array_equal(back, arr, equal_nan=True)
    else:
        assert same_tensor(back, arr)


@pytest.mark.parametrize("datatype", ["FP16", "BF16"])
def test_contents_has_no_half_precision_field(datatype: str) -> None:
    with pytest.raises(codec.CodecError, match=f"{datatype} has no typed contents field"):
        contents_codec.contents_to_raw(datatype, [1], service_pb2.InferTensorContents(fp32_contents=[1.0]))
    with pytest.raises(codec.CodecError, match="no typed contents field"):
        contents_codec.raw_to_contents(datatype, b"\0\0")


def test_contents_errors() -> None:
    with pytest.raises(codec.CodecError, match=r"input 'X': expected 3 values in fp32_contents for FP32 \[3\], got 2"):
        contents_codec.contents_to_raw("FP32", [3], service_pb2.InferTensorContents(fp32_contents=[1, 2]), name="X")
    with pytest.raises(codec.CodecError, match=r"got 0 \(data found in int_contents\)"):
        contents_codec.contents_to_raw("INT64", [1], service_pb2.InferTensorContents(int_contents=[1]))
    with pytest.raises(codec.CodecError, match="out of range for INT8"):
        contents_codec.contents_to_raw("INT8", [2], service_pb2.InferTensorContents(int_contents=[1, 300]))
    with pytest.raises(codec.CodecError, match="out of range for UINT16"):
        contents_codec.contents_to_raw("UINT16", [1], service_pb2.InferTensorContents(uint_contents=[70000]))
    with pytest.raises(codec.CodecError, match="not a whole number of INT32"):
        contents_codec.raw_to_contents("INT32", b"\0" * 5)
    ok = contents_codec.contents_to_raw("INT8", [2], service_pb2.InferTensorContents(int_contents=[-128, 127]))
    assert ok == b"\x80\x7f"


def test_shape_overflow_answered_before_the_value_count() -> None:
    contents = service_pb2.InferTensorContents(fp32_contents=[1.0])
    with pytest.raises(codec.CodecError, match="causes total element count to exceed maximum size of"):
        contents_codec.contents_to_raw("FP32", [2**4, 2**60 + 2], contents, name="X")
    with pytest.raises(codec.CodecError, match="^byte size overflow for input 'X'"):
        contents_codec.contents_to_raw("FP32", [2**2, 2**60 + 2], contents, name="X")
