"""The bench's timed stream clients, one open stream per concurrency slot.

Both streaming modes use them: ``--streaming`` (``loadtest.stream_requests``)
and ``--generate`` (``loadtest.generate``). A mode gives a client how to build
its wire request and what counts as a response (a token, for generation);
the clients own the sending, the clock and the error kinds. A client
prepares payloads once into their wire form and opens :class:`StreamSlot` s;
a slot sends one request at a time and fills in its :class:`StreamRecord`
(arrival of every data response, the end, or an error kind). Errors are
values, so a failed request never stops a level.

- gRPC: one ``ModelStreamInfer`` call per slot kept open across requests
  (perf_analyzer's decoupled mode). Requests carry
  ``triton_enable_empty_final_response`` (:data:`EMPTY_FINAL`) so the end of
  a request is always marked by ``triton_final_response``; a response
  without outputs is that marker, not a response. A response with no final
  flag at all (a model that is not decoupled) ends its request. A broken or
  timed-out call is dropped and the slot opens a fresh one for its next
  request.
- HTTP server-sent events: one ``POST`` per request (the generate
  extension's ``generate_stream``, or a streamed OpenAI completion). The
  mode's :data:`EventParser` reads each line into a :class:`StreamEvent`: a
  response, an error (ends the request with an error), the end marker, or
  the server's own count of the responses it sent (those beyond the events
  seen arrive with the last one). The end of the body ends the request
  normally.

``--timeout-ms`` bounds each streamed request from its send to its final response.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from typing import Protocol as TypingProtocol

import aiohttp
import grpc
import orjson
from tritonclient.grpc import service_pb2

from loadtest.clients import GrpcBenchClient, HttpBenchClient, grpc_error_kind
from loadtest.config import BenchConfig
from loadtest.inputs import ModelSignature
from loadtest.streaming import StreamRecord
from protos.triton_words import ENABLE_EMPTY_FINAL as EMPTY_FINAL
from protos.triton_words import FINAL_RESPONSE

log = logging.getLogger(__name__)

_STREAM_METHOD = "/inference.GRPCInferenceService/ModelStreamInfer"

Clock = Callable[[], float]
# A mode's wire form of one of its payloads.
RequestBuilder = Callable[[Any], bytes]


class StreamSlot(TypingProtocol):
    async def send(self, prepared: Any, record: StreamRecord) -> None: ...
    async def close(self) -> None: ...


class StreamBenchClient(TypingProtocol):
    async def signature(self) -> ModelSignature: ...
    def prepare(self, payload: Any) -> Any: ...
    def open(self) -> StreamSlot: ...
    async def close(self) -> None: ...


StreamClientFactory = Callable[[BenchConfig], StreamBenchClient]


class FirstErrors:
    """Logs the first error of each kind only (a level may fail thousands of times)."""

    def __init__(self) -> None:
        self._seen: set[str] = set()

    def __call__(self, kind: str, detail: str) -> str:
        if kind not in self._seen:
            self._seen.add(kind)
            log.warning("first %s error from a stream: %s", kind, detail)
        return kind


# ---- gRPC ModelStreamInfer -----------------------------------------------------


def is_final(response: service_pb2.ModelInferResponse) -> bool:
    if FINAL_RESPONSE not in response.parameters:
        return True  # not a decoupled answer: one response is the whole answer
    return response.parameters[FINAL_RESPONSE].bool_param


class GrpcStreamSlot:
    def __init__(self, channel: grpc.aio.Channel, timeout_s: float, metadata: Any, clock: Clock,
                 errors: FirstErrors) -> None:
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
    """``ModelStreamInfer`` streams whose requests ``build`` serializes (with :data:`EMPTY_FINAL` set)."""

    def __init__(self, config: BenchConfig, build: RequestBuilder, clock: Clock = time.monotonic) -> None:
        self._unary = GrpcBenchClient(config)  # metadata and config reads
        self._config = config
        self._build = build
        self._clock = clock
        self._errors = FirstErrors()
        self._metadata = tuple((k.lower(), v) for k, v in config.headers) or None

    async def signature(self) -> ModelSignature:
        return await self._unary.signature()

    def prepare(self, payload: Any) -> bytes:
        return self._build(payload)

    def open(self) -> GrpcStreamSlot:
        # The unary client's channel carries the streams too: one connection, many calls.
        return GrpcStreamSlot(self._unary.channel, self._config.timeout_s, self._metadata, self._clock, self._errors)

    async def close(self) -> None:
        await self._unary.close()


# ---- HTTP server-sent events -----------------------------------------------------


@dataclass(frozen=True, slots=True)
class StreamEvent:
    """What one ``data:`` line means to the clock."""

    response: bool = False  # a data response (a token) arrived
    error: str | None = None  # the request ends with an error
    done: bool = False  # the end marker: the rest of its chunk is not read
    counted: int | None = None  # the server's count of the request's responses so far


# One line of the body -> its event; None for lines that carry none (blank, comments).
EventParser = Callable[[bytes], StreamEvent | None]


class EventLines:
    """Complete lines out of a byte stream cut anywhere."""

    def __init__(self) -> None:
        self._rest = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        *lines, self._rest = (self._rest + chunk).split(b"\n")
        return lines


def parse_event(line: bytes) -> dict[str, Any] | None:
    """The JSON of one generate-extension ``data:`` line; None for other lines (blank, comments, event names)."""
    text = line.strip()
    if not text.startswith(b"data:"):
        return None
    try:
        doc = orjson.loads(text[5:].strip())
    except orjson.JSONDecodeError:
        return {"error": f"unreadable event {text[:80]!r}"}
    return doc if isinstance(doc, dict) else {"error": f"unexpected event {text[:80]!r}"}


def generate_events(is_response: Callable[[dict[str, Any]], bool]) -> EventParser:
    """The generate extension's events: an ``error`` member ends the request, ``is_response`` says the rest."""

    def parse(line: bytes) -> StreamEvent | None:
        doc = parse_event(line)
        if doc is None:
            return None
        if "error" in doc:
            return StreamEvent(error=str(doc["error"]))
        return StreamEvent(response=is_response(doc))

    return parse


def add_merged_responses(record: StreamRecord, counted: int | None) -> None:
    """Responses the server counted beyond the events seen arrive with the last event."""
    if counted is not None and record.arrivals_s and counted > len(record.arrivals_s):
        record.arrivals_s.extend([record.arrivals_s[-1]] * (counted - len(record.arrivals_s)))


class SseStreamSlot:
    """One ``POST`` at a time whose body is server-sent events, read with the mode's ``parse``."""

    def __init__(self, session: aiohttp.ClientSession, url: str, parse: EventParser, clock: Clock,
                 errors: FirstErrors) -> None:
        self._session = session
        self._url = url
        self._parse = parse
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
                    await self.read_events(resp, record)
        except asyncio.TimeoutError:
            record.error = "timeout"
        except aiohttp.ClientError as exc:
            record.error = self._errors("connection", f"{exc.__class__.__name__}: {exc}")
        record.done_s = self._clock()

    async def read_events(self, resp: aiohttp.ClientResponse, record: StreamRecord) -> None:
        # Lines are split here rather than by the response's line reader, which
        # refuses lines over its buffer size (an event with a large output).
        lines = EventLines()
        counted: int | None = None
        async for chunk in resp.content.iter_any():
            now = self._clock()  # events that came in one chunk arrived together
            for line in lines.feed(chunk):
                event = self._parse(line)
                if event is None:
                    continue
                if event.error is not None:
                    record.error = self._errors("stream error", event.error)
                    return
                if event.done:
                    break
                if event.response:
                    record.arrivals_s.append(now)
                if event.counted is not None:
                    counted = event.counted
        add_merged_responses(record, counted)

    async def close(self) -> None:
        return None


class HttpStreamClient:
    """``generate_stream`` requests (the generate extension): ``build`` makes the body, ``parse`` reads events."""

    def __init__(self, config: BenchConfig, build: RequestBuilder, parse: EventParser,
                 clock: Clock = time.monotonic) -> None:
        self._unary = HttpBenchClient(config, binary=False)  # metadata and config reads
        base = f"http://{config.url}/v2/models/{config.model}"
        base += f"/versions/{config.model_version}" if config.model_version else ""
        self._url = base + "/generate_stream"
        self._build = build
        self._parse = parse
        self._clock = clock
        self._errors = FirstErrors()

    async def signature(self) -> ModelSignature:
        return await self._unary.signature()

    def prepare(self, payload: Any) -> bytes:
        return self._build(payload)

    def open(self) -> SseStreamSlot:
        return SseStreamSlot(self._unary.session, self._url, self._parse, self._clock, self._errors)

    async def close(self) -> None:
        await self._unary.close()
