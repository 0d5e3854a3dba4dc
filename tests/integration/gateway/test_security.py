"""Security end to end with real processes and the real tritonclient.

- ``infergate up`` (one worker) with an API key file and an admin key file:
  no key, a wrong key, a key without access to a model, per-key quotas and
  the admin endpoints, over HTTP and gRPC; health stays open; the worker
  refuses calls without the shared token ``up`` made for it.
- TLS: in test_security_tls.py.
"""

from __future__ import annotations

import base64
import queue
import shutil
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.utils import InferenceServerException

from tests.harness import Proc, start

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command for test certificates"),
]

FULL = "full-access-key-0123456789"
RESTRICTED = "restricted-key-0123456789"
LIMITED = "limited-rate-key-0123456789"
ADMIN = "admin-key-abcdefghijklmnop"
MODEL_NAMES = ("simple", "mlp", "cnn", "encoder")


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def simple_inputs(module: Any, rows: int = 1) -> tuple[list[Any], np.ndarray]:
    x = np.arange(16 * rows, dtype=np.int32).reshape(rows, 16)
    inputs = [module.InferInput("INPUT0", [rows, 16], "INT32"), module.InferInput("INPUT1", [rows, 16], "INT32")]
    for tensor in inputs:
        tensor.set_data_from_numpy(x)
    return inputs, x


def mlp_inputs(module: Any) -> list[Any]:
    tensor = module.InferInput("INPUT", [1, 64], "FP32")
    tensor.set_data_from_numpy(np.zeros((1, 64), np.float32))
    return [tensor]


def refused(call: Callable[[], Any]) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as info:
        call()
    return info.value


def assert_names_no_model(text: str, allowed: str = "") -> None:
    for name in MODEL_NAMES:
        if name != allowed:
            assert f"'{name}'" not in text and f'"{name}"' not in text, text


# ---- fixtures ----------------------------------------------------------------------


def write_key_files(root: Path) -> tuple[Path, Path]:
    """The API key file and the admin key file of these tests, under ``root``."""
    keys = root / "api-keys"
    keys.write_text(
        "# keys of the security tests\n"
        f"{FULL} name=full\n"
        f"{RESTRICTED} simple name=narrow\n"
        f"{LIMITED} * rate=3/h name=limited\n"
    )
    admin = root / "admin-keys"
    admin.write_text(f"{ADMIN} name=ops\n")
    return keys, admin


@pytest.fixture(scope="module")
def key_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_key_files(tmp_path_factory.mktemp("keys"))


@pytest.fixture(scope="module")
def cluster(model_repo: Path, key_files: tuple[Path, Path]) -> Iterator[Proc]:
    keys, admin = key_files
    proc = start(["up", "--workers", "1", "--model-repository", str(model_repo), "--http-port", "0",
                  "--grpc-port", "0", "--api-key-file", str(keys), "--admin-key-file", str(admin)])
    try:
        yield proc
    finally:
        proc.stop()


def http_url(proc: Proc) -> str:
    return f"127.0.0.1:{proc.ready['http_port']}"


def grpc_url(proc: Proc) -> str:
    return f"127.0.0.1:{proc.ready['grpc_port']}"


def raw_http(proc: Proc, path: str, *, method: str = "GET", body: bytes | None = None,
             headers: dict[str, str] | None = None) -> tuple[int, dict[str, list[str]], bytes]:
    request = urllib.request.Request(f"http://{http_url(proc)}{path}", data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, {}, response.read()
    except urllib.error.HTTPError as err:
        found: dict[str, list[str]] = {}
        for key, value in err.headers.items():
            found.setdefault(key.lower(), []).append(value)
        return err.code, found, err.read()


# ---- API keys over HTTP ---------------------------------------------------------------


@pytest.mark.parametrize("headers", [{}, bearer("wrong-key-0123456789"), bearer(ADMIN), {"authorization": FULL}])
@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/v2"), ("GET", "/v2/models/simple"), ("GET", "/v2/models/simple/config"),
     ("GET", "/v2/models/simple/ready"), ("GET", "/v2/models/no_such_model"), ("GET", "/v2/models/stats"),
     ("POST", "/v2/models/simple/infer"), ("GET", "/no/such/endpoint")],
)
def test_http_without_a_valid_key_is_401_and_names_no_model(
    cluster: Proc, method: str, path: str, headers: dict[str, str]
) -> None:
    status, response_headers, body = raw_http(cluster, path, method=method,
                                              body=b"{}" if method == "POST" else None, headers=headers)
    assert status == 401
    assert response_headers["www-authenticate"] == ['Bearer realm="infergate"']
    assert body == b'{"error":"missing or invalid API key"}'


def test_http_health_is_open(cluster: Proc) -> None:
    client = httpclient.InferenceServerClient(http_url(cluster))
    try:
        assert client.is_server_live() and client.is_server_ready()
    finally:
        client.close()


def test_http_keys_and_model_lists(cluster: Proc) -> None:
    client = httpclient.InferenceServerClient(http_url(cluster))
    try:
        inputs, x = simple_inputs(httpclient)
        result = client.infer("simple", inputs, headers=bearer(RESTRICTED))
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x + x)
        assert client.get_model_metadata("simple", headers=bearer(RESTRICTED))["name"] == "simple"
        assert client.get_model_metadata("mlp", headers=bearer(FULL))["name"] == "mlp"
        assert "extensions" in client.get_server_metadata(headers=bearer(RESTRICTED))

        for call in (lambda: client.infer("mlp", mlp_inputs(httpclient), headers=bearer(RESTRICTED)),
                     lambda: client.get_model_metadata("mlp", headers=bearer(RESTRICTED)),
                     lambda: client.get_model_metadata("no_such_model", headers=bearer(RESTRICTED))):
            err = refused(call)
            assert err.status() == "403"
            assert "may not use model" in err.message()
            assert_names_no_model(err.message(), allowed="mlp")
        # Statistics of every model would list them all.
        assert refused(lambda: client.get_inference_statistics(headers=bearer(RESTRICTED))).status() == "403"
        assert client.get_inference_statistics("simple", headers=bearer(RESTRICTED))["model_stats"]
    finally:
        client.close()


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/metrics"), ("GET", "/dashboard"), ("GET", "/v2/cluster"), ("GET", "/v2/cluster/stats"),
     ("POST", "/v2/repository/index"), ("POST", "/v2/repository/models/mlp/unload")],
)
def test_http_admin_endpoints_need_the_admin_key(cluster: Proc, method: str, path: str) -> None:
    body = b"{}" if method == "POST" else None
    for headers in ({}, bearer(FULL), bearer("wrong-admin-key-0123456789")):
        status, response_headers, text = raw_http(cluster, path, method=method, body=body, headers=headers)
        assert status == 401 and text == b'{"error":"missing or invalid admin key"}'
        # A browser asks for the key (as the password) and resends it on the dashboard's requests.
        assert any(h.startswith("Basic ") for h in response_headers["www-authenticate"])
    if path.endswith("/unload"):
        return  # refused above; not run with the key, the other tests need mlp loaded
    basic = "Basic " + base64.b64encode(f"ops:{ADMIN}".encode()).decode()
    for headers in (bearer(ADMIN), {"Authorization": basic}):
        status, _, _ = raw_http(cluster, path, method=method, body=body, headers=headers)
        assert status == 200


def test_quota_is_per_key_and_shared_by_both_frontends(cluster: Proc) -> None:
    http = httpclient.InferenceServerClient(http_url(cluster))
    grpc_ = grpcclient.InferenceServerClient(grpc_url(cluster))
    try:
        # rate=3/h: a burst of three, then the next token is 20 minutes away.
        http.get_server_metadata(headers=bearer(LIMITED))
        grpc_.get_server_metadata(headers=bearer(LIMITED))
        http.get_model_metadata("mlp", headers=bearer(LIMITED))
        over = refused(lambda: http.get_model_metadata("mlp", headers=bearer(LIMITED)))
        assert over.status() == "429" and "limited" in over.message()
        status, headers, _ = raw_http(cluster, "/v2", headers=bearer(LIMITED))
        assert status == 429 and 1 <= int(headers["retry-after"][0]) <= 1200
        over_grpc = refused(lambda: grpc_.get_server_metadata(headers=bearer(LIMITED)))
        assert over_grpc.status() == "StatusCode.RESOURCE_EXHAUSTED"
        # Other keys are not held back by it.
        http.get_server_metadata(headers=bearer(FULL))
    finally:
        http.close()
        grpc_.close()


# ---- API keys over gRPC ---------------------------------------------------------------


def test_grpc_without_a_valid_key_is_unauthenticated(cluster: Proc) -> None:
    client = grpcclient.InferenceServerClient(grpc_url(cluster))
    try:
        assert client.is_server_live() and client.is_server_ready()
        inputs, _ = simple_inputs(grpcclient)
        for headers in (None, bearer("wrong-key-0123456789"), bearer(ADMIN), {"authorization": FULL}):
            for call in (partial(client.get_server_metadata, headers=headers),
                         partial(client.get_model_metadata, "simple", headers=headers),
                         partial(client.get_model_metadata, "no_such_model", headers=headers),
                         partial(client.is_model_ready, "simple", headers=headers),
                         partial(client.get_inference_statistics, headers=headers),
                         partial(client.infer, "simple", inputs, headers=headers)):
                err = refused(call)
                assert err.status() == "StatusCode.UNAUTHENTICATED" and err.message() == "missing or invalid API key"
    finally:
        client.close()


def test_grpc_health_service_is_open(cluster: Proc) -> None:
    with grpc.insecure_channel(grpc_url(cluster)) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_grpc_keys_and_model_lists(cluster: Proc) -> None:
    client = grpcclient.InferenceServerClient(grpc_url(cluster))
    try:
        inputs, x = simple_inputs(grpcclient)
        result = client.infer("simple", inputs, headers=bearer(RESTRICTED))
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), x - x)
        assert client.get_model_config("simple", headers=bearer(RESTRICTED)).config.name == "simple"
        assert client.get_model_metadata("mlp", headers=bearer(FULL)).name == "mlp"
        for call in (lambda: client.infer("mlp", mlp_inputs(grpcclient), headers=bearer(RESTRICTED)),
                     lambda: client.get_model_metadata("mlp", headers=bearer(RESTRICTED)),
                     lambda: client.get_inference_statistics(headers=bearer(RESTRICTED))):
            err = refused(call)
            assert err.status() == "StatusCode.PERMISSION_DENIED"
            assert_names_no_model(err.message(), allowed="mlp")
    finally:
        client.close()


def test_grpc_stream_is_checked_per_message(cluster: Proc) -> None:
    results: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = grpcclient.InferenceServerClient(grpc_url(cluster))
    try:
        inputs, x = simple_inputs(grpcclient)
        client.start_stream(callback=lambda result, error: results.put((result, error)), headers=bearer(RESTRICTED))
        client.async_stream_infer("simple", inputs)
        result, error = results.get(timeout=30)
        assert error is None
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x + x)
        client.async_stream_infer("mlp", mlp_inputs(grpcclient))
        _, error = results.get(timeout=30)
        assert error is not None and error.status() == "StatusCode.PERMISSION_DENIED"
        client.stop_stream()

        client.start_stream(callback=lambda result, error: results.put((result, error)))
        try:
            client.async_stream_infer("simple", inputs)
        except InferenceServerException:
            pass  # the server refused the stream before this send; its status reaches the callback
        _, error = results.get(timeout=30)
        assert error is not None and error.status() == "StatusCode.UNAUTHENTICATED"
    finally:
        client.stop_stream()
        client.close()


def test_grpc_repository_control_needs_the_admin_key(cluster: Proc) -> None:
    client = grpcclient.InferenceServerClient(grpc_url(cluster))
    try:
        for headers in (None, bearer(FULL)):
            for call in (partial(client.get_model_repository_index, headers=headers),
                         partial(client.unload_model, "mlp", headers=headers),
                         partial(client.load_model, "mlp", headers=headers)):
                err = refused(call)
                assert err.status() == "StatusCode.UNAUTHENTICATED" and err.message() == "missing or invalid admin key"
        assert client.is_model_ready("mlp", headers=bearer(FULL))  # the refused unload did nothing
        names = {m.name for m in client.get_model_repository_index(headers=bearer(ADMIN)).models}
        assert set(MODEL_NAMES) <= names
    finally:
        client.close()


# ---- the worker's shared token (made by `up`) -------------------------------------------


def test_up_workers_refuse_calls_without_the_token(cluster: Proc) -> None:
    token_file = Path(cluster.ready["worker_token_file"])
    assert token_file.stat().st_mode & 0o777 == 0o600
    token = token_file.read_text().strip()
    worker = grpcclient.InferenceServerClient(cluster.ready["workers"][0]["address"])
    try:
        inputs, x = simple_inputs(grpcclient)
        for headers in (None, bearer("not-the-token"), bearer(FULL), {"authorization": token}):
            for call in (partial(worker.get_model_metadata, "simple", headers=headers),
                         partial(worker.unload_model, "simple", headers=headers),
                         partial(worker.infer, "simple", inputs, headers=headers)):
                err = refused(call)
                assert err.status() == "StatusCode.UNAUTHENTICATED"
        result = worker.infer("simple", inputs, headers=bearer(token))
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x + x)
    finally:
        worker.close()
    # Its health service stays open for probes.
    with grpc.insecure_channel(cluster.ready["workers"][0]["address"]) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
