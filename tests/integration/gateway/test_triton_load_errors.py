"""Load failures through the gateway's repository extension in the words
Triton's client sees, over HTTP and gRPC: a model that does not exist
("failed to load 'M', failed to poll from model repository"), one that
cannot be built ("load failed for model 'M': " then the cause), override
files without a config (the poll failure; the reason goes to the log).
The gateway runs with ``--server-name triton``, as a fleet moving clients
that check the server's name would."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.harness import Proc, start
from tests.integration.gateway.e2e_cluster import grpc_url, http_url

pytestmark = pytest.mark.timeout(180)

BROKEN_CONFIG = '{"name": "broken", "platform": "onnxruntime_onnx", "max_batch_size": 0}'
BROKEN_FILES = {"file:1/model.onnx": b"this is not an onnx graph"}


@pytest.fixture(scope="module")
def cluster(model_repo: Path) -> Iterator[Proc]:
    proc = start(["up", "--workers", "1", "--model-repository", str(model_repo), "--http-port", "0", "--grpc-port", "0",
                  "--server-name", "triton"])
    try:
        yield proc
    finally:
        proc.stop()


def test_http_load_failures_start_with_tritons_words(cluster: Proc) -> None:
    client = httpclient.InferenceServerClient(http_url(cluster))
    try:
        with pytest.raises(InferenceServerException) as info:
            client.load_model("ghost")
        assert info.value.message() == "failed to load 'ghost', failed to poll from model repository"
        with pytest.raises(InferenceServerException) as info:
            client.load_model("broken", config=BROKEN_CONFIG, files=BROKEN_FILES)
        message = info.value.message()
        assert message.startswith("load failed for model 'broken': "), message
        assert len(message) > len("load failed for model 'broken': ") + 2  # the cause follows
        assert info.value.status() == "400"
    finally:
        client.close()


def test_grpc_load_failures_start_with_tritons_words(cluster: Proc) -> None:
    client = grpcclient.InferenceServerClient(grpc_url(cluster))
    try:
        with pytest.raises(InferenceServerException) as info:
            client.load_model("ghost")
        assert info.value.message() == "failed to load 'ghost', failed to poll from model repository"
        with pytest.raises(InferenceServerException) as info:
            client.load_model("broken", config=BROKEN_CONFIG, files=BROKEN_FILES)
        assert info.value.message().startswith("load failed for model 'broken': "), info.value.message()
        assert info.value.status() == str(grpc.StatusCode.INVALID_ARGUMENT)
    finally:
        client.close()


def test_file_override_without_config_is_a_poll_failure_to_the_client(cluster: Proc) -> None:
    for client in (httpclient.InferenceServerClient(http_url(cluster)),
                   grpcclient.InferenceServerClient(grpc_url(cluster))):
        try:
            with pytest.raises(InferenceServerException) as info:
                client.load_model("simple", files={"file:1/model.onnx": base64.b64decode(b"AAAA")})
            assert info.value.message() == "failed to load 'simple', failed to poll from model repository"
            assert info.value.status() in ("400", str(grpc.StatusCode.INVALID_ARGUMENT))
        finally:
            client.close()


def test_server_name_is_the_one_given(cluster: Proc) -> None:
    http_client = httpclient.InferenceServerClient(http_url(cluster))
    grpc_client = grpcclient.InferenceServerClient(grpc_url(cluster))
    try:
        assert http_client.get_server_metadata()["name"] == "triton"
        assert grpc_client.get_server_metadata().name == "triton"
    finally:
        http_client.close()
        grpc_client.close()
