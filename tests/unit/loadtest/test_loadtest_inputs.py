"""Bench inputs: signatures from metadata, shapes, random/zero data, JSON data files."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from loadtest.config import BenchError
from loadtest.inputs import ModelSignature, TensorSpec, build_payloads, make_signature, resolve_dims
from protos import codec


def _metadata_proto() -> service_pb2.ModelMetadataResponse:
    md = service_pb2.ModelMetadataResponse(name="encoder", versions=["1"], platform="onnxruntime_onnx")
    md.inputs.add(name="TOKENS", datatype="INT64", shape=[-1, -1])
    md.outputs.add(name="HIDDEN", datatype="FP32", shape=[-1, -1, 64])
    return md


def test_signature_from_proto_and_json_strips_the_batch_dim() -> None:
    sig = make_signature(_metadata_proto(), 16)
    assert sig == ModelSignature("encoder", "1", 16, (TensorSpec("TOKENS", "INT64", (-1,)),),
                                 (TensorSpec("HIDDEN", "FP32", (-1, 64)),))
    doc = {"name": "simple", "versions": ["1"], "platform": "x",
           "inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [-1, 16]}],
           "outputs": [{"name": "OUTPUT0", "datatype": "INT32", "shape": [-1, 16]}]}
    sig = make_signature(doc, 8)
    assert sig.inputs == (TensorSpec("INPUT0", "INT32", (16,)),) and sig.max_batch_size == 8
    # Non-batching (or no config): shapes are full shapes.
    nobatch = make_signature(doc, None)
    assert nobatch.max_batch_size == 0 and nobatch.inputs[0].dims == (-1, 16)


SIMPLE = ModelSignature("simple", "1", 8, (TensorSpec("INPUT0", "INT32", (16,)), TensorSpec("INPUT1", "INT32", (16,))),
                        ())
ENCODER = ModelSignature("encoder", "1", 16, (TensorSpec("TOKENS", "INT64", (-1,)),), ())


def test_resolve_dims() -> None:
    assert resolve_dims(SIMPLE, {}) == {"INPUT0": (16,), "INPUT1": (16,)}
    assert resolve_dims(ENCODER, {"TOKENS": (12,)}) == {"TOKENS": (12,)}
    with pytest.raises(BenchError, match="--shape TOKENS"):
        resolve_dims(ENCODER, {})
    with pytest.raises(BenchError, match="unknown"):
        resolve_dims(SIMPLE, {"NOPE": (1,)})
    with pytest.raises(BenchError, match="does not fit"):
        resolve_dims(SIMPLE, {"INPUT0": (15,)})


def test_random_inputs_are_seeded_and_in_range() -> None:
    (payload,) = build_payloads(ENCODER, batch_size=4, shapes={"TOKENS": (12,)}, seed=3, int_range=(0, 1000))
    (again,) = build_payloads(ENCODER, batch_size=4, shapes={"TOKENS": (12,)}, seed=3, int_range=(0, 1000))
    (other,) = build_payloads(ENCODER, batch_size=4, shapes={"TOKENS": (12,)}, seed=4, int_range=(0, 1000))
    (tokens,) = payload
    assert tokens.name == "TOKENS" and tokens.datatype == "INT64" and tokens.shape == (4, 12)
    values = codec.decode("INT64", tokens.shape, tokens.raw)
    assert values.min() >= 0 and values.max() < 1000 and len(np.unique(values)) > 10
    assert again == payload and other != payload
    (default_range,) = build_payloads(ENCODER, batch_size=1, shapes={"TOKENS": (64,)})
    assert codec.decode("INT64", (1, 64), default_range[0].raw).max() < 100


def test_random_inputs_every_datatype() -> None:
    dts = ["BOOL", "UINT8", "INT8", "INT16", "INT32", "UINT64", "FP16", "FP32", "FP64", "BYTES"]
    sig = ModelSignature("m", "1", 0, tuple(TensorSpec(f"I_{d}", d, (2, 3)) for d in dts), ())
    (payload,) = build_payloads(sig, batch_size=1, int_range=(-5, 300), string_length=5)
    for tensor in payload:
        assert tensor.shape == (2, 3)
        values = codec.decode(tensor.datatype, tensor.shape, tensor.raw)
        if tensor.datatype == "BYTES":
            assert all(len(v) == 5 for v in values.reshape(-1))
        elif tensor.datatype in ("UINT8", "INT8", "INT16", "INT32", "UINT64"):
            info = np.iinfo(codec.numpy_dtype(tensor.datatype))
            assert values.min() >= max(-5, info.min) and values.max() < min(300, int(info.max) + 1)
        elif tensor.datatype.startswith("FP"):
            assert 0.0 <= values.min() and values.max() < 1.0
    with pytest.raises(BenchError, match="no UINT8"):
        build_payloads(ModelSignature("m", "1", 0, (TensorSpec("U", "UINT8", (1,)),), ()), batch_size=1,
                       int_range=(-10, -1))


def test_zero_inputs_and_batch_checks() -> None:
    (payload,) = build_payloads(SIMPLE, batch_size=8, input_data="zero")
    assert all(t.shape == (8, 16) and t.raw == bytes(8 * 16 * 4) for t in payload)
    with pytest.raises(BenchError, match="max_batch_size"):
        build_payloads(SIMPLE, batch_size=9)
    nobatch = ModelSignature("m", "1", 0, (TensorSpec("X", "FP32", (4,)),), ())
    with pytest.raises(BenchError, match="does not batch"):
        build_payloads(nobatch, batch_size=2)
    (payload,) = build_payloads(nobatch, batch_size=1, input_data="zero")
    assert payload[0].shape == (4,)


def _write(tmp_path: Path, doc: object) -> str:
    path = tmp_path / "data.json"
    path.write_text(json.dumps(doc))
    return str(path)


def test_json_data_file_rows_and_batching(tmp_path: Path) -> None:
    rows = [{"INPUT0": list(range(i, i + 16)), "INPUT1": [[1] * 8, [2] * 8]} for i in range(3)]
    path = _write(tmp_path, {"data": rows})
    one = build_payloads(SIMPLE, batch_size=1, input_data=path)
    assert len(one) == 3
    assert codec.decode("INT32", (1, 16), one[2][0].raw).tolist() == [list(range(2, 18))]
    # Batch 2 over 3 rows: [r0, r1], [r2, r0] (cycling).
    two = build_payloads(SIMPLE, batch_size=2, input_data=path)
    assert len(two) == 2 and two[1][0].shape == (2, 16)
    assert codec.decode("INT32", (2, 16), two[1][0].raw)[:, 0].tolist() == [2, 0]
    assert codec.decode("INT32", (2, 16), two[0][1].raw)[0].tolist() == [1] * 8 + [2] * 8


def test_json_data_file_content_shape_and_b64(tmp_path: Path) -> None:
    raw = np.arange(5, dtype="<i8").tobytes()
    path = _write(tmp_path, {"data": [
        {"TOKENS": {"content": [1, 2, 3], "shape": [3]}},
        {"TOKENS": {"b64": base64.b64encode(raw).decode(), "shape": [5]}},
    ]})  # fmt: skip
    first, second = build_payloads(ENCODER, batch_size=1, input_data=path)
    assert first[0].shape == (1, 3) and codec.decode("INT64", (1, 3), first[0].raw).tolist() == [[1, 2, 3]]
    assert second[0].shape == (1, 5) and second[0].raw == raw
    # Rows of different lengths cannot share one batch.
    with pytest.raises(BenchError, match="different shapes"):
        build_payloads(ENCODER, batch_size=2, input_data=path)
    # --shape fills dims the file does not give.
    path2 = _write(tmp_path, {"data": [{"TOKENS": [7, 8]}]})
    (only,) = build_payloads(ENCODER, batch_size=1, input_data=path2, shapes={"TOKENS": (2,)})
    assert only[0].shape == (1, 2)
    with pytest.raises(BenchError, match="shape"):
        build_payloads(ENCODER, batch_size=1, input_data=path2)


@pytest.mark.parametrize(
    ("doc", "match"),
    [
        ({"rows": []}, "expected"),
        ({"data": []}, "expected"),
        ({"data": [{"INPUT0": [0] * 16}]}, "missing input"),
        ({"data": [{"INPUT0": [0] * 16, "INPUT1": [0] * 16, "X": [1]}]}, "unknown input"),
        ({"data": [{"INPUT0": [0] * 15, "INPUT1": [0] * 16}]}, "expected 16"),
        ({"data": [{"INPUT0": [0.5] * 16, "INPUT1": [0] * 16}]}, "INT32"),
        ({"data": [[{"INPUT0": [0] * 16}]]}, "sequence"),
        ({"data": [{"INPUT0": {"b64": "!!"}, "INPUT1": [0] * 16}]}, "entry 0"),
    ],
)
def test_json_data_file_errors(tmp_path: Path, doc: object, match: str) -> None:
    with pytest.raises(BenchError, match=match):
        build_payloads(SIMPLE, batch_size=1, input_data=_write(tmp_path, doc))


def test_missing_data_file() -> None:
    with pytest.raises(BenchError, match="--input-data"):
        build_payloads(SIMPLE, batch_size=1, input_data="/nonexistent/data.json")
