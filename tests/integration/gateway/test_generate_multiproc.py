"""The generate endpoints with several gateway processes (``--processes 2``)
behind one HTTP port, over a real worker: every process serves
``/generate`` and ``/generate_stream`` (fresh connections spread over the
processes; the ``X-Infergate-Process`` header names the one that answered).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
import requests

from tests.harness import Proc, start, start_worker, worker_url
from tests.integration.gateway.stream_clients import WAIT_S, poll

pytestmark = pytest.mark.timeout(120)

MODELS = ("identity_string", "square_int32")


@pytest.fixture(scope="module")
def gateway(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    repo = tmp_path_factory.mktemp("generate-multiproc")
    for name in MODELS:
        shutil.copytree(model_repo / name, repo / name)
    worker = start_worker(repo)
    try:
        proc = start(["gateway", "--worker", worker_url(worker), "--http-port", "0", "--grpc-port", "0",
                      "--processes", "2"])
        try:
            yield proc
        finally:
            proc.stop()
    finally:
        worker.stop()


def _fresh_post(gateway: Proc, path: str, body: dict) -> requests.Response:
    # A session per call: a new connection, which the kernel may hand to either process.
    with requests.Session() as session:
        return session.post(f"http://127.0.0.1:{gateway.ready['http_port']}{path}", data=orjson.dumps(body),
                            timeout=WAIT_S)


def test_every_process_serves_generate_and_generate_stream(gateway: Proc) -> None:
    streamed: dict[str, list[bytes]] = {}
    answered: dict[str, dict] = {}

    def both_served() -> bool:
        stream = _fresh_post(gateway, "/v2/models/square_int32/generate_stream", {"IN": 2})
        if stream.status_code == 200:
            streamed[stream.headers["X-Infergate-Process"]] = [line for line in stream.iter_lines() if line]
        one = _fresh_post(gateway, "/v2/models/identity_string/generate", {"INPUT0": "x"})
        if one.status_code == 200:
            answered[one.headers["X-Infergate-Process"]] = one.json()
        return set(streamed) == set(answered) == {"0", "1"}

    poll(both_served, "both processes serving the generate endpoints", timeout_s=60.0)
    event = b'data: {"OUT":2,"model_name":"square_int32","model_version":"1"}'
    assert all(lines == [event, event] for lines in streamed.values()), streamed
    assert all(doc == {"OUTPUT0": "x", "model_name": "identity_string", "model_version": "1"}
               for doc in answered.values()), answered
