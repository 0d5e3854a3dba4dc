"""Load failures through the gateway's repository extension in the words
Triton's client sees, over HTTP and gRPC: a model that does not exist
("failed to load 'M', failed to poll from model repository"), one that
cannot be built ("load failed for model 'M': " then the cause), override
files without a config (the poll failure; the reason goes to the log), a
load refused while polling ("failed to load 'M', failed to poll from model
repository: " then the cause: a ``config`` that is not JSON, an override
file path holding ``..``), which Triton's clients recognise by "failed to
load".
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


def test_a_config_that_is_not_json_fails_to_load_and_the_model_keeps_serving(cluster: Proc) -> None:
    # Triton's simple_http_model_control and simple_grpc_model_control: "failed to load" in the message.
    for client in (httpclient.InferenceServerClient(http_url(cluster)),
                   grpcclient.InferenceServerClient(grpc_url(cluster))):
        try:
            with pytest.raises(InferenceServerException) as info:
                client.load_model("simple", config='"parameters": {"config": {{"max_batch_size": "16"}}}')
            assert info.value.message().startswith(
                "failed to load 'simple', failed to poll from model repository: 'config' parameter for model 'simple' "
                "is not a valid ModelConfig"), info.value.message()
            assert info.value.status() in ("400", str(grpc.StatusCode.INVALID_ARGUMENT))
            assert client.is_model_ready("simple")
        finally:
            client.close()


def test_an_override_file_path_with_dot_dot_fails_to_load(cluster: Proc) -> None:
    # Triton's test_file_override_security: "failed to load".
    config = '{"backend": "onnxruntime", "max_batch_size": 0}'
    escape = "../../root/new_dir/test.txt"
    for client in (httpclient.InferenceServerClient(http_url(cluster)),
                   grpcclient.InferenceServerClient(grpc_url(cluster))):
        try:
            with pytest.raises(InferenceServerException) as info:
                client.load_model("new_model", config=config, files={f"file:{escape}": b"new contents"})
            assert info.value.message().startswith(
                f"failed to load 'new_model', failed to poll from model repository: override file path '{escape}'"
            ), info.value.message()
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
