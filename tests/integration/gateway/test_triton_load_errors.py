"""Load failures through the gateway's repository extension start with
Triton's words, "failed to load '<model>'", then infergate's detail; over
HTTP and gRPC, for a model that does not exist and one that cannot be built."""

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
    proc = start(["up", "--workers", "1", "--model-repository", str(model_repo), "--http-port", "0", "--grpc-port", "0"])
    try:
        yield proc
    finally:
        proc.stop()


def test_http_load_failures_start_with_tritons_words(cluster: Proc) -> None:
    client = httpclient.InferenceServerClient(http_url(cluster))
    try:
        with pytest.raises(InferenceServerException) as info:
            client.load_model("ghost")
        assert info.value.message().startswith("failed to load 'ghost'"), info.value.message()
        with pytest.raises(InferenceServerException) as info:
            client.load_model("broken", config=BROKEN_CONFIG, files=BROKEN_FILES)
        message = info.value.message()
        assert message.startswith("failed to load 'broken'"), message
        assert len(message) > len("failed to load 'broken'") + 2  # the cause follows
    finally:
        client.close()


def test_grpc_load_failures_start_with_tritons_words(cluster: Proc) -> None:
    client = grpcclient.InferenceServerClient(grpc_url(cluster))
    try:
        with pytest.raises(InferenceServerException) as info:
            client.load_model("ghost")
        assert info.value.message().startswith("failed to load 'ghost'"), info.value.message()
        with pytest.raises(InferenceServerException) as info:
            client.load_model("broken", config=BROKEN_CONFIG, files=BROKEN_FILES)
        assert info.value.message().startswith("failed to load 'broken'"), info.value.message()
        assert info.value.status() == str(grpc.StatusCode.INVALID_ARGUMENT)
    finally:
        client.close()


def test_file_override_without_config_keeps_tritons_own_words(cluster: Proc) -> None:
    client = httpclient.InferenceServerClient(http_url(cluster))
    try:
        with pytest.raises(InferenceServerException,
                           match="Load parameter 'config' must be specified for model file override"):
            client.load_model("simple", files={"file:1/model.onnx": base64.b64decode(b"AAAA")})
    finally:
        client.close()
