"""The bench's streaming clients: one open stream per concurrency slot.

Each client reads the model's signature like the unary clients do, prepares
payloads once into its wire form, and opens :class:`StreamSlot` s; a slot
sends one request at a time and fills in its :class:`StreamRecord` (arrival
of every data response, the end, or an error kind). Errors are values, so a
failed request never stops a level.

- gRPC: one ``ModelStreamInfer`` call per slot kept open across requests
  (perf_analyzer's decoupled mode). Requests carry
  ``triton_enable_empty_final_response`` so the end of a request is always
  marked by ``triton_final_response``; a response without outputs is that
  marker, not a response. A response with no final flag at all (a model that
  is not decoupled) ends its request. A broken or timed-out call is dropped
  and the slot opens a fresh one for its next request.
- HTTP: ``POST .../generate_stream`` (the generate extension) with the inputs
  as JSON keys; every server-sent ``data:`` line carrying an output is a
  response, one with an ``error`` member ends the request with an error,
  the end of the body ends it normally. (Each event is one ``data:`` line,
  as Triton and the gateway send them.)

``--timeout-ms`` bounds each streamed request from its send to its final response.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any
from typing import Protocol as TypingProtocol

import aiohttp
import grpc
import orjson
from tritonclient.grpc import service_pb2

from loadtest.clients import GrpcBenchClient, HttpBenchClient, grpc_error_kind
from loadtest.config import BenchConfig, BenchError, Protocol
from loadtest.inputs import ModelSignature, Payload
from loadtest.streaming import StreamRecord
from protos import codec, json_codec

log = logging.getLogger(__name__)

_STREAM_METHOD = "/inference.GRPCInferenceService/ModelStreamInfer"
_EMPTY_FINAL = "triton_enable_empty_final_response"
_FINAL = "triton_final_response"
# Members of a generate response that are not outputs.
_GENERATE_META = frozenset({"model_name", "model_version", "id", "parameters"})

Clock = Callable[[], float]


class StreamSlot(TypingProtocol):
    async def send(self, prepared: Any, record: StreamRecord) -> None: ...
    async def close(self) -> None: ...


class StreamBenchClient(TypingProtocol):
    async def signature(self) -> ModelSignature: ...
    def prepare(self, payload: Payload) -> Any: ...
    def open(self) -> StreamSlot: ...
    async def close(self) -> None: ...


class _FirstSeen:
    """Logs the first error of each kind only (a level may fail thousands of times)."""

    def __init__(self) -> None:
        self._seen: set[str] = set()

    def __call__(self, kind: str, detail: str) -> str:
        if kind not in self._seen:
            self._seen.add(kind)
            log.warning("first %s error from a stream: %s", kind, detail)
        return kind


def grpc_stream_request_bytes(model: str, version: str, payload: Payload, request_id: str = "") -> bytes:
    """A serialized ModelInferRequest for a stream: raw contents, empty final response enabled."""
    request = service_pb2.ModelInferRequest(model_name=model, model_version=version, id=request_id)
    for tensor in payload:
        request.inputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
        request.raw_input_contents.append(tensor.raw)
    request.parameters[_EMPTY_FINAL].bool_param = True
    return request.SerializeToString()


def is_final(response: service_pb2.ModelInferResponse) -> bool:
    if _FINAL not in response.parameters:
        return True  # not a decoupled answer: one response is the whole answer
    return response.parameters[_FINAL].bool_param


class GrpcStreamSlot:
    def __init__(self, channel: grpc.aio.Channel, timeout_s: float, metadata: Any, clock: Clock,
                 errors: _FirstSeen) -> None:
        self._method = channel.stream_stream(
            _STREAM_METHOD, request_serializer=None,
            response_deserializer=service_pb2.ModelStreamInferResponse.FromString,
        )  # fmt: skip
        self._timeout_s = timeout_s
        self._metadata = metadata
        self._clock = clock
        self._errors = errors
        self._call: Any = None

    async def send(self, prepared: bytes, record: StreamRecord) -> None:
        try:
            await asyncio.wait_for(self._exchange(prepared, record), self._timeout_s)
        except asyncio.TimeoutError:
            record.error = "timeout"
            self._drop()
        except grpc.aio.AioRpcError as exc:
            record.error = self._errors(grpc_error_kind(exc.code()), exc.details() or "")
            self._drop()
        if record.error is not None and record.done_s != record.done_s:  # NaN: not set yet
            record.done_s = self._clock()

    async def _exchange(self, prepared: bytes, record: StreamRecord) -> None:
        if self._call is None:
            self._call = self._method(metadata=self._metadata)
        call = self._call
        await call.write(prepared)
        while True:
            response = await call.read()
            now = self._clock()
            if response is grpc.aio.EOF:
                record.error = self._errors("stream closed", "the server ended the stream mid-request")
                self._call = None
                break
            if response.error_message:
                record.error = self._errors("stream error", response.error_message)
                break
            inner = response.infer_response
            if len(inner.outputs) or len(inner.raw_output_contents):
                record.arrivals_s.append(now)
            if is_final(inner):
                break
        record.done_s = now

    def _drop(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None

    async def close(self) -> None:
        call, self._call = self._call, None
        if call is not None:
            try:
                await call.done_writing()
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError, RuntimeError):
                pass
            call.cancel()


class GrpcStreamClient:
    def __init__(self, config: BenchConfig, clock: Clock = time.monotonic) -> None:
        self._unary = GrpcBenchClient(config)  # metadata and config reads
        self._config = config
        self._clock = clock
        self._errors = _FirstSeen()
        self._metadata = tuple((k.lower(), v) for k, v in config.headers) or None

    async def signature(self) -> ModelSignature:
        return await self._unary.signature()

    def prepare(self, payload: Payload) -> bytes:
        return grpc_stream_request_bytes(self._config.model, self._config.model_version, payload)

    def open(self) -> GrpcStreamSlot:
        # The unary client's channel carries the streams too: one connection, many calls.
        return GrpcStreamSlot(self._unary.channel, self._config.timeout_s, self._metadata, self._clock, self._errors)

    async def close(self) -> None:
        await self._unary.close()


def generate_body(payload: Payload) -> bytes:
    """The generate extension's request: each input by name, its values as a flat JSON list."""
    try:
        doc = {t.name: json_codec.raw_to_json(t.datatype, t.shape, t.raw, name=t.name) for t in payload}
    except codec.CodecError as exc:
        raise BenchError(f"{exc}: the generate endpoint takes JSON values only") from None
    return orjson.dumps(doc)


def parse_event(line: bytes) -> dict[str, Any] | None:
    """The JSON of one server-sent ``data:`` line; None for other lines (blank, comments, event names)."""
    text = line.strip()
    if not text.startswith(b"data:"):
        return None
    try:
        doc = orjson.loads(text[5:].strip())
    except orjson.JSONDecodeError:
        return {"error": f"unreadable event {text[:80]!r}"}
    return doc if isinstance(doc, dict) else {"error": f"unexpected event {text[:80]!r}"}


class EventLines:
    """Complete lines out of a byte stream cut anywhere."""

    def __init__(self) -> None:
        self._rest = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        *lines, self._rest = (self._rest + chunk).split(b"\n")
        return lines


def is_data_event(doc: dict[str, Any]) -> bool:
    return any(key not in _GENERATE_META for key in doc)


class HttpStreamSlot:
    def __init__(self, session: aiohttp.ClientSession, url: str, clock: Clock, errors: _FirstSeen) -> None:
        self._session = session
        self._url = url
        self._clock = clock
        self._errors = errors

    async def send(self, prepared: bytes, record: StreamRecord) -> None:
        try:
            async with self._session.post(self._url, data=prepared,
                                          headers={"Content-Type": "application/json"}) as resp:
                if resp.status != 200:
                    detail = (await resp.read())[:300].decode(errors="replace")
                    record.error = self._errors(f"HTTP {resp.status}", detail)
                else:
                    await self._read_events(resp, record)
        except asyncio.TimeoutError:
            record.error = "timeout"
        except aiohttp.ClientError as exc:
            record.error = self._errors("connection", f"{exc.__class__.__name__}: {exc}")
        record.done_s = self._clock()

    async def _read_events(self, resp: aiohttp.ClientResponse, record: StreamRecord) -> None:
        # Lines are split here rather than by the response's line reader, which
        # refuses lines over its buffer size (an event with a large output).
        lines = EventLines()
        async for chunk in resp.content.iter_any():
            now = self._clock()  # events that came in one chunk arrived together
            for line in lines.feed(chunk):
                doc = parse_event(line)
                if doc is None:
                    continue
                if "error" in doc:
                    record.error = self._errors("stream error", str(doc["error"]))
                    return
                if is_data_event(doc):
                    record.arrivals_s.append(now)

    async def close(self) -> None:
        return None


class HttpStreamClient:
    def __init__(self, config: BenchConfig, clock: Clock = time.monotonic) -> None:
        self._unary = HttpBenchClient(config, binary=False)  # metadata and config reads
        base = f"http://{config.url}/v2/models/{config.model}"
        base += f"/versions/{config.model_version}" if config.model_version else ""
        self._url = base + "/generate_stream"
        self._clock = clock
        self._errors = _FirstSeen()

    async def signature(self) -> ModelSignature:
        return await self._unary.signature()

    def prepare(self, payload: Payload) -> bytes:
        return generate_body(payload)

    def open(self) -> HttpStreamSlot:
        return HttpStreamSlot(self._unary.session, self._url, self._clock, self._errors)

    async def close(self) -> None:
        await self._unary.close()


StreamClientFactory = Callable[[BenchConfig], StreamBenchClient]


def make_stream_client(config: BenchConfig) -> StreamBenchClient:
    """The streaming client for the configured protocol; create it inside the loop that uses it."""
    if config.protocol is Protocol.GRPC:
        return GrpcStreamClient(config)
    return HttpStreamClient(config)
