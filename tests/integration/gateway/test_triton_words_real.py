"""Triton's words, asked of a real Triton server (the one the nvidia-pytriton
wheel bundles) and of the gateway with the same requests: a JSON ``data``
array that does not match its ``shape`` (too few values and too many: one
message for both, as Triton's L0_http checks), and loads Triton refuses
while polling (a ``config`` that is not JSON; an override file path holding
``..``), where the gateway says Triton's words and then the cause."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from models.triton import build_triton_repository
from tests.harness import Proc, start
from tests.integration.gateway.e2e_cluster import http_url
from tests.triton_harness import TritonProc, start_triton, triton_available

AVAILABLE, REASON = triton_available()

pytestmark = [
    pytest.mark.triton,
    pytest.mark.timeout(240),
    pytest.mark.skipif(not AVAILABLE, reason=f"no real Triton here: {REASON}"),
]


@pytest.fixture(scope="module")
def triton(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonProc]:
    repo = tmp_path_factory.mktemp("triton-models")
    build_triton_repository(model_repo, repo, ["simple"])
    proc = start_triton(repo, models=["simple"])
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def gateway(model_repo: Path) -> Iterator[Proc]:
    proc = start(["up", "--workers", "1", "--model-repository", str(model_repo), "--http-port", "0", "--grpc-port", "0"])
    try:
        yield proc
    finally:
        proc.stop()


def _post(address: str, path: str, doc: dict[str, object]) -> tuple[int, str]:
    request = urllib.request.Request(f"http://{address}{path}", data=json.dumps(doc).encode(), method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, ""
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())["error"]


@pytest.mark.parametrize("count", [15, 18], ids=["too-few", "too-many"])
def test_a_data_count_that_does_not_match_the_shape(triton: TritonProc, gateway: Proc, count: int) -> None:
    doc = {"inputs": [{"name": name, "datatype": "INT32", "shape": [1, 16], "data": [1] * (count if i == 0 else 16)}
                      for i, name in enumerate(("INPUT0", "INPUT1"))]}
    tritons = _post(triton.http_url, "/v2/models/simple/infer", doc)
    assert tritons == (400, "Unable to parse 'data': Shape does not match true shape of 'data' field")
    assert _post(http_url(gateway), "/v2/models/simple/infer", doc) == tritons


@pytest.mark.parametrize(("model", "parameters"), [
    ("simple", {"config": '"parameters": {"config": {{"max_batch_size": "16"}}}'}),
    ("new_model", {"config": json.dumps({"backend": "identity"}), "file:../../root/new_dir/test.txt": "aGVsbG8="}),
], ids=["config-not-json", "file-path-with-dot-dot"])
def test_a_load_refused_while_polling(triton: TritonProc, gateway: Proc, model: str,
                                      parameters: dict[str, str]) -> None:
    status, tritons = _post(triton.http_url, f"/v2/repository/models/{model}/load", {"parameters": parameters})
    assert (status, tritons) == (400, f"failed to load '{model}', failed to poll from model repository")
    status, ours = _post(http_url(gateway), f"/v2/repository/models/{model}/load", {"parameters": parameters})
    assert status == 400 and ours.startswith(tritons + ": "), ours
