"""Triton's generate extension end to end: a worker and a gateway (real
processes, API keys on) serving ``simple``, ``identity_string`` and the
decoupled ``square_int32`` and ``repeat_int32``.

Checked: ``/generate`` answers what ONNX Runtime computes on the same file,
string inputs and outputs, ``/generate_stream`` read by aiohttp line by line
as events arrive (count, order, values, an event out before the model has
finished, the body closed after the final one) and by ``requests``; the
errors in Triton's words; a key required; a client that leaves mid-stream
freeing the model's instance on the worker (polled with a deadline).
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import onnxruntime as ort
import orjson
import pytest
import requests

from gateway.frontends.http_generate import NOT_ONE_RESPONSE
from tests.harness import Proc, start, start_worker, worker_url
from tests.integration.gateway.stream_clients import WAIT_S, metric, poll

pytestmark = pytest.mark.timeout(120)

MODELS = ("simple", "identity_string", "square_int32", "repeat_int32")
KEY = "generate-test-key-0123456789"
NARROW = "generate-narrow-key-0123456789"
ADMIN = "generate-admin-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
PENDING = "nv_inference_pending_request_count"


@dataclass
class Cluster:
    worker: Proc
    gateway: Proc
    repo: Path

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.gateway.ready['http_port']}"

    @property
    def worker_metrics(self) -> str:
        return f"127.0.0.1:{self.worker.ready['metrics_port']}"

    @property
    def gateway_metrics(self) -> str:
        return f"127.0.0.1:{self.gateway.ready['http_port']}"


@pytest.fixture(scope="module")
def cluster(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("generate")
    repo = root / "models"
    for name in MODELS:
        shutil.copytree(model_repo / name, repo / name)
    keys = root / "api-keys"
    keys.write_text(f"{KEY} name=full\n{NARROW} simple name=narrow\n")
    admin = root / "admin-keys"
    admin.write_text(f"{ADMIN} name=ops\n")
    worker = start_worker(repo, "--metrics-port", "0")
    try:
        gateway = start(["gateway", "--worker", worker_url(worker), "--http-port", "0", "--grpc-port", "0",
                         "--api-key-file", str(keys), "--admin-key-file", str(admin)])
        try:
            base = f"http://127.0.0.1:{gateway.ready['http_port']}"
            poll(lambda: all(requests.get(f"{base}/v2/models/{m}/ready", headers=AUTH, timeout=10).status_code == 200
                             for m in MODELS), "models ready through the gateway")
            yield Cluster(worker, gateway, repo)
        finally:
            gateway.stop()
    finally:
        worker.stop()


def _post(cluster: Cluster, model: str, endpoint: str, body: Any, **headers: str) -> requests.Response:
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    return requests.post(f"{cluster.base}/v2/models/{model}/{endpoint}", data=data, headers={**AUTH, **headers},
                         timeout=WAIT_S)


def _event(line: bytes) -> Any:
    assert line.startswith(b"data: "), line
    return orjson.loads(line[len(b"data: "):])


# --- ordinary models -----------------------------------------------------------------


def test_generate_on_simple_answers_what_onnx_runtime_computes(cluster: Cluster) -> None:
    a = np.arange(16, dtype=np.int32) * 3 - 20
    b = np.arange(16, dtype=np.int32)[::-1].copy()
    session = ort.InferenceSession(str(cluster.repo / "simple" / "1" / "model.onnx"),
                                   providers=["CPUExecutionProvider"])
    want0, want1 = session.run(["OUTPUT0", "OUTPUT1"], {"INPUT0": a[None], "INPUT1": b[None]})
    response = _post(cluster, "simple", "generate", {"INPUT0": a.tolist(), "INPUT1": b.tolist(), "id": "g1"})
    assert response.status_code == 200 and response.headers["Content-Type"].startswith("application/json")
    assert response.json() == {"OUTPUT0": want0.reshape(-1).tolist(), "OUTPUT1": want1.reshape(-1).tolist(),
                               "id": "g1", "model_name": "simple", "model_version": "1"}


def test_string_input_and_output_and_one_event_from_an_ordinary_model(cluster: Cluster) -> None:
    response = _post(cluster, "identity_string", "generate", {"INPUT0": "héllo wörld"})
    assert response.json() == {"OUTPUT0": "héllo wörld", "model_name": "identity_string", "model_version": "1"}
    response = _post(cluster, "identity_string", "versions/1/generate_stream", {"INPUT0": ["a", "b"]})
    assert response.headers["Content-Type"] == "text/event-stream; charset=utf-8"
    assert response.content == b'data: {"OUTPUT0":["a","b"],"model_name":"identity_string","model_version":"1"}\n\n'


# --- decoupled models ----------------------------------------------------------------


async def _stream_events(cluster: Cluster, model: str, body: dict[str, Any]) -> list[Any]:
    async with aiohttp.ClientSession(headers=AUTH) as session:
        async with session.post(f"{cluster.base}/v2/models/{model}/generate_stream", json=body) as response:
            assert response.status == 200
            assert response.headers["Content-Type"] == "text/event-stream; charset=utf-8"
            return [_event(line) async for line in response.content if line != b"\n"]


async def test_square_streams_n_events_then_closes(cluster: Cluster) -> None:
    events = await _stream_events(cluster, "square_int32", {"IN": 4, "id": "sq"})
    assert events == [{"OUT": 4, "id": "sq", "model_name": "square_int32", "model_version": "1"}] * 4
    assert await _stream_events(cluster, "square_int32", {"IN": 0}) == []


async def test_repeat_events_come_in_order_as_the_model_sends_them(cluster: Cluster) -> None:
    body = {"IN": [7, -3, 0, 9], "DELAY": [0, 300, 300, 300], "WAIT": 0}
    async with aiohttp.ClientSession(headers=AUTH) as session:
        async with session.post(f"{cluster.base}/v2/models/repeat_int32/generate_stream", json=body) as response:
            first = _event(await asyncio.wait_for(response.content.readline(), WAIT_S))
            # The first event is out while the model still holds the request on the worker.
            assert metric(cluster.worker_metrics, PENDING, 'model="repeat_int32"') == 1
            rest = [_event(line) async for line in response.content if line.strip()]
    events = [first, *rest]
    assert [(e["IDX"], e["OUT"]) for e in events] == [(0, 7), (1, -3), (2, 0), (3, 9)]
    assert all(e["model_name"] == "repeat_int32" and e["model_version"] == "1" for e in events)


def test_requests_reads_the_stream_line_by_line(cluster: Cluster) -> None:
    body = orjson.dumps({"IN": [1, 2, 3], "DELAY": [10, 10, 10], "WAIT": 0})
    with requests.post(f"{cluster.base}/v2/models/repeat_int32/generate_stream", data=body, headers=AUTH,
                       stream=True, timeout=WAIT_S) as response:
        events = [_event(line) for line in response.iter_lines() if line]
    assert [e["OUT"] for e in events] == [1, 2, 3]


def test_generate_on_a_decoupled_model_needs_exactly_one_response(cluster: Cluster) -> None:
    assert _post(cluster, "square_int32", "generate", {"IN": 1}).json() == {
        "OUT": 1, "model_name": "square_int32", "model_version": "1"}
    for n in (0, 3):
        response = _post(cluster, "square_int32", "generate", {"IN": n})
        assert response.status_code == 400 and response.json() == {"error": NOT_ONE_RESPONSE}


async def test_a_client_that_leaves_mid_stream_frees_the_worker(cluster: Cluster) -> None:
    label = 'model="repeat_int32"'
    # 200 responses 50 ms apart: ten seconds unless leaving stops it.
    body = {"IN": list(range(200)), "DELAY": [50] * 200, "WAIT": 0}
    async with aiohttp.ClientSession(headers=AUTH) as session:
        response = await session.post(f"{cluster.base}/v2/models/repeat_int32/generate_stream", json=body)
        for _ in range(2):
            _event(await asyncio.wait_for(response.content.readline(), WAIT_S))
            await response.content.readline()
        assert metric(cluster.worker_metrics, PENDING, label) == 1
        response.close()
    await asyncio.to_thread(poll, lambda: metric(cluster.worker_metrics, PENDING, label) == 0,
                            "the worker let the abandoned request go", 5.0)
    admin = {"authorization": f"Bearer {ADMIN}"}
    await asyncio.to_thread(poll, lambda: metric(cluster.gateway_metrics, "infergate_streams_open", label,
                                                 headers=admin) == 0, "the gateway closed the stream")


# --- errors and keys -----------------------------------------------------------------


@pytest.mark.parametrize(("model", "body", "words"), [
    ("simple", b"{not json", "failed to parse the request JSON buffer: "),
    ("simple", b"[1]", "attempt to get members for non-object"),
    ("simple", {"INPUT0": [1, 2, 3]}, "The schema can not convert input 'INPUT0' to tensor with proper shape"),
    ("simple", {"INPUT0": list(range(16))}, "INPUT1"),
    ("simple", {"INPUT0": [0.5] * 16, "INPUT1": [0] * 16},
     "Unable to parse 'data': attempt to access JSON non-signed-integer as signed-integer"),
    ("square_int32", {"IN": -1}, "IN must be >= 0, got -1"),
    ("repeat_int32", {"IN": [1, 2], "DELAY": [0], "WAIT": 0}, "DELAY must have as many elements as IN"),
    ("no_such_model", {}, "no_such_model"),
])
@pytest.mark.parametrize("endpoint", ["generate", "generate_stream"])
def test_errors_are_json_answers_in_tritons_words(cluster: Cluster, model: str, body: Any, words: str,
                                                   endpoint: str) -> None:
    response = _post(cluster, model, endpoint, body)
    assert 400 <= response.status_code < 600
    assert response.headers["Content-Type"].startswith("application/json")
    assert words in response.json()["error"]


def test_a_key_is_required_and_must_reach_the_model(cluster: Cluster) -> None:
    url = f"{cluster.base}/v2/models/square_int32/generate_stream"
    assert requests.post(url, data=b'{"IN": 1}', timeout=WAIT_S).status_code == 401
    narrow = {"Authorization": f"Bearer {NARROW}"}
    assert requests.post(url, data=b'{"IN": 1}', headers=narrow, timeout=WAIT_S).status_code == 403
    simple = requests.post(f"{cluster.base}/v2/models/simple/generate", headers=narrow, timeout=WAIT_S,
                           data=orjson.dumps({"INPUT0": [1] * 16, "INPUT1": [2] * 16}))
    assert simple.status_code == 200 and simple.json()["OUTPUT0"] == [3] * 16
