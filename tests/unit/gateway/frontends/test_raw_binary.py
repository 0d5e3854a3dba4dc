"""Tests for gateway/frontends/raw_binary.py: Triton's raw binary request rules."""

from __future__ import annotations

import numpy as np
import pytest
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2

from gateway.frontends.raw_binary import decode_raw_request
from protos.errors import InvalidArgument

_WIRE = {mc.TYPE_FP32: "FP32", mc.TYPE_INT64: "INT64", mc.TYPE_STRING: "BYTES"}


def _model(max_batch: int, *inputs: tuple[str, int, list[int]]) -> tuple[service_pb2.ModelMetadataResponse, mc.ModelConfig]:
    config = mc.ModelConfig(name="m", max_batch_size=max_batch)
    metadata = service_pb2.ModelMetadataResponse(name="m")
    for name, data_type, dims in inputs:
        config.input.add(name=name, data_type=data_type, dims=dims)
        metadata.inputs.add(name=name, datatype=_WIRE[data_type], shape=([-1] if max_batch else []) + dims)
    return metadata, config


def _decode(body: bytes, max_batch: int, *inputs: tuple[str, int, list[int]]):  # type: ignore[no-untyped-def]
    metadata, config = _model(max_batch, *inputs)
    return decode_raw_request(body, model="m", version="", metadata=metadata, config=config)


def test_fixed_shape_gets_the_batch_dim_and_binary_outputs() -> None:
    body = np.arange(4, dtype=np.float32).tobytes()
    decoded = _decode(body, 8, ("X", mc.TYPE_FP32, [4]))
    (tensor,) = decoded.request.inputs
    assert (tensor.name, tensor.datatype, tensor.shape, bytes(tensor.data)) == ("X", "FP32", (1, 4), body)
    assert decoded.binary_data_output and decoded.request.outputs == []


def test_one_variable_dim_is_deduced_from_the_size() -> None:
    decoded = _decode(bytes(8 * 6), 0, ("T", mc.TYPE_INT64, [2, -1]))
    assert decoded.request.inputs[0].shape == (2, 3)


def test_bytes_input_is_one_length_prefixed_element() -> None:
    decoded = _decode(b"hello", 4, ("S", mc.TYPE_STRING, [1]))
    tensor = decoded.request.inputs[0]
    assert tensor.shape == (1, 1) and bytes(tensor.data) == b"\x05\0\0\0hello"


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ((("A", mc.TYPE_FP32, [1]), ("B", mc.TYPE_FP32, [1])),
         "Raw request must only have 1 input (found 1) to be deduced but got 2 inputs in 'm' model configuration"),
        ((("X", mc.TYPE_FP32, [-1, -1]),),
         "The shape of the raw input 'X' can not be deduced because there are more than one variable-sized dimension"),
        ((("S", mc.TYPE_STRING, [-1]),), "For BYTE datatype raw input 'S', the model must have input shape [1]"),
        ((("S", mc.TYPE_STRING, [2]),), "For BYTE datatype raw input 'S', the model must have input shape [1]"),
    ],
    ids=["two-inputs", "two-variable-dims", "bytes-variable", "bytes-two-elements"],
)
def test_refusals_in_tritons_words(inputs: tuple[tuple[str, int, list[int]], ...], message: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        _decode(b"\0" * 8, 0, *inputs)
    assert str(info.value) == message
