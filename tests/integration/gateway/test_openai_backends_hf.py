"""A mixed pool, as a team running LLM servers has it: two ``transformers serve``
processes (real OpenAI-protocol servers) and an infergate worker serving the
same tiny Llama (its optimum export, tests/fixtures/hf_decoders.py) under one
name, behind one gateway, with the official ``openai`` client streaming
through it (slow: two ``transformers serve`` take ~20 s to start here):

- six chats stream at once, two on each server (each bounded at two
  streams), chunk by chunk, with usage;
- one ``transformers serve`` killed mid-run: its streams go on elsewhere as
  continuations of the text sent (no error), the others finish, new
  requests go to the others, it is down;
- a 4xx of ``transformers serve`` (it has no ``/v1/completions``) is passed
  back in its words and charged to no server.
"""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest
import requests

from tests.fixtures.hf_serve import Served, is_ready, missing, transformers_serve
from tests.harness import Proc, start, start_worker, worker_url
from tests.integration.gateway.stream_clients import WAIT_S, metric, poll

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STREAMS = 6
MAX_TOKENS = 300


@pytest.fixture(scope="module")
def pool(hf_llama_source: Path, hf_llama_export: Path,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, list[Served], Proc]]:  # fmt: skip
    lacking = missing()
    if lacking is not None:
        pytest.skip(f"transformers serve cannot run here: it needs {lacking}")
    tmp = tmp_path_factory.mktemp("mixed")
    repo = tmp / "repo"
    shutil.copytree(hf_llama_export, repo / "llama" / "1")
    # Two streams at once on every server, so six spread over the three.
    (repo / "llama" / "config.pbtxt").write_text('parameters { key: "max_sequences" value { string_value: "2" } }\n')
    servers = [transformers_serve(hf_llama_source, tmp / f"serve-{i}.log") for i in range(2)]
    worker = gateway = None
    try:
        worker = start_worker(repo)
        poll(lambda: all(is_ready(s) for s in servers), "transformers serve ready", timeout_s=120.0)
        config = tmp / "gateway.yaml"
        # transformers serve lists hub names it does not serve: the entry names what it serves.
        entries = [{"address": f"openai://{s.address}", "models": ["llama", "tiny-tf"], "max_streams": 2}
                   for s in servers]
        config.write_text(json.dumps({"workers": entries, "probe": {"interval_s": 0.5}}))
        gateway = start(["gateway", "--config", str(config), "--worker", worker_url(worker),
                         "--http-port", "0", "--grpc-port", "0"])
        base = f"http://127.0.0.1:{gateway.ready['http_port']}"
        poll(lambda: len(requests.get(f"{base}/v2/cluster", timeout=10).json()["workers"][0]["models"]) > 0
             and all(w["state"] == "ready" for w in requests.get(f"{base}/v2/cluster", timeout=10).json()["workers"]),
             "every server ready")
        yield gateway, servers, worker
    finally:
        if gateway is not None:
            gateway.stop()
        if worker is not None:
            worker.stop()
        for s in servers:
            s.stop()


def _cluster(gateway: Proc) -> dict[str, dict[str, Any]]:
    doc = requests.get(f"http://127.0.0.1:{gateway.ready['http_port']}/v2/cluster", timeout=10).json()
    return {w["address"]: w for w in doc["workers"]}


@dataclass
class Run:
    chunks: list[str] = field(default_factory=list)
    finish: str | None = None
    usage: Any = None
    error: BaseException | None = None
    started: threading.Event = field(default_factory=threading.Event)


def _stream(client: openai.OpenAI, i: int, run: Run) -> None:
    try:
        for chunk in client.chat.completions.create(
                model="llama", messages=[{"role": "user", "content": f"Story {i}: once upon a time"}],
                max_tokens=MAX_TOKENS, stream=True, stream_options={"include_usage": True}):
            if chunk.choices and chunk.choices[0].delta.content:
                run.chunks.append(chunk.choices[0].delta.content)
                run.started.set()
            if chunk.choices and chunk.choices[0].finish_reason:
                run.finish = chunk.choices[0].finish_reason
            if chunk.usage is not None:
                run.usage = chunk.usage
    except openai.APIError as e:
        run.error = e
    finally:
        run.started.set()


def test_mixed_pool_streams_and_a_server_killed(pool: tuple[Proc, list[Served], Proc]) -> None:
    gateway, servers, worker = pool
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{gateway.ready['http_port']}/v1", api_key="unused",
                           max_retries=0, timeout=WAIT_S * 3)
    assert {m.id for m in client.models.list()} == {"llama", "tiny-tf"}
    runs = [Run() for _ in range(STREAMS)]
    threads = [threading.Thread(target=_stream, args=(client, i, run)) for i, run in enumerate(runs)]
    for t in threads:
        t.start()
    for run in runs:
        assert run.started.wait(WAIT_S * 3)
    view = _cluster(gateway)
    sent = {address: w["load"]["batches_sent"] for address, w in view.items()}
    # One pool, three servers: each took streams (two each, but for a try refused and sent elsewhere).
    assert set(sent) == {s.address for s in servers} | {worker_url(worker)} and min(sent.values()) >= 1, sent
    # The streams still running on a transformers serve (the infergate worker may be done already).
    victim = max(servers, key=lambda s: view[s.address]["load"]["inflight_batches"])
    running = view[victim.address]["load"]["inflight_batches"]
    assert running > 0
    victim.popen.kill()
    victim.popen.wait()
    for t in threads:
        t.join(WAIT_S * 3)
        assert not t.is_alive()
    # Its streams went on elsewhere as continuations of the text sent (on the other transformers serve,
    # which reads the continued message as a finished turn, or on the worker, which continues it).
    assert [str(r.error) for r in runs if r.error is not None] == []
    for r in runs:
        assert r.finish in ("length", "stop") and r.chunks
        assert r.usage is not None and r.usage.completion_tokens > 0
    http = f"127.0.0.1:{gateway.ready['http_port']}"
    assert metric(http, "infergate_stream_resumes_total", 'model="llama"') == running
    after = _cluster(gateway)
    assert after[victim.address]["state"] == "down"
    sent = {a: w["load"]["batches_sent"] for a, w in after.items()}
    for i in range(4):
        answer = client.chat.completions.create(model="llama", messages=[{"role": "user", "content": f"after {i}"}],
                                                max_tokens=8)
        assert answer.choices[0].message.content
    later = _cluster(gateway)
    assert later[victim.address]["load"]["batches_sent"] == sent[victim.address]
    assert sum(w["load"]["batches_sent"] for w in later.values()) == sum(sent.values()) + 4

    # A 4xx of the server (transformers serve has no /v1/completions): its words, no one charged.
    survivor = next(s.address for s in servers if s is not victim)
    failures = later[survivor]["load"]["failures"]
    with pytest.raises(openai.NotFoundError, match="Not Found"):
        client.completions.create(model="tiny-tf", prompt="hello", max_tokens=4)
    final = _cluster(gateway)
    assert final[survivor]["load"]["failures"] == failures and final[survivor]["state"] == "ready"
