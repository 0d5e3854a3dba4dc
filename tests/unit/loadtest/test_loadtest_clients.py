"""Wire encodings and statistics parsing of the bench clients (no sockets)."""

from __future__ import annotations

import grpc
import numpy as np
import orjson
from tritonclient.grpc import service_pb2

from loadtest.clients import ServerStats, grpc_error_kind, grpc_request_bytes, http_body
from loadtest.inputs import InputTensor
from protos import codec

PAYLOAD = (
    InputTensor("INPUT0", "INT32", (2, 3), np.arange(6, dtype="<i4").tobytes()),
    InputTensor("NAMES", "BYTES", (1, 2), codec.serialize_bytes_tensor(np.array([b"ab", b"c"], dtype=object))),
)


def test_grpc_request_carries_raw_contents() -> None:
    request = service_pb2.ModelInferRequest.FromString(grpc_request_bytes("simple", "2", PAYLOAD))
    assert request.model_name == "simple" and request.model_version == "2"
    assert [(t.name, t.datatype, list(t.shape)) for t in request.inputs] == [
        ("INPUT0", "INT32", [2, 3]), ("NAMES", "BYTES", [1, 2])]
    assert list(request.raw_input_contents) == [PAYLOAD[0].raw, PAYLOAD[1].raw]
    assert not request.outputs  # all outputs, as perf_analyzer asks


def test_http_json_body() -> None:
    body, headers = http_body(PAYLOAD, binary=False)
    doc = orjson.loads(body)
    assert headers["Content-Type"] == "application/json"
    assert doc["inputs"][0] == {"name": "INPUT0", "datatype": "INT32", "shape": [2, 3], "data": [0, 1, 2, 3, 4, 5]}
    assert doc["inputs"][1]["data"] == ["ab", "c"]


def test_http_binary_body() -> None:
    body, headers = http_body(PAYLOAD, binary=True)
    length = int(headers["Inference-Header-Content-Length"])
    doc = orjson.loads(body[:length])
    assert doc["parameters"] == {"binary_data_output": True}
    sizes = [t["parameters"]["binary_data_size"] for t in doc["inputs"]]
    assert sizes == [24, len(PAYLOAD[1].raw)]
    assert body[length:] == PAYLOAD[0].raw + PAYLOAD[1].raw


def _stats_proto() -> service_pb2.ModelStatisticsResponse:
    response = service_pb2.ModelStatisticsResponse()
    for version, rows in (("1", 10), ("2", 100)):
        entry = response.model_stats.add(name="m", version=version, inference_count=rows, execution_count=rows // 2)
        entry.inference_stats.success.count = rows
        entry.inference_stats.success.ns = rows * 1000
        entry.inference_stats.queue.count = rows
        entry.inference_stats.queue.ns = rows * 300
        entry.inference_stats.compute_infer.count = rows // 2
        entry.inference_stats.compute_infer.ns = rows * 500
    return response


def test_server_stats_from_proto_and_json_agree() -> None:
    proto = _stats_proto()
    both = ServerStats.from_entries(proto.model_stats)
    assert both.inference_count == 110 and both.execution_count == 55 and both.success_count == 110
    assert both.queue_ns == 110 * 300 and both.compute_infer_count == 55
    only2 = ServerStats.from_entries(proto.model_stats, version="2")
    assert only2.inference_count == 100
    # The HTTP statistics endpoint's JSON form (Triton's shape).
    doc = {"model_stats": [{
        "name": "m", "version": "1", "inference_count": 10, "execution_count": 5,
        "inference_stats": {"success": {"count": 10, "ns": 10000}, "queue": {"count": 10, "ns": 3000},
                            "compute_infer": {"count": 5, "ns": 5000}, "fail": {"count": 0, "ns": 0}},
    }]}  # fmt: skip
    assert ServerStats.from_entries(doc["model_stats"]) == ServerStats.from_entries(proto.model_stats, version="1")


def test_server_stats_delta() -> None:
    before = ServerStats(inference_count=10, execution_count=5, success_count=10, queue_ns=100)
    after = ServerStats(inference_count=50, execution_count=15, success_count=30, queue_ns=400)
    delta = after - before
    assert (delta.inference_count, delta.execution_count, delta.success_count, delta.queue_ns) == (40, 10, 20, 300)


def test_grpc_error_kinds() -> None:
    assert grpc_error_kind(grpc.StatusCode.DEADLINE_EXCEEDED) == "timeout"
    assert grpc_error_kind(grpc.StatusCode.UNAVAILABLE) == "UNAVAILABLE"
