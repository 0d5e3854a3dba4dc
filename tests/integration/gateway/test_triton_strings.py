"""BYTES tensors through ``infergate up`` to the ONNX worker and back, byte
for byte, over every wire form a Triton client uses: HTTP JSON, HTTP binary,
gRPC raw contents, gRPC typed ``bytes_contents``, with the sync and aio
clients; bytes that are not UTF-8 and strings a model refuses are clear
client errors; a million short strings cross in one request.

Models: ``identity_string`` (STRING [-1], no batching) and ``string_to_int``
(STRING [1] -> Cast -> INT64, batching) from the example repository.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcclient_aio
import tritonclient.http as httpclient
import tritonclient.http.aio as httpclient_aio
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from tests.harness import Proc, start
from tests.integration.gateway.e2e_cluster import grpc_url, http_url

pytestmark = pytest.mark.timeout(240)
log = logging.getLogger(__name__)

# Empty, ASCII, Latin-1 range, CJK, an emoji, and an embedded NUL: UTF-8 all.
WORDS = ["", "A", "h\u00e9llo", "\u65e5\u672c\u8a9e", "\U0001f600", "x\x00y"]


@pytest.fixture(scope="module")
def cluster(model_repo: Path) -> Iterator[Proc]:
    proc = start(["up", "--workers", "1", "--model-repository", str(model_repo), "--http-port", "0", "--grpc-port", "0"])
    try:
        yield proc
    finally:
        proc.stop()


def _words(items: list[str]) -> np.ndarray:
    return np.array([w.encode("utf-8") for w in items], dtype=np.object_)


def _http_identity(proc: Proc, data: np.ndarray, binary: bool) -> np.ndarray:
    client = httpclient.InferenceServerClient(http_url(proc), network_timeout=120)
    try:
        tensor = httpclient.InferInput("INPUT0", list(data.shape), "BYTES")
        tensor.set_data_from_numpy(data, binary_data=binary)
        out = httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary)
        return client.infer("identity_string", [tensor], outputs=[out]).as_numpy("OUTPUT0")
    finally:
        client.close()


def _grpc_identity(proc: Proc, data: np.ndarray) -> np.ndarray:
    client = grpcclient.InferenceServerClient(grpc_url(proc))
    try:
        tensor = grpcclient.InferInput("INPUT0", list(data.shape), "BYTES")
        tensor.set_data_from_numpy(data)  # raw_input_contents
        return client.infer("identity_string", [tensor], client_timeout=120).as_numpy("OUTPUT0")
    finally:
        client.close()


# ---- byte-exact round trips ------------------------------------------------------


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_http_round_trip_is_byte_exact(cluster: Proc, binary: bool) -> None:
    got = _http_identity(cluster, _words(WORDS), binary)
    # tritonclient gives JSON BYTES back as str, binary ones as bytes.
    expected = WORDS if not binary else [w.encode("utf-8") for w in WORDS]
    assert got.tolist() == expected


def test_grpc_raw_round_trip_is_byte_exact(cluster: Proc) -> None:
    assert _grpc_identity(cluster, _words(WORDS)).tolist() == [w.encode("utf-8") for w in WORDS]


def test_grpc_typed_bytes_contents_round_trip(cluster: Proc) -> None:
    request = service_pb2.ModelInferRequest(model_name="identity_string")
    tensor = request.inputs.add(name="INPUT0", datatype="BYTES", shape=[len(WORDS)])
    tensor.contents.bytes_contents.extend(w.encode("utf-8") for w in WORDS)
    with grpc.insecure_channel(grpc_url(cluster)) as channel:
        response = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=60)
    result = grpcclient.InferResult(response)
    assert result.as_numpy("OUTPUT0").tolist() == [w.encode("utf-8") for w in WORDS]


async def test_aio_clients_round_trip(cluster: Proc) -> None:
    data = _words(WORDS)
    hclient = httpclient_aio.InferenceServerClient(http_url(cluster))
    try:
        tensor = httpclient.InferInput("INPUT0", [len(WORDS)], "BYTES")
        tensor.set_data_from_numpy(data)
        result = await hclient.infer("identity_string", [tensor])
        assert result.as_numpy("OUTPUT0").tolist() == data.tolist()
    finally:
        await hclient.close()
    gclient = grpcclient_aio.InferenceServerClient(grpc_url(cluster))
    try:
        gtensor = grpcclient.InferInput("INPUT0", [len(WORDS)], "BYTES")
        gtensor.set_data_from_numpy(data)
        result = await gclient.infer("identity_string", [gtensor])
        assert result.as_numpy("OUTPUT0").tolist() == data.tolist()
    finally:
        await gclient.close()


def test_a_million_short_strings(cluster: Proc) -> None:
    count = 1_000_000
    data = np.array([f"{i % 100000:05d}".encode() for i in range(count)], dtype=np.object_)
    data[::1000] = "\u00e9t\u00e9".encode("utf-8")
    for name, call in (("grpc", lambda: _grpc_identity(cluster, data)),
                       ("http-binary", lambda: _http_identity(cluster, data, True))):
        began = time.perf_counter()
        got = call()
        # Reported, not asserted: the suite asserts no wall-clock times.
        log.warning("%d BYTES elements round trip over %s in %.2f s", count, name, time.perf_counter() - began)
        assert got.shape == (count,)
        assert got.tolist() == data.tolist()


# ---- what a string model refuses --------------------------------------------------


def test_invalid_utf8_is_a_clear_client_error(cluster: Proc) -> None:
    data = np.array([b"ok", b"\xff\xfe"], dtype=np.object_)
    with pytest.raises(InferenceServerException) as http_error:
        _http_identity(cluster, data, True)
    assert http_error.value.status() == "400"
    with pytest.raises(InferenceServerException) as grpc_error:
        _grpc_identity(cluster, data)
    assert grpc_error.value.status() == "StatusCode.INVALID_ARGUMENT"
    for error in (http_error.value, grpc_error.value):
        message = error.message()
        assert "input 'INPUT0'" in message and "UTF-8" in message and "element 1" in message, message


def test_cast_of_a_non_number_is_a_client_error_with_the_runtime_cause(cluster: Proc) -> None:
    data = np.array([[b"12"], [b"twelve"]], dtype=np.object_)
    hclient = httpclient.InferenceServerClient(http_url(cluster))
    gclient = grpcclient.InferenceServerClient(grpc_url(cluster))
    try:
        good = httpclient.InferInput("INPUT0", [1, 1], "BYTES")
        good.set_data_from_numpy(data[:1])
        assert hclient.infer("string_to_int", [good]).as_numpy("OUTPUT0").tolist() == [[12]]
        bad = httpclient.InferInput("INPUT0", [2, 1], "BYTES")
        bad.set_data_from_numpy(data)
        with pytest.raises(InferenceServerException) as http_error:
            hclient.infer("string_to_int", [bad])
        gbad = grpcclient.InferInput("INPUT0", [2, 1], "BYTES")
        gbad.set_data_from_numpy(data)
        with pytest.raises(InferenceServerException) as grpc_error:
            gclient.infer("string_to_int", [gbad])
    finally:
        hclient.close()
        gclient.close()
    assert http_error.value.status() == "400"
    assert grpc_error.value.status() == "StatusCode.INVALID_ARGUMENT"
    for error in (http_error.value, grpc_error.value):
        message = error.message()
        assert "internal error" not in message
        assert "Cast" in message and "string_to_int" in message, message
