"""gRPC frontend wire conversion (no sockets): ModelInferRequest -> InferRequest
and InferResponse -> ModelInferResponse."""

from __future__ import annotations

import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from gateway.frontends.grpc_api import decode_infer_request, encode_infer_response
from gateway.types import InferRequest, InferResponse, Tensor
from protos import codec
from protos.errors import InvalidArgument, Unsupported


def _raw_request(**arrays: np.ndarray) -> service_pb2.ModelInferRequest:
    pb = service_pb2.ModelInferRequest(model_name="m", model_version="2", id="req-1")
    for name, arr in arrays.items():
        datatype, shape, raw = codec.encode(arr)
        pb.inputs.add(name=name, datatype=datatype, shape=shape)
        pb.raw_input_contents.append(raw)
    return pb


def test_raw_inputs_decode_with_int_shapes_and_id() -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    s = np.array([[b"x", b""]], dtype=np.object_)
    req = decode_infer_request(_raw_request(A=a, S=s))
    assert (req.model, req.version, req.id) == ("m", "2", "req-1")
    assert [t.name for t in req.inputs] == ["A", "S"]
    assert req.inputs[0].shape == (2, 3) and all(type(d) is int for d in req.inputs[0].shape)
    assert req.inputs[0].datatype == "FP32" and req.inputs[0].data == a.tobytes()
    assert req.inputs[1].data == codec.serialize_bytes_tensor(s)
    assert req.deadline is None and req.outputs == []


@pytest.mark.parametrize(
    ("datatype", "field", "values", "dtype"),
    [
        ("INT32", "int_contents", [1, -2, 3, 4], np.int32),
        ("INT8", "int_contents", [1, -2, 3, 127], np.int8),
        ("UINT16", "uint_contents", [1, 2, 65535, 0], np.uint16),
        ("INT64", "int64_contents", [1, -(2**40), 3, 4], np.int64),
        ("FP64", "fp64_contents", [0.5, -1.25, 3.0, 1e300], np.float64),
        ("BOOL", "bool_contents", [True, False, False, True], np.bool_),
    ],
)
def test_typed_contents_become_raw(datatype: str, field: str, values: list, dtype: type) -> None:
    pb = service_pb2.ModelInferRequest(model_name="m")
    tensor = pb.inputs.add(name="X", datatype=datatype, shape=[2, 2])
    getattr(tensor.contents, field).extend(values)
    req = decode_infer_request(pb)
    assert req.inputs[0].data == np.array(values, dtype=dtype).tobytes()


def test_raw_contents_must_cover_every_input() -> None:
    pb = _raw_request(A=np.zeros(2, np.float32))
    pb.inputs.add(name="B", datatype="INT32", shape=[1])
    with pytest.raises(InvalidArgument, match="every input"):
        decode_infer_request(pb)


def test_contents_beside_raw_contents_named_before_the_entry_count() -> None:
    # Triton checks each input before counting raw_input_contents: the input with contents is named.
    pb = _raw_request(A=np.zeros(2, np.float32))
    pb.inputs.add(name="B", datatype="INT32", shape=[1]).contents.int_contents.append(1)
    with pytest.raises(InvalidArgument) as info:
        decode_infer_request(pb)
    assert str(info.value) == (
        f"contents field must not be specified when using raw_input_contents for 'B' for model '{pb.model_name}'"
    )


def test_contents_beside_raw_contents_rejected() -> None:
    pb = _raw_request(A=np.zeros(1, np.int32))
    pb.inputs[0].contents.int_contents.append(0)
    with pytest.raises(InvalidArgument) as info:
        decode_infer_request(pb)
    assert str(info.value) == (
        f"contents field must not be specified when using raw_input_contents for 'A' for model '{pb.model_name}'"
    )


def test_duplicate_requested_outputs_rejected() -> None:
    pb = _raw_request(A=np.zeros(1, np.int32))
    pb.outputs.add(name="Y")
    pb.outputs.add(name="Y")
    with pytest.raises(InvalidArgument, match="^output 'Y' already exists in request$"):
        decode_infer_request(pb)


def test_fp16_has_no_typed_contents() -> None:
    pb = service_pb2.ModelInferRequest(model_name="m")
    pb.inputs.add(name="H", datatype="FP16", shape=[1])
    with pytest.raises(InvalidArgument, match="raw_input_contents"):
        decode_infer_request(pb)


def test_request_parameters() -> None:
    pb = _raw_request(A=np.zeros(1, np.float32))
    pb.parameters["priority"].uint64_param = 2
    pb.parameters["timeout"].int64_param = 1500
    pb.parameters["binary_data_output"].bool_param = True
    pb.parameters["sequence_id"].int64_param = 7
    pb.parameters["note"].string_param = "hi"
    pb.parameters["scale"].double_param = 0.5
    out = pb.outputs.add(name="Y")
    out.parameters["classification"].int64_param = 3
    out.parameters["binary_data"].bool_param = True
    req = decode_infer_request(pb)
    assert (req.priority, req.timeout_us) == (2, 1500)
    assert req.parameters == {"sequence_id": 7, "note": "hi", "scale": 0.5}
    # classification is the frontend's (class_count): taken out of the parameters workers see.
    assert [(o.name, o.parameters, o.classification) for o in req.outputs] == [("Y", {}, 3)]


@pytest.mark.parametrize("key", ["triton_enable_empty_final_response", "triton_anything"])
def test_reserved_parameter_rejected(key: str) -> None:
    pb = _raw_request(A=np.zeros(1, np.float32))
    pb.parameters[key].bool_param = True
    with pytest.raises(InvalidArgument, match="reserved"):
        decode_infer_request(pb)
    # The stream allows the one key Triton defines for it.
    if key == "triton_enable_empty_final_response":
        decode_infer_request(pb, allowed_reserved=frozenset({key}))


@pytest.mark.parametrize("param", ["bool_param", "string_param"])
def test_priority_must_be_an_integer(param: str) -> None:
    pb = _raw_request(A=np.zeros(1, np.float32))
    setattr(pb.parameters["priority"], param, True if param == "bool_param" else "1")
    with pytest.raises(InvalidArgument, match="priority"):
        decode_infer_request(pb)


def test_shared_memory_inputs_unsupported() -> None:
    pb = _raw_request(A=np.zeros(1, np.float32))
    pb.inputs[0].parameters["shared_memory_region"].string_param = "r"
    with pytest.raises(Unsupported, match="shared memory"):
        decode_infer_request(pb)


def test_encode_sets_raw_outputs_datatype_shape_and_echoes_id() -> None:
    request = InferRequest(model="m", version="", id="abc", inputs=[], outputs=[])
    data = np.arange(4, dtype=np.int64).tobytes()
    resp = InferResponse(
        model="m",
        version="3",
        id="",
        outputs=[
            Tensor("Y", "INT64", (2, 2), memoryview(data)[: len(data)]),
            Tensor("S", "BYTES", (1,), codec.serialize_bytes_tensor(np.array([b"ok"], dtype=object))),
        ],
        parameters={"_rows": 2, "flag": True, "big": 2**63 + 1, "n": -3, "x": 1.5, "s": "t"},
    )
    pb = encode_infer_response(resp, request)
    assert (pb.model_name, pb.model_version, pb.id) == ("m", "3", "abc")
    assert [(o.name, o.datatype, list(o.shape)) for o in pb.outputs] == [("Y", "INT64", [2, 2]), ("S", "BYTES", [1])]
    assert pb.raw_output_contents[0] == data
    assert codec.deserialize_bytes_tensor(pb.raw_output_contents[1]).tolist() == [b"ok"]
    assert not any(o.HasField("contents") for o in pb.outputs)
    params = {k: v.WhichOneof("parameter_choice") for k, v in pb.parameters.items()}
    assert params == {
        "flag": "bool_param", "big": "uint64_param", "n": "int64_param", "x": "double_param", "s": "string_param",
    }  # fmt: skip
