"""The generate endpoints over a real socket, on a fake core with a decoupled
model: events written as the model sends them, the stream closed after the
last, errors before and after the stream began, ``/generate`` on a decoupled
model, and a client that leaves mid-stream cancelling the model's stream.

The REST app runs in the test's own event loop (aiohttp on 127.0.0.1, port
0); clients: aiohttp reading the event lines as they come, and ``requests``
with ``stream=True`` on a thread. With real processes: test_generate_e2e.py.
"""

from __future__ import annotations

import asyncio
import gzip
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import numpy as np
import orjson
import pytest
import requests
from aiohttp import web
from tritonclient.grpc import model_config_pb2, service_pb2

from gateway.frontends.http_api import create_http_app
from gateway.frontends.http_generate import NOT_ONE_RESPONSE
from gateway.types import InferRequest, InferResponse, Tensor
from protos.errors import InvalidArgument, ModelNotFound, Overloaded

pytestmark = pytest.mark.timeout(60)
WAIT_S = 20.0  # a bound on waiting for the server to act, never a timing assert


def _int32(name: str, value: int) -> Tensor:
    return Tensor(name=name, datatype="INT32", shape=(1,), data=np.array([value], "<i4").tobytes())


class StreamingCore:
    """``square`` (decoupled: IN = n -> n responses OUT = n; parameter ``gated`` holds each
    response until the test opens the gate; ``fail_after`` raises after that many),
    ``double`` (ordinary: OUT = 2 * IN), ``busy`` (ordinary, always overloaded)."""

    def __init__(self) -> None:
        self.gate: asyncio.Queue[None] = asyncio.Queue()
        self.started = asyncio.Event()
        self.closed = asyncio.Event()
        self.sent = 0
        self.written: list[InferResponse] = []

    def stream_written(self, response: InferResponse) -> None:
        self.written.append(response)

    def model_metadata(self, name: str, version: str = "") -> service_pb2.ModelMetadataResponse:
        if name not in ("square", "double", "busy"):
            raise ModelNotFound(f"Request for unknown model: '{name}' is not found")
        meta = service_pb2.ModelMetadataResponse.TensorMetadata(name="IN", datatype="INT32", shape=[1])
        return service_pb2.ModelMetadataResponse(name=name, versions=["1"], inputs=[meta])

    def model_config(self, name: str, version: str = "") -> model_config_pb2.ModelConfig:
        config = model_config_pb2.ModelConfig(name=name)
        config.model_transaction_policy.decoupled = name == "square"
        return config

    async def infer(self, request: InferRequest) -> InferResponse:
        if request.model == "busy":
            raise Overloaded("model 'busy' is overloaded")
        (value,) = np.frombuffer(request.inputs[0].data, "<i4").tolist()
        return InferResponse(model=request.model, version="1", id=request.id, outputs=[_int32("OUT", 2 * value)])

    async def stream(self, request: InferRequest) -> AsyncIterator[InferResponse]:
        (n,) = np.frombuffer(request.inputs[0].data, "<i4").tolist()
        if n < 0:
            raise InvalidArgument("IN must not be negative")
        self.started.set()
        try:
            for index in range(n):
                if request.parameters.get("gated"):
                    await self.gate.get()
                if index == request.parameters.get("fail_after"):
                    raise InvalidArgument(f"the model failed after {index} responses")
                self.sent += 1
                yield InferResponse(model="square", version="1", id=request.id, outputs=[_int32("OUT", n)],
                                    parameters={"triton_final_response": index == n - 1})
        finally:
            self.closed.set()


@pytest.fixture
async def served() -> AsyncIterator[tuple[StreamingCore, str]]:
    core = StreamingCore()
    runner = web.AppRunner(create_http_app(core))  # type: ignore[arg-type]
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield core, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def _events(response: aiohttp.ClientResponse) -> list[Any]:
    """Every event's JSON, read line by line as the body arrives."""
    found = []
    async for line in response.content:
        if line.startswith(b"data: "):
            found.append(orjson.loads(line[len(b"data: "):]))
        else:
            assert line == b"\n", line
    return found


async def test_stream_sends_each_response_as_an_event_in_order_then_closes(served: tuple) -> None:
    core, base = served
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{base}/v2/models/square/generate_stream", json={"IN": 3, "id": "s1"}) as response:
            assert response.status == 200
            assert response.headers["Content-Type"] == "text/event-stream; charset=utf-8"
            events = await _events(response)
    assert events == [{"OUT": 3, "id": "s1", "model_name": "square", "model_version": "1"}] * 3
    assert core.closed.is_set() and len(core.written) == 3


async def test_each_event_is_flushed_before_the_model_sends_the_next(served: tuple) -> None:
    core, base = served
    async with aiohttp.ClientSession() as session:
        url = f"{base}/v2/models/square/versions/1/generate_stream"
        core.gate.put_nowait(None)  # the answer's head goes with the first response
        async with session.post(url, json={"IN": 2, "gated": True}) as response:
            for index in range(2):
                if index:
                    core.gate.put_nowait(None)
                line = await asyncio.wait_for(response.content.readline(), WAIT_S)
                assert orjson.loads(line[len(b"data: "):])["OUT"] == 2
                assert await response.content.readline() == b"\n"
            assert await asyncio.wait_for(response.content.read(), WAIT_S) == b""  # closed after the final one


async def test_a_model_that_sends_nothing_is_an_empty_stream(served: tuple) -> None:
    _, base = served
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{base}/v2/models/square/generate_stream", json={"IN": 0}) as response:
            assert response.status == 200 and await response.read() == b""


async def test_an_error_after_the_stream_began_is_its_last_event(served: tuple) -> None:
    _, base = served
    async with aiohttp.ClientSession() as session:
        body = {"IN": 3, "parameters": {"fail_after": 1}}
        async with session.post(f"{base}/v2/models/square/generate_stream", json=body) as response:
            assert response.status == 200
            events = await _events(response)
    assert events == [{"OUT": 3, "model_name": "square", "model_version": "1"},
                      {"error": "the model failed after 1 responses"}]


@pytest.mark.parametrize("endpoint", ["generate", "generate_stream"])
async def test_errors_before_the_first_response_are_json_answers(served: tuple, endpoint: str) -> None:
    _, base = served
    async with aiohttp.ClientSession() as session:
        cases = [("square", b'{"IN": -1}', 400, "IN must not be negative"),
                 ("busy", b'{"IN": 1}', 503, "model 'busy' is overloaded"),
                 ("nosuch", b'{"IN": 1}', 400, "Request for unknown model: 'nosuch' is not found"),
                 ("double", b'{"IN": 1', 400, "failed to parse the request JSON buffer: "),
                 ("double", b'{"IN": "x"}', 400, "attempt to access JSON non-signed-integer as signed-integer")]
        for model, body, status, words in cases:
            async with session.post(f"{base}/v2/models/{model}/{endpoint}", data=body) as response:
                assert response.status == status, (model, body)
                assert response.headers["Content-Type"].startswith("application/json")
                assert words in (await response.json())["error"]


async def test_ordinary_model_answers_one_object_or_one_event(served: tuple) -> None:
    _, base = served
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{base}/v2/models/double/generate", json={"IN": 21, "id": "d"}) as response:
            assert response.status == 200
            assert await response.json() == {"OUT": 42, "id": "d", "model_name": "double", "model_version": "1"}
        async with session.post(f"{base}/v2/models/double/generate_stream", json={"IN": 4}) as response:
            assert await _events(response) == [{"OUT": 8, "model_name": "double", "model_version": "1"}]


async def test_generate_on_a_decoupled_model_needs_exactly_one_response(served: tuple) -> None:
    core, base = served
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{base}/v2/models/square/generate", json={"IN": 1}) as response:
            assert response.status == 200
            assert await response.json() == {"OUT": 1, "model_name": "square", "model_version": "1"}
        for n in (0, 5):
            async with session.post(f"{base}/v2/models/square/generate", json={"IN": n}) as response:
                assert response.status == 400
                assert await response.json() == {"error": NOT_ONE_RESPONSE}
    # Refused at the second response: the rest of the stream was never asked for.
    assert core.sent == 1 + 2


async def test_a_client_that_leaves_mid_stream_closes_the_models_stream(served: tuple) -> None:
    core, base = served
    async with aiohttp.ClientSession() as session:
        core.gate.put_nowait(None)
        response = await session.post(f"{base}/v2/models/square/generate_stream", json={"IN": 100, "gated": True})
        assert (await asyncio.wait_for(response.content.readline(), WAIT_S)).startswith(b"data: ")
        response.close()  # hang up while the model holds its second response
    await asyncio.wait_for(core.closed.wait(), WAIT_S)
    assert core.sent == 1


async def test_gzip_body_and_a_compressed_answer(served: tuple) -> None:
    _, base = served
    async with aiohttp.ClientSession(auto_decompress=False) as session:
        body = gzip.compress(orjson.dumps({"IN": 5, "id": "x" * 600}))
        headers = {"Content-Encoding": "gzip", "Accept-Encoding": "gzip"}
        async with session.post(f"{base}/v2/models/double/generate", data=body, headers=headers) as response:
            assert response.status == 200 and response.headers["Content-Encoding"] == "gzip"
            assert orjson.loads(gzip.decompress(await response.read()))["OUT"] == 10


async def test_requests_reads_the_stream_line_by_line(served: tuple) -> None:
    _, base = served

    def read() -> tuple[int, list[Any]]:
        with requests.post(f"{base}/v2/models/square/generate_stream", json={"IN": 2}, stream=True,
                           timeout=WAIT_S) as response:
            lines = [line for line in response.iter_lines() if line]
            return response.status_code, [orjson.loads(line.removeprefix(b"data: ")) for line in lines]

    status, events = await asyncio.to_thread(read)
    assert status == 200 and [e["OUT"] for e in events] == [2, 2]
