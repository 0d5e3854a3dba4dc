"""Unit tests for execution/tensors.py: request checks, decoding and response encoding."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2

from protos import codec
from protos.errors import InferGateError
from execution.tensors import ModelSignature, check_request, decode_inputs, encode_response

SIMPLE = ModelSignature.from_config(
    text_format.Parse(
        'name: "simple" max_batch_size: 8'
        ' input { name: "INPUT0" data_type: TYPE_INT32 dims: 16 }'
        ' input { name: "INPUT1" data_type: TYPE_INT32 dims: 16 }'
        ' output { name: "OUTPUT0" data_type: TYPE_INT32 dims: 16 }'
        ' output { name: "OUTPUT1" data_type: TYPE_INT32 dims: 16 }',
        mc.ModelConfig(),
    )
)
FIXED = ModelSignature.from_config(
    text_format.Parse(
        'name: "fixed" input { name: "T" data_type: TYPE_STRING dims: [2, -1] }'
        ' input { name: "MASK" data_type: TYPE_BOOL dims: 2 optional: true }'
        ' output { name: "O" data_type: TYPE_FP32 dims: 2 }',
        mc.ModelConfig(),
    )
)


def simple_request(batch: int = 2, **overrides: object) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="simple", id="r1")
    for name in ("INPUT0", "INPUT1"):
        request.inputs.add(name=name, datatype="INT32", shape=[batch, 16])
        request.raw_input_contents.append(np.arange(batch * 16, dtype=np.int32).tobytes())
    return request


def test_good_request_passes_with_every_output() -> None:
    checked = check_request(SIMPLE, simple_request(batch=3))
    assert checked.batch_size == 3
    assert checked.output_names == ["OUTPUT0", "OUTPUT1"]


def test_requested_outputs_are_honoured_in_order() -> None:
    request = simple_request()
    for name in ("OUTPUT1", "OUTPUT0"):
        request.outputs.add(name=name)
    assert check_request(SIMPLE, request).output_names == ["OUTPUT1", "OUTPUT0"]


def test_duplicate_requested_outputs_are_refused_as_triton_does() -> None:
    request = simple_request()
    for name in ("OUTPUT1", "OUTPUT1"):
        request.outputs.add(name=name)
    with pytest.raises(InferGateError, match="^output 'OUTPUT1' already exists in request") as info:
        check_request(SIMPLE, request)
    assert info.value.grpc_code == grpc.StatusCode.INVALID_ARGUMENT


def _rename(r: service_pb2.ModelInferRequest) -> None:
    r.inputs[1].name = "INPUT9"


def _drop(r: service_pb2.ModelInferRequest) -> None:
    del r.inputs[1]
    del r.raw_input_contents[1]


def _dtype(r: service_pb2.ModelInferRequest) -> None:
    r.inputs[0].datatype = "FP32"


def _rank(r: service_pb2.ModelInferRequest) -> None:
    r.inputs[0].shape[:] = [2, 4, 4]
    r.inputs[1].shape[:] = [2, 4, 4]


def _width(r: service_pb2.ModelInferRequest) -> None:
    r.inputs[0].shape[:] = [4, 8]


def _mixed_batch(r: service_pb2.ModelInferRequest) -> None:
    r.inputs[1].shape[:] = [1, 16]


def _unknown_output(r: service_pb2.ModelInferRequest) -> None:
    r.outputs.add(name="OUTPUT7")


def _raw_count(r: service_pb2.ModelInferRequest) -> None:
    del r.raw_input_contents[1]


def _shm(r: service_pb2.ModelInferRequest) -> None:
    r.inputs[0].parameters["shared_memory_region"].string_param = "region"


def _negative(r: service_pb2.ModelInferRequest) -> None:
    r.inputs[0].shape[:] = [-2, 16]


@pytest.mark.parametrize(
    "mutate, code, fragment",
    [
        (_rename, grpc.StatusCode.INVALID_ARGUMENT, "unexpected inference input 'INPUT9'"),
        (_drop, grpc.StatusCode.INVALID_ARGUMENT, "missing required input(s) ['INPUT1']"),
        (_dtype, grpc.StatusCode.INVALID_ARGUMENT, "data-type is 'FP32', but model 'simple' expects 'INT32'"),
        (_rank, grpc.StatusCode.INVALID_ARGUMENT, "Expected [-1,16], got [2,4,4]"),
        (_width, grpc.StatusCode.INVALID_ARGUMENT, "Expected [-1,16], got [4,8]"),
        (_mixed_batch, grpc.StatusCode.INVALID_ARGUMENT, "batch size 1 does not match"),
        (_unknown_output, grpc.StatusCode.INVALID_ARGUMENT, "unexpected inference output 'OUTPUT7'"),
        (_raw_count, grpc.StatusCode.INVALID_ARGUMENT, "raw_input_contents has 1 entries for 2 inputs"),
        (_shm, grpc.StatusCode.UNIMPLEMENTED, "shared memory"),
        (_negative, grpc.StatusCode.INVALID_ARGUMENT, "negative dim"),
    ],
)
def test_bad_requests_are_refused(
    mutate: Callable[[service_pb2.ModelInferRequest], None], code: grpc.StatusCode, fragment: str
) -> None:
    request = simple_request()
    mutate(request)
    with pytest.raises(InferGateError) as info:
        check_request(SIMPLE, request)
    assert info.value.grpc_code == code
    assert fragment in info.value.message


@pytest.mark.parametrize("batch", [0, 9])
def test_batch_size_must_fit_max_batch_size(batch: int) -> None:
    with pytest.raises(InferGateError, match="batch-size must be <= 8 for 'simple'") as info:
        check_request(SIMPLE, simple_request(batch=batch))
    assert info.value.grpc_code == grpc.StatusCode.INVALID_ARGUMENT


def test_byte_count_must_match_the_shape() -> None:
    request = simple_request()
    check_request(SIMPLE, request)
    request.raw_input_contents[1] = request.raw_input_contents[1][:-4]
    with pytest.raises(InferGateError, match=r"input byte size mismatch for input 'INPUT1' for model 'simple'. Expected 128, got 124 \(INT32 \[2,16\]") as info:
        decode_inputs(SIMPLE, request)
    assert info.value.grpc_code == grpc.StatusCode.INVALID_ARGUMENT


def test_typed_contents_decode_like_raw() -> None:
    request = service_pb2.ModelInferRequest(model_name="simple")
    values = np.arange(32, dtype=np.int32).reshape(2, 16)
    for name in ("INPUT0", "INPUT1"):
        tensor = request.inputs.add(name=name, datatype="INT32", shape=[2, 16])
        tensor.contents.int_contents.extend(values.ravel().tolist())
    check_request(SIMPLE, request)
    arrays = decode_inputs(SIMPLE, request)
    np.testing.assert_array_equal(arrays["INPUT1"], values)
    assert arrays["INPUT1"].dtype == np.int32


def test_contents_and_raw_together_are_refused() -> None:
    request = simple_request()
    request.inputs[0].contents.int_contents.extend([1] * 32)
    with pytest.raises(InferGateError, match="contents field must not be specified"):
        decode_inputs(SIMPLE, request)


def test_non_batching_model_with_bytes_and_an_optional_input() -> None:
    request = service_pb2.ModelInferRequest(model_name="fixed")
    request.inputs.add(name="T", datatype="BYTES", shape=[2, 3])
    items = np.array([b"a", b"bc", b"", b"def", b"g", b"hi"], dtype=np.object_)
    request.raw_input_contents.append(codec.serialize_bytes_tensor(items))
    checked = check_request(FIXED, request)
    assert checked.batch_size == 1  # Triton's batch size for a model without batching
    arrays = decode_inputs(FIXED, request)
    assert arrays["T"].shape == (2, 3) and arrays["T"][1, 0] == b"def"
    request.inputs[0].shape[:] = [1, 2, 3]
    with pytest.raises(InferGateError, match=r"Expected \[2,-1\], got \[1,2,3\]"):
        check_request(FIXED, request)


def test_metadata_shapes_lead_with_the_batch_dim() -> None:
    assert SIMPLE.full_shape(SIMPLE.inputs["INPUT0"]) == [-1, 16]
    assert FIXED.full_shape(FIXED.inputs["T"]) == [2, -1]


def test_encode_response_puts_outputs_in_raw_contents_only() -> None:
    request = simple_request()
    outputs = {"OUTPUT0": np.ones((2, 16), np.int32), "OUTPUT1": np.zeros((2, 16), np.int32)}
    response = encode_response(request, "1", outputs, ["OUTPUT1"])
    assert (response.model_name, response.model_version, response.id) == ("simple", "1", "r1")
    assert [(o.name, o.datatype, list(o.shape)) for o in response.outputs] == [("OUTPUT1", "INT32", [2, 16])]
    assert not response.outputs[0].HasField("contents")
    assert response.raw_output_contents[0] == np.zeros((2, 16), np.int32).tobytes()
