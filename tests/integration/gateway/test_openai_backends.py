"""OpenAI-protocol servers as workers (``--worker openai://HOST:PORT``), each a
real process (``tests/fixtures/openai_stub.py``, which speaks vLLM's protocol
and names itself in its text), behind a real gateway, driven by the
official ``openai`` client:

- the gateway lists the servers' models (a LoRA adapter they list
  included) and relays their chunks one by one with their usage; a
  completion, a chat, a non-streamed answer; the sampling fields reach the
  server; a config entry's API key and headers go with every call;
- choice: a stream goes to the server with fewer of the gateway's requests
  in flight; a server whose metrics show a queue gets none while another
  is idle; prompts with one prefix go to one server;
- a 4xx is the request's: passed back in the server's words, charged to
  no server (none ejected); a 503 is retried on the others; a stream cut
  mid-way goes on on another server as a continuation of the text sent
  (a prompt with the text appended; a chat with it as the assistant's
  message to continue), with the whole generation's usage, and the cut
  server is marked down;
- ``/v1/embeddings`` goes on to a server and its answer comes back as it
  gave it (strings, token ids, base64); a model that does not embed is the
  server's 400, charged to none;
- a server killed mid-stream: its stream goes on on the other from the
  next piece, new requests go to the other, it is marked down.
"""

from __future__ import annotations

import base64
import json
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import requests

from tests.harness import Proc, start
from tests.integration.gateway.stream_clients import WAIT_S, poll

pytestmark = pytest.mark.timeout(120)

STUB = "tests.fixtures.openai_stub"


def _stub(name: str, *args: str) -> Proc:
    return start(["--name", name, "--port", "0", *args], module=STUB)


def _url(proc: Proc) -> str:
    return f"http://127.0.0.1:{proc.ready['port']}"


def _gateway(tmp_path: Path, workers: list[dict[str, Any]], flags: list[str]) -> Proc:
    config = tmp_path / "gateway.yaml"
    config.write_text(json.dumps({"workers": workers, "probe": {"interval_s": 0.5}}))  # JSON is YAML
    args = ["gateway", "--config", str(config), "--http-port", "0", "--grpc-port", "0"]
    for flag in flags:
        args += ["--worker", flag]
    proc = start(args)
    base = f"http://127.0.0.1:{proc.ready['http_port']}"
    poll(lambda: requests.get(f"{base}/v2/models/base/ready", timeout=10).status_code == 200, "models ready")
    return proc


def _client(proc: Proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{proc.ready['http_port']}/v1", api_key="unused",
                         max_retries=0, timeout=WAIT_S)


def _cluster(proc: Proc) -> dict[str, dict[str, Any]]:
    doc = requests.get(f"http://127.0.0.1:{proc.ready['http_port']}/v2/cluster", timeout=10).json()
    return {w["address"]: w for w in doc["workers"]}


def _server(text: str) -> str:
    """Which stub wrote ``text`` ("A:0 A:1 " -> "A")."""
    names = {piece.split(":")[0] for piece in text.split()}
    assert len(names) == 1, text
    return names.pop()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, dict[str, Proc]]]:
    stubs = {"A": _stub("A"), "B": _stub("B"), "C": _stub("C", "--waiting", "10", "--no-health")}
    gateway = None
    try:
        a = stubs["A"]
        gateway = _gateway(tmp_path_factory.mktemp("oai"),
                           [{"address": f"openai://127.0.0.1:{a.ready['port']}", "api_key": "key-a",
                             "headers": {"X-Team": "search"}}],
                           [f"openai://127.0.0.1:{stubs[n].ready['port']}" for n in ("B", "C")])
        yield gateway, stubs
    finally:
        if gateway is not None:
            gateway.stop()
        for proc in stubs.values():
            proc.stop()


def _calls(stub: Proc) -> list[dict[str, Any]]:
    return requests.get(f"{_url(stub)}/calls", timeout=10).json()


def test_models_streams_and_usage(fleet: tuple[Proc, dict[str, Proc]]) -> None:
    gateway, stubs = fleet
    client = _client(gateway)
    assert sorted(m.id for m in client.models.list()) == ["base", "base-lora"]
    chunks = list(client.chat.completions.create(
        model="base-lora", messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi you"}],
        max_tokens=5, stream=True, stream_options={"include_usage": True}, temperature=0.5, seed=7, stop=["zz"]))
    texts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    server = _server("".join(texts))
    assert server in ("A", "B")  # C's queue keeps it out while the others are idle
    assert texts == [f"{server}:{i} " for i in range(5)]  # the server's chunks, one by one
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    assert chunks[-1].usage.prompt_tokens == 4  # the server's count (every message's words), not the gateway's
    call = _calls(stubs[server])[-1]
    assert call["path"] == "/v1/chat/completions"
    body = call["body"]
    assert body["model"] == "base-lora" and body["stream"] is True
    assert body["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi you"}]
    assert (body["max_tokens"], body["temperature"], body["seed"], body["stop"]) == (5, 0.5, 7, ["zz"])
    if server == "A":
        assert call["authorization"] == "Bearer key-a"

    whole = client.completions.create(model="base", prompt="once upon", max_tokens=3)
    assert whole.choices[0].text == "".join(f"{_server(whole.choices[0].text)}:{i} " for i in range(3))
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (2, 3)
    assert whole.choices[0].finish_reason == "length"


def test_choice_by_load_queue_and_prefix(fleet: tuple[Proc, dict[str, Proc]]) -> None:
    gateway, stubs = fleet
    client = _client(gateway)
    assert _cluster(gateway)[f"127.0.0.1:{stubs['C'].ready['port']}"]["server_load"]["waiting"] == 10
    # A stream held open on one server: every new one goes to the other (fewest in flight),
    # and none to C while its metrics show a queue.
    held = client.completions.create(model="base", prompt="slow one", max_tokens=3, stream=True)
    first = next(iter(held)).choices[0].text
    busy = _server(first)
    others = {_server(client.completions.create(model="base", prompt=f"quick {i}", max_tokens=2).choices[0].text)
              for i in range(6)}
    assert others == ({"A", "B"} - {busy})
    requests.post(f"{_url(stubs[busy])}/release", timeout=10)
    requests.post(f"{_url(stubs[busy])}/release", timeout=10)
    rest = "".join(c.choices[0].text for c in held)
    assert _server(first + rest) == busy
    # One prefix, one server (both idle: without affinity a coin toss each time).
    prefix = "You are the gateway's tiny test assistant; answer in one word. " * 2
    served = {_server(client.chat.completions.create(
        model="base", messages=[{"role": "system", "content": prefix}, {"role": "user", "content": f"q{i}"}],
        max_tokens=2).choices[0].message.content) for i in range(6)}
    assert len(served) == 1


def test_a_4xx_is_the_requests_fault(fleet: tuple[Proc, dict[str, Proc]]) -> None:
    gateway, stubs = fleet
    client = _client(gateway)
    before = {a: w["load"]["failures"] for a, w in _cluster(gateway).items()}
    for _ in range(8):  # past the outlier detector's consecutive failures
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="base", prompt="a bad prompt", max_tokens=2)
        assert "prompt is bad: the stub refuses it" in str(info.value)
    with pytest.raises(openai.BadRequestError):
        list(client.chat.completions.create(model="base", messages=[{"role": "user", "content": "bad"}],
                                            stream=True))
    after = _cluster(gateway)
    assert {a: w["load"]["failures"] for a, w in after.items()} == before
    assert {w["state"] for w in after.values()} == {"ready"}
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)


def test_embeddings_go_on_to_the_servers(fleet: tuple[Proc, dict[str, Proc]]) -> None:
    gateway, stubs = fleet
    client = _client(gateway)
    answer = client.embeddings.create(model="base", input=["one", "three", "seven!!"])
    vectors = [d.embedding for d in answer.data]
    assert [v[:2] for v in vectors] == [[3.0, 0.0], [5.0, 1.0], [7.0, 2.0]]  # the server's own vectors, in order
    assert answer.model == "base" and answer.usage.prompt_tokens == 3
    names = {float(sum(n.encode())): n for n in stubs}
    served = names[vectors[0][2]]
    sent = [c for c in _calls(stubs[served]) if c["path"] == "/v1/embeddings"][-1]
    assert sent["body"]["input"] == ["one", "three", "seven!!"] and sent["body"]["model"] == "base"
    ids = client.embeddings.create(model="base", input=[[1, 2, 3, 4]])  # token ids go on as they are
    assert ids.data[0].embedding[0] == 4.0
    encoded = client.embeddings.create(model="base", input="abc", encoding_format="base64")
    assert struct.unpack("<3f", base64.b64decode(encoded.data[0].embedding))[:2] == (3.0, 0.0)  # the server's
    # A model that does not embed: the server's 400 in its words, charged to no server; a 503 is retried.
    before = {a: w["load"]["failures"] for a, w in _cluster(gateway).items()}
    for _ in range(6):
        with pytest.raises(openai.BadRequestError) as info:
            client.embeddings.create(model="base-lora", input="hi")
        assert "does not support Embeddings API" in str(info.value)
    assert {a: w["load"]["failures"] for a, w in _cluster(gateway).items()} == before
    with pytest.raises(openai.APIStatusError) as boom:
        client.embeddings.create(model="base", input="boom")
    assert boom.value.status_code == 503 and "engine exploded" in str(boom.value)
    with pytest.raises(openai.BadRequestError):  # the gateway's own check of the request, before any server
        client.embeddings.create(model="base", input=[])


def test_server_faults(fleet: tuple[Proc, dict[str, Proc]]) -> None:
    gateway, stubs = fleet
    client = _client(gateway)
    # 503 from every server: retried elsewhere, then the last words go back as the gateway's 503.
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model="base", prompt="boom", max_tokens=2)
    assert info.value.status_code == 503 and "engine exploded" in str(info.value)
    # A stream cut mid-way goes on on another server, from where it was: no gap, no repeat, the
    # usage of the whole generation. The cut server is marked down; the probe brings it back.
    chunks = list(client.completions.create(model="base", prompt="cut here ", max_tokens=6, stream=True,
                                            stream_options={"include_usage": True}))
    got = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
    first, then = (piece.split(":")[0] for piece in (got[0], got[-1]))
    assert first != then
    assert got == [f"{first}:0 ", f"{first}:1 "] + [f"{then}:{i} " for i in range(2, 6)]
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (2, 6)
    continued = _calls(stubs[then])[-1]["body"]
    assert continued["prompt"] == f"cut here {first}:0 {first}:1 " and continued["max_tokens"] == 4
    address = f"127.0.0.1:{stubs[first].ready['port']}"
    poll(lambda: _cluster(gateway)[address]["state"] == "ready", "the cut server back")
    assert _cluster(gateway)[address]["load"]["failures"] >= 1
    # A chat goes on as the continuation of the assistant's message (vLLM's continue_final_message).
    chunks = list(client.chat.completions.create(model="base", messages=[{"role": "user", "content": "cut now"}],
                                                 max_tokens=5, stream=True, stream_options={"include_usage": True}))
    got = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    first, then = (piece.split(":")[0] for piece in (got[0], got[-1]))
    assert first != then and got == [f"{first}:0 ", f"{first}:1 "] + [f"{then}:{i} " for i in range(2, 5)]
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (2, 5)
    continued = _calls(stubs[then])[-1]["body"]
    assert continued["messages"] == [{"role": "user", "content": "cut now"},
                                     {"role": "assistant", "content": f"{first}:0 {first}:1 "}]
    assert continued["continue_final_message"] is True and continued["add_generation_prompt"] is False
    assert continued["max_tokens"] == 3
    address = f"127.0.0.1:{stubs[first].ready['port']}"
    poll(lambda: _cluster(gateway)[address]["state"] == "ready", "the cut server back")


def test_server_killed_mid_stream(tmp_path: Path) -> None:
    stubs = {"A": _stub("A"), "B": _stub("B")}
    gateway = None
    try:
        gateway = _gateway(tmp_path, [], [f"openai://127.0.0.1:{p.ready['port']}" for p in stubs.values()])
        client = _client(gateway)
        held = iter(client.completions.create(model="base", prompt="slow", max_tokens=4, stream=True))
        victim = _server(next(held).choices[0].text)
        survivor = ({"A", "B"} - {victim}).pop()
        for _ in range(3):  # the survivor's pieces of the continuation, let through ahead
            requests.post(f"{_url(stubs[survivor])}/release", timeout=10)
        rest: list[str] = []
        errors: list[BaseException] = []

        def read() -> None:
            try:
                rest.extend(chunk.choices[0].text for chunk in held)
            except openai.APIError as e:
                errors.append(e)

        reader = threading.Thread(target=read)
        reader.start()
        stubs[victim].kill()
        reader.join(WAIT_S)
        assert not reader.is_alive()
        # The stream went on on the survivor from the next piece: no error, no gap, no repeat.
        assert errors == [] and "".join(rest) == "".join(f"{survivor}:{i} " for i in range(1, 4))
        assert _calls(stubs[survivor])[-1]["body"]["prompt"] == f"slow{victim}:0 "
        address = f"127.0.0.1:{stubs[victim].ready['port']}"
        served = {_server(client.completions.create(model="base", prompt=f"after {i}", max_tokens=2)
                          .choices[0].text) for i in range(4)}
        assert served == {survivor}
        assert _cluster(gateway)[address]["state"] == "down"
    finally:
        if gateway is not None:
            gateway.stop()
        for proc in stubs.values():
            proc.stop(check=False)
