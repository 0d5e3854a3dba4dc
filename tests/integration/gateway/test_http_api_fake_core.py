"""The REST frontend around a fake InferenceCore (``fake_core``), driven by the
real tritonclient.http (sync and asyncio) and by raw HTTP requests where the
wire itself is checked: health, metadata, config, statistics, the repository
extension, and inference round trips. Errors, malformed requests and fuzzing
are in ``test_http_api_fake_core_errors.py``.

The server runs on its own event loop in a thread (module-scoped), so the
blocking sync client, the asyncio client and hypothesis can all reach it.
"""

from __future__ import annotations

import base64
import gzip
import zlib
from collections.abc import Iterator

import aiohttp
import numpy as np
import orjson
import pytest
import tritonclient.http as httpclient
import tritonclient.http.aio as aiohttpclient
from tritonclient.grpc import model_config_pb2
from tritonclient.utils import InferenceServerException

from protos import codec
from tests.integration.gateway.fake_core import Server, assert_error, binary_body, serve_fake_core


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    yield from serve_fake_core()


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[httpclient.InferenceServerClient]:
    # One client for the module: its __del__ must run on this thread (gevent
    # refuses another), which the server fixture's gc.collect() makes sure of.
    with httpclient.InferenceServerClient(server.url) as c:
        yield c

# --- health, metadata, config, statistics, repository ---------------------------


def test_health_and_server_metadata(server: Server, client: httpclient.InferenceServerClient) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert server.request("GET", "/v2/health/live")[2] == b'{"live":true}'
    assert server.request("GET", "/v2/health/ready")[2] == b'{"ready":true}'
    meta = client.get_server_metadata()
    assert meta == {"name": "infergate", "version": "0.1.0", "extensions": ["binary_tensor_data", "model_repository"]}
    server.core.ready = False
    try:
        assert not client.is_server_ready()
        status, _, body = server.request("GET", "/v2/health/ready")
        assert "not ready" in assert_error(status, body, 503)
    finally:
        server.core.ready = True


def test_model_metadata_has_integer_shapes(server: Server, client: httpclient.InferenceServerClient) -> None:
    meta = client.get_model_metadata("sum")
    assert meta["name"] == "sum" and meta["versions"] == ["1", "2"] and meta["platform"] == "onnxruntime_onnx"
    assert meta["inputs"][0] == {"name": "A", "datatype": "FP32", "shape": [-1, 4]}
    assert meta["outputs"] == [{"name": "SUM", "datatype": "FP32", "shape": [-1, 4]}]
    assert client.get_model_metadata("sum", "2")["name"] == "sum"
    with pytest.raises(InferenceServerException) as err:
        client.get_model_metadata("nope")
    assert err.value.status() == "400" and "unknown model 'nope'" in err.value.message()


def test_model_ready(server: Server, client: httpclient.InferenceServerClient) -> None:
    assert client.is_model_ready("echo")
    assert client.is_model_ready("echo", "1")
    assert not client.is_model_ready("cold")
    status, _, body = server.request("GET", "/v2/models/cold/ready")
    assert "not ready" in assert_error(status, body, 400)
    status, _, body = server.request("GET", "/v2/models/nope/versions/3/ready")
    assert_error(status, body, 400)


def test_model_config_is_snake_case_with_integer_dims(client: httpclient.InferenceServerClient) -> None:
    cfg = client.get_model_config("sum")
    assert cfg["name"] == "sum" and cfg["max_batch_size"] == 8
    assert cfg["input"][0]["dims"] == [4] and cfg["input"][0]["data_type"] == "TYPE_FP32"
    assert cfg["dynamic_batching"]["preferred_batch_size"] == [4, 8]
    assert cfg["dynamic_batching"]["max_queue_delay_microseconds"] == 100
    # Unset sub-messages stay absent: their presence would change the meaning.
    assert "sequence_batching" not in cfg and "ensemble_scheduling" not in cfg
    # The JSON goes back into a ModelConfig, as a load with a config override would.
    from google.protobuf import json_format

    parsed = json_format.ParseDict(cfg, model_config_pb2.ModelConfig())
    assert parsed.dynamic_batching.max_queue_delay_microseconds == 100


def test_statistics_shapes(client: httpclient.InferenceServerClient) -> None:
    stats = client.get_inference_statistics("sum")
    (entry,) = stats["model_stats"]
    assert entry["name"] == "sum" and entry["version"] == "1"
    assert entry["inference_count"] == 7 and entry["execution_count"] == 3
    assert entry["last_inference"] == 1_700_000_000_000
    inf = entry["inference_stats"]
    assert inf["success"] == {"count": 7, "ns": 12_345_678_901}
    for key in ("fail", "queue", "compute_input", "compute_infer", "compute_output"):
        assert inf[key] == {"count": 0, "ns": 0}, key
    assert entry["batch_stats"][0]["batch_size"] == 4
    assert entry["batch_stats"][0]["compute_infer"] == {"count": 2, "ns": 0}
    everything = client.get_inference_statistics()
    assert [m["name"] for m in everything["model_stats"]] == ["echo", "sum"]
    assert client.get_inference_statistics("sum", "2")["model_stats"][0]["version"] == "2"


def test_repository_index(server: Server, client: httpclient.InferenceServerClient) -> None:
    index = client.get_model_repository_index()
    assert index == [
        {"name": "echo", "version": "1", "state": "READY"},
        {"name": "cold", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"},
    ]
    status, _, body = server.request("POST", "/v2/repository/index", b'{"ready": true}')
    assert status == 200 and orjson.loads(body) == [{"name": "echo", "version": "1", "state": "READY"}]
    assert server.core.index_calls[-2:] == [False, True]
    status, _, body = server.request("POST", "/v2/repository/index", b'{"ready": "yes"}')
    assert_error(status, body, 400)


def test_load_with_config_and_files_then_unload(server: Server, client: httpclient.InferenceServerClient) -> None:
    config = orjson.dumps({"name": "newm", "backend": "onnxruntime", "max_batch_size": 4}).decode()
    model_bytes = bytes(range(256)) * 3
    client.load_model("newm", config=config, files={"file:1/model.onnx": model_bytes})
    name, params = server.core.loads[-1]
    assert name == "newm"
    assert params["config"].string_param == config
    assert params["file:1/model.onnx"].bytes_param == model_bytes
    client.load_model("plain")
    assert server.core.loads[-1] == ("plain", {})
    client.unload_model("newm", unload_dependents=True)
    client.unload_model("plain")
    assert server.core.unloads[-2:] == [("newm", True), ("plain", False)]
    status, _, body = server.request("POST", "/v2/repository/models/x/load",
                                     b'{"parameters": {"file:1/model.onnx": "not base64!"}}')
    assert "base64" in assert_error(status, body, 400)
    status, _, body = server.request("POST", "/v2/repository/models/x/unload",
                                     b'{"parameters": {"unload_dependents": 1}}')
    assert_error(status, body, 400)


# --- inference with tritonclient --------------------------------------------

DTYPES = ["BOOL", "INT8", "UINT16", "INT32", "INT64", "UINT64", "FP16", "FP32", "FP64", "BYTES"]


def _sample(datatype: str, shape: tuple[int, ...] = (2, 3)) -> np.ndarray:
    rng = np.random.default_rng(abs(hash(datatype)) % 1000)
    if datatype == "BYTES":
        words = np.array(["", "héllo", "a b", "x" * 40, "🙂", "z"], dtype=object)
        return words[: int(np.prod(shape))].reshape(shape)
    if datatype == "BOOL":
        return rng.integers(0, 2, size=shape).astype(bool)
    dtype = codec.numpy_dtype(datatype)
    if dtype.kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(max(info.min, -100), min(info.max, 100), size=shape, dtype=dtype, endpoint=True)


@pytest.mark.parametrize("binary_in", [True, False], ids=["binary-in", "json-in"])
@pytest.mark.parametrize("datatype", DTYPES)
def test_echo_round_trip(client: httpclient.InferenceServerClient, datatype: str, binary_in: bool) -> None:
    arr = _sample(datatype)
    inp = httpclient.InferInput("X", list(arr.shape), datatype)
    inp.set_data_from_numpy(arr, binary_data=binary_in)
    outputs = [httpclient.InferRequestedOutput("X_out", binary_data=not binary_in)]
    result = client.infer("echo", [inp], outputs=outputs)
    got = result.as_numpy("X_out")
    assert got.shape == arr.shape
    if datatype == "BYTES":  # binary outputs come back as bytes, JSON ones as str
        expected = arr if binary_in else np.vectorize(lambda s: s.encode(), otypes=[object])(arr)
        assert got.tolist() == expected.tolist()
    else:
        np.testing.assert_array_equal(got.astype(arr.dtype), arr)
    out = result.get_output("X_out")
    assert ("data" in out) == binary_in  # the output came back the other way round
    assert ("binary_data_size" in out.get("parameters", {})) != binary_in


def test_sum_default_binary_output_and_version(server: Server, client: httpclient.InferenceServerClient) -> None:
    a = np.arange(8, dtype=np.float32).reshape(2, 4)
    b = np.full((2, 4), 0.5, dtype=np.float32)
    inputs = [httpclient.InferInput("A", [2, 4], "FP32"), httpclient.InferInput("B", [2, 4], "FP32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    result = client.infer("sum", inputs, model_version="2", request_id="req-7")
    np.testing.assert_array_equal(result.as_numpy("SUM"), a + b)
    np.testing.assert_array_equal(result.as_numpy("DIFF"), a - b)
    response = result.get_response()
    assert response["id"] == "req-7" and response["model_name"] == "sum" and response["model_version"] == "2"
    assert all("binary_data_size" in o["parameters"] for o in response["outputs"])
    req = server.core.requests[-1]
    assert req.version == "2" and req.id == "req-7" and req.outputs == []
    assert all(isinstance(t.data, memoryview) for t in req.inputs)  # zero-copy slices of the body


def test_per_output_binary_choice(client: httpclient.InferenceServerClient) -> None:
    a = np.ones((1, 4), dtype=np.float32)
    inputs = [httpclient.InferInput("A", [1, 4], "FP32"), httpclient.InferInput("B", [1, 4], "FP32")]
    for i in inputs:
        i.set_data_from_numpy(a, binary_data=False)
    outputs = [httpclient.InferRequestedOutput("SUM", binary_data=True),
               httpclient.InferRequestedOutput("DIFF", binary_data=False)]
    result = client.infer("sum", inputs, outputs=outputs)
    assert result.get_output("SUM")["parameters"] == {"binary_data_size": 16}
    assert result.get_output("DIFF")["data"] == [0.0] * 4
    np.testing.assert_array_equal(result.as_numpy("SUM"), 2 * a)
    only = client.infer("sum", inputs, outputs=[httpclient.InferRequestedOutput("DIFF")])
    assert [o["name"] for o in only.get_response()["outputs"]] == ["DIFF"]


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compressed_request_and_response(client: httpclient.InferenceServerClient, algorithm: str) -> None:
    arr = np.arange(1000, dtype=np.int32).reshape(10, 100)
    inp = httpclient.InferInput("X", [10, 100], "INT32")
    inp.set_data_from_numpy(arr)
    result = client.infer("echo", [inp], request_compression_algorithm=algorithm,
                          response_compression_algorithm=algorithm)
    np.testing.assert_array_equal(result.as_numpy("X_out"), arr)


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_response_really_compressed(server: Server, encoding: str) -> None:
    doc = {"inputs": [{"name": "X", "datatype": "INT32", "shape": [500], "data": [7] * 500}]}
    status, hdrs, body = server.request("POST", "/v2/models/echo/infer", orjson.dumps(doc),
                                        {"Accept-Encoding": f"identity;q=0.5, {encoding}"})
    assert status == 200 and hdrs["content-encoding"] == encoding
    plain = gzip.decompress(body) if encoding == "gzip" else zlib.decompress(body)
    assert orjson.loads(plain)["outputs"][0]["data"] == [7] * 500


def test_parameters_priority_timeout(server: Server, client: httpclient.InferenceServerClient) -> None:
    inp = httpclient.InferInput("X", [1], "INT32")
    inp.set_data_from_numpy(np.array([1], dtype=np.int32))
    client.infer("echo", [inp], priority=2, timeout=1_500_000, parameters={"tenant": "blue", "n": 3})
    req = server.core.requests[-1]
    assert req.priority == 2 and req.timeout_us == 1_500_000 and req.deadline is not None
    assert req.parameters == {"tenant": "blue", "n": 3}
    with pytest.raises(InferenceServerException) as err:
        client.infer("echo", [inp], parameters={"triton_enable_empty_final_response": True})
    assert err.value.status() == "400" and "triton_" in err.value.message()


def test_large_binary_response_is_streamed_intact(server: Server, client: httpclient.InferenceServerClient) -> None:
    n = 600_000  # 2.4 MB of output: over the size where parts are written one by one
    inp = httpclient.InferInput("N", [1], "INT64")
    inp.set_data_from_numpy(np.array([n], dtype=np.int64))
    z = client.infer("zeros", [inp]).as_numpy("Z")
    assert z.shape == (n,) and not z.any()
    doc = {"inputs": [{"name": "N", "datatype": "INT64", "shape": [1], "data": [n]}],
           "parameters": {"binary_data_output": True}}
    status, hdrs, body = server.request("POST", "/v2/models/zeros/infer", orjson.dumps(doc))
    assert status == 200 and "content-encoding" not in hdrs
    header_length = int(hdrs["inference-header-content-length"])
    assert int(hdrs["content-length"]) == len(body) == header_length + 4 * n
    assert orjson.loads(body[:header_length])["outputs"][0]["parameters"] == {"binary_data_size": 4 * n}


async def test_aio_client_round_trips(server: Server) -> None:
    async with aiohttpclient.InferenceServerClient(server.url) as c:
        assert await c.is_server_live() and await c.is_server_ready()
        assert await c.is_model_ready("echo") and not await c.is_model_ready("cold")
        assert (await c.get_model_metadata("sum"))["inputs"][1]["shape"] == [-1, 4]
        assert (await c.get_model_config("sum"))["input"][0]["dims"] == [4]
        assert (await c.get_inference_statistics("echo"))["model_stats"][0]["inference_count"] == 7
        assert len(await c.get_model_repository_index()) == 2
        # (tritonclient 2.41's asyncio load_model cannot send files: it lacks its base64 import.)
        await c.load_model("m2", config='{"name": "m2"}')
        assert server.core.loads[-1][1]["config"].string_param == '{"name": "m2"}'
        await c.unload_model("m2")
        for datatype, binary in [("BYTES", True), ("BOOL", False), ("FP16", True), ("FP16", False), ("UINT8", True)]:
            arr = _sample(datatype, (3, 2))
            inp = aiohttpclient.InferInput("X", [3, 2], datatype)
            inp.set_data_from_numpy(arr, binary_data=binary)
            # (Its request compression lacks the gzip/zlib imports in 2.41; responses work.)
            result = await c.infer("echo", [inp], request_id=f"aio-{datatype}",
                                   response_compression_algorithm="deflate" if binary else "gzip")
            got = result.as_numpy("X_out")
            if datatype == "BYTES":
                assert [s.decode() for s in got.reshape(-1)] == arr.reshape(-1).tolist()
            else:
                np.testing.assert_array_equal(got, arr)
            assert result.get_response()["id"] == f"aio-{datatype}"
        with pytest.raises(InferenceServerException) as err:
            await c.infer("fail", [inp], parameters={"raise": "overloaded"})
        assert err.value.status() == "503"



async def test_raw_aiohttp_binary_request_with_json_header(server: Server) -> None:
    """The binary extension as a non-tritonclient sends it, with a JSON and a binary output."""
    a = np.arange(4, dtype=np.float32)
    doc = {"id": "raw-1", "inputs": [
        {"name": "A", "datatype": "FP32", "shape": [4], "parameters": {"binary_data_size": 16}},
        {"name": "B", "datatype": "FP32", "shape": [4], "data": [[1, 1], [1, 1]]}],
        "outputs": [{"name": "SUM"}, {"name": "DIFF", "parameters": {"binary_data": True}}]}
    body, headers = binary_body(doc, a.tobytes())
    async with aiohttp.ClientSession(auto_decompress=False) as session:
        async with session.post(f"{server.base}/v2/models/sum/infer", data=body,
                                headers={**headers, "Accept-Encoding": "identity"}) as resp:
            assert resp.status == 200
            payload = await resp.read()
            header_length = int(resp.headers["Inference-Header-Content-Length"])
    head = orjson.loads(payload[:header_length])
    assert head["id"] == "raw-1"
    assert head["outputs"][0] == {"name": "SUM", "datatype": "FP32", "shape": [4], "data": [1.0, 2.0, 3.0, 4.0]}
    assert head["outputs"][1]["parameters"] == {"binary_data_size": 16}
    np.testing.assert_array_equal(np.frombuffer(payload[header_length:], dtype=np.float32), a - 1)


def test_load_body_base64_matches_tritonclient(server: Server) -> None:
    content = b"\x00onnx\xff"
    doc = {"parameters": {"config": "{}", "file:1/model.onnx": base64.b64encode(content).decode()}}
    status, _, _ = server.request("POST", "/v2/repository/models/raw/load", orjson.dumps(doc))
    assert status == 200 and server.core.loads[-1][1]["file:1/model.onnx"].bytes_param == content
