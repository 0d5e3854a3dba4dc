"""The OpenAI-compatible API over a real socket, on a fake core with a
generative model: chunks written as the model sends its tokens, a character
split over tokens written whole, usage from the model's final response,
errors before the stream began (OpenAI's error answer) and after (one error
event, then ``[DONE]``), a stop string ending the model's stream, and a client
that leaves cancelling every stream of its request.

The REST app runs in the test's own event loop (aiohttp on 127.0.0.1, port
0). With real processes and the ``openai`` client: test_openai_e2e.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import numpy as np
import orjson
import pytest
from aiohttp import web
from tritonclient.grpc import model_config_pb2, service_pb2

from gateway.frontends.http_api import create_http_app
from gateway.types import InferRequest, InferResponse, Tensor
from protos.codec import deserialize_bytes_tensor, serialize_bytes_tensor
from protos.errors import Internal, ModelNotFound, Overloaded

pytestmark = pytest.mark.timeout(60)
WAIT_S = 20.0  # a bound on waiting for the server to act, never a timing assert


def _token(data: bytes) -> Tensor:
    return Tensor("text_output", "BYTES", (1,), serialize_bytes_tensor(np.array([data], dtype=np.object_)))


class GenerativeCore:
    """``lm``: streams the prompt's bytes one per response, then a final response with counts.

    Prompts starting ``gate:`` hold each token until the test opens the gate;
    ``fail:`` fails after two tokens; ``busy`` is refused before any token.
    """

    def __init__(self) -> None:
        self.gate: asyncio.Queue[None] = asyncio.Queue()
        self.opened = 0
        self.closed = 0
        self.all_closed = asyncio.Event()
        self.requests: list[InferRequest] = []
        self.written: list[InferResponse] = []

    def stream_written(self, response: InferResponse) -> None:
        self.written.append(response)

    def model_metadata(self, name: str, version: str = "") -> service_pb2.ModelMetadataResponse:
        if name != "lm":
            raise ModelNotFound(f"Request for unknown model: '{name}' is not found")
        meta = service_pb2.ModelMetadataResponse.TensorMetadata(name="text_input", datatype="BYTES", shape=[1])
        return service_pb2.ModelMetadataResponse(name=name, versions=["1"], inputs=[meta])

    def model_config(self, name: str, version: str = "") -> model_config_pb2.ModelConfig:
        self.model_metadata(name)
        config = model_config_pb2.ModelConfig(name=name)
        config.model_transaction_policy.decoupled = True
        return config

    async def repository_index(self, ready_only: bool = False) -> service_pb2.RepositoryIndexResponse:
        return service_pb2.RepositoryIndexResponse(models=[
            service_pb2.RepositoryIndexResponse.ModelIndex(name="lm", version="1", state="READY")])

    async def stream(self, request: InferRequest) -> AsyncIterator[InferResponse]:
        (prompt,) = deserialize_bytes_tensor(request.inputs[0].data).tolist()
        self.requests.append(request)
        if prompt == b"busy":
            raise Overloaded("model 'lm' is at capacity (4 sequences); retry later", retry_after_s=2.0)
        self.opened += 1
        try:
            for index, byte in enumerate(prompt):
                if prompt.startswith(b"gate:"):
                    await self.gate.get()
                if prompt.startswith(b"fail:") and index == 2:
                    raise Internal("the model failed after 2 tokens")
                yield InferResponse("lm", "1", request.id, [_token(bytes([byte]))], final=False)
            yield InferResponse("lm", "1", request.id, [], final=True, parameters={
                "finish_reason": "length", "prompt_tokens": len(prompt) + 1, "completion_tokens": len(prompt)})
        finally:
            self.closed += 1
            if self.closed == self.opened:
                self.all_closed.set()


@pytest.fixture
async def served() -> AsyncIterator[tuple[GenerativeCore, str]]:
    core = GenerativeCore()
    runner = web.AppRunner(create_http_app(core))  # type: ignore[arg-type]
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield core, f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
    finally:
        await runner.cleanup()


async def _read_event(response: aiohttp.ClientResponse) -> Any:
    line = await asyncio.wait_for(response.content.readline(), WAIT_S)
    assert line.startswith(b"data: "), line
    assert await response.content.readline() == b"\n"
    payload = line[len(b"data: "):].strip()
    return payload.decode() if payload == b"[DONE]" else orjson.loads(payload)


async def _events(response: aiohttp.ClientResponse) -> list[Any]:
    found = []
    while True:
        event = await _read_event(response)
        found.append(event)
        if event == "[DONE]":
            assert await response.content.read() == b""
            return found


async def test_chunks_go_out_as_tokens_come_and_a_split_character_comes_whole(served: tuple) -> None:
    core, base = served
    prompt = "gate:é"
    async with aiohttp.ClientSession() as session:
        body = {"model": "lm", "prompt": prompt, "stream": True, "stream_options": {"include_usage": True}}
        core.gate.put_nowait(None)
        async with session.post(f"{base}/completions", json=body) as response:
            assert response.status == 200 and response.headers["Content-Type"].startswith("text/event-stream")
            texts = []
            for _ in "gate:":
                chunk = await _read_event(response)
                texts.append(chunk["choices"][0]["text"])
                core.gate.put_nowait(None)  # the next token only after this chunk was read
            core.gate.put_nowait(None)
            rest = await _events(response)
    assert texts == list("gate:")
    assert rest[0]["choices"][0]["text"] == "é"  # two tokens, one chunk
    assert rest[1]["choices"][0] == {"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}
    assert rest[2]["choices"] == [] and rest[2]["usage"] == {"prompt_tokens": 8, "completion_tokens": 7,
                                                               "total_tokens": 15}
    assert rest[3] == "[DONE]"
    assert len(core.written) == 6  # each text chunk's completing response, reported once written


async def test_whole_answer_of_n_choices_with_usage_summed(served: tuple) -> None:
    core, base = served
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{base}/completions", json={"model": "lm", "prompt": "abc", "n": 3,
                                                             "seed": 5}) as response:
            body = await response.json()
    assert [c["text"] for c in body["choices"]] == ["abc"] * 3
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 9, "total_tokens": 13}
    seeds = sorted(np.frombuffer(t.data, np.uint64)[0] for r in core.requests for t in r.inputs if t.name == "seed")
    assert seeds == [] and sorted(r.parameters["seed"] for r in core.requests) == [5, 6, 7]


async def test_a_stop_string_ends_the_text_before_it_and_closes_the_models_stream(served: tuple) -> None:
    core, base = served
    async with aiohttp.ClientSession() as session:
        body = {"model": "lm", "messages": [{"role": "user", "content": "x"}], "stop": ["user"]}
        async with session.post(f"{base}/chat/completions", json=body) as response:
            answer = await response.json()
    assert answer["choices"][0]["message"]["content"] == "<|"
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert answer["usage"]["completion_tokens"] == 6  # the tokens read before the stop string was complete
    assert core.all_closed.is_set()


async def test_errors_before_the_stream_are_openai_error_answers(served: tuple) -> None:
    core, base = served
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{base}/completions", json={"model": "lm", "prompt": "busy", "stream": True}) as r:
            assert r.status == 429 and r.headers["Retry-After"] == "2"
            assert await r.json() == {"error": {"message": "model 'lm' is at capacity (4 sequences); retry later",
                                                "type": "rate_limit_error", "param": None, "code": "overloaded"}}
        async with session.post(f"{base}/completions", json={"model": "gpt", "prompt": "x"}) as r:
            assert r.status == 404
            assert await r.json() == {"error": {"message": "Request for unknown model: 'gpt' is not found",
                                                "type": "invalid_request_error", "param": None,
                                                "code": "model_not_found"}}
        async with session.post(f"{base}/completions", data=b"{nope") as r:
            assert r.status == 400 and (await r.json())["error"]["type"] == "invalid_request_error"
        async with session.post(f"{base}/completions", json={"model": "lm", "prompt": "x", "n": 99}) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "n"
        async with session.get(f"{base}/nothing") as r:
            assert r.status == 404 and (await r.json())["error"]["code"] == "unknown_url"
        async with session.get(f"{base}/completions") as r:
            assert r.status == 405 and "error" in await r.json()
        async with session.get(f"{base}/models") as r:
            assert (await r.json())["data"] == [{"id": "lm", "object": "model", "created": 0, "owned_by": "infergate"}]


async def test_an_error_after_the_stream_began_is_its_last_event_before_done(served: tuple) -> None:
    core, base = served
    async with aiohttp.ClientSession() as session:
        body = {"model": "lm", "messages": [{"role": "user", "content": "x"}], "stream": True}
        # The chat template puts "<|user|>" first: render a prompt that starts with "fail:" through completions.
        async with session.post(f"{base}/completions", json={"model": "lm", "prompt": "fail:x", "stream": True}) as r:
            assert r.status == 200
            events = await _events(r)
        async with session.post(f"{base}/chat/completions", json=body) as r:
            chat = await _events(r)
    assert [e["choices"][0]["text"] for e in events[:2]] == ["f", "a"]
    assert events[2] == {"error": {"message": "the model failed after 2 tokens", "type": "server_error",
                                   "param": None, "code": None}}
    assert events[3] == "[DONE]" and len(events) == 4
    assert chat[0]["choices"][0]["delta"] == {"role": "assistant", "content": "<"}
    assert chat[-2]["choices"][0]["delta"] == {} and chat[-2]["choices"][0]["finish_reason"] == "length"


async def test_a_client_that_leaves_cancels_every_stream_of_its_request(served: tuple) -> None:
    core, base = served
    async with aiohttp.ClientSession() as session:
        body = {"model": "lm", "prompt": "gate:abcdef", "n": 3, "stream": True}
        core.gate.put_nowait(None)
        async with session.post(f"{base}/completions", json=body) as response:
            await _read_event(response)
            response.close()  # leave with two streams waiting for their first token, one for its second
    await asyncio.wait_for(core.all_closed.wait(), WAIT_S)
    assert core.opened == core.closed == 3
