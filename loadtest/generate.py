"""``infergate bench --generate``: generative load in the style of genai-perf.

A generation request is a prompt of ``prompt_tokens`` bytes (the example
decoders' vocabulary is byte-level, so bytes are tokens) asking for
``output_tokens`` tokens with ``ignore_eos`` (every request runs to its
length, so levels compare). The streaming bench (``loadtest.stream_runner``)
drives it: one open stream per concurrency slot, each streamed response one
token, so its statistics read as genai-perf's:

- time to first token: the first token's arrival - the send;
- inter-token latency: the gap between consecutive tokens of one request
  (p50/p90/p99 over every gap of the level);
- output tokens/s and requests/s: tokens and completed requests of the
  measured span, over it.

The timed stream clients are ``loadtest.stream_clients``'; this module owns
what is generation's own: the requests, what counts as a token, the report.
One client per ``-i``: ``grpc`` (``ModelStreamInfer``, the contract's inputs
``text_input`` and ``max_tokens``; each response with outputs a token),
``http`` (the generate extension's ``generate_stream``; each event with
``text_output`` a token) and ``openai`` (``/v1/completions`` with
``stream: true``, each chunk with text one token; the body and chunk parsing
are ``loadtest.openai_stream``'s).
"""

from __future__ import annotations

import functools
import math
import random
import struct
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from tritonclient.grpc import service_pb2

from loadtest.config import BenchConfig, Protocol
from loadtest.inputs import ModelSignature
from loadtest.openai_stream import completion_body
from loadtest.openai_stream import parse_event as parse_openai_event
from loadtest.stream_clients import (
    EMPTY_FINAL,
    Clock,
    FirstErrors,
    GrpcStreamClient,
    HttpStreamClient,
    SseStreamSlot,
    StreamBenchClient,
    StreamEvent,
    generate_events,
)
from loadtest.stream_report import StreamBenchResult
from loadtest.streaming import Percentiles, StreamLevelResult

TEXT_OUTPUT = "text_output"
PROMPTS = 64  # distinct prompts per run, taken in turn
_ALPHABET = b"abcdefghijklmnopqrstuvwxyz      "  # words of random letters


@dataclass(frozen=True, slots=True)
class GenRequest:
    """One generation request: its prompt and the tokens it asks for."""

    prompt: bytes
    max_tokens: int


def gen_requests(config: BenchConfig, count: int = PROMPTS) -> list[GenRequest]:
    """``count`` distinct prompts of ``config.prompt_tokens`` bytes (seeded), each asking ``output_tokens``;
    with ``prefix_prompts``, each opens with one of that many shared openings of ``prefix_tokens`` bytes
    (chosen at random, seeded), which differ from their first byte on."""
    rng = random.Random(config.seed)

    def text(size: int) -> bytes:
        return bytes(rng.choice(_ALPHABET) for _ in range(size))

    openings = [(f"{k}:".encode() + text(config.prefix_tokens))[:config.prefix_tokens]
                for k in range(config.prefix_prompts)]
    return [GenRequest((rng.choice(openings) if openings else b"") + text(config.prompt_tokens), config.output_tokens)
            for _ in range(count)]


def grpc_gen_request(model: str, version: str, req: GenRequest) -> bytes:
    """The serialized ModelInferRequest of one generation (raw inputs, empty final response, ignore_eos)."""
    request = service_pb2.ModelInferRequest(model_name=model, model_version=version)
    request.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    request.raw_input_contents.append(struct.pack("<I", len(req.prompt)) + req.prompt)
    request.inputs.add(name="max_tokens", datatype="INT32", shape=[1])
    request.raw_input_contents.append(struct.pack("<i", req.max_tokens))
    request.parameters[EMPTY_FINAL].bool_param = True
    request.parameters["ignore_eos"].bool_param = True
    return request.SerializeToString()


def http_gen_request(req: GenRequest) -> bytes:
    """The generate extension's body of one generation."""
    return orjson.dumps({"text_input": req.prompt.decode(), "max_tokens": req.max_tokens,
                         "parameters": {"ignore_eos": True}})


def openai_gen_request(model: str, req: GenRequest) -> bytes:
    """A streamed ``/v1/completions`` body of one generation (greedy, ``ignore_eos``)."""
    return completion_body(model, req.prompt.decode(), req.max_tokens, ignore_eos=True, temperature=0)


def is_token_event(doc: dict[str, Any]) -> bool:
    """A ``generate_stream`` event with ``text_output`` is a token (the last one carries only counts)."""
    return TEXT_OUTPUT in doc


def openai_token_event(line: bytes) -> StreamEvent | None:
    """A completion chunk with text is a token; the usage chunk counts the tokens.

    A chunk may carry more than one token (bytes of an unfinished UTF-8
    character wait for the rest): the tokens the usage chunk counts beyond
    the chunks are taken as arriving with the last one, as genai-perf's
    mean inter-token latency over the request would have them."""
    event = parse_openai_event(line)
    if event is None:
        return None
    return StreamEvent(response=bool(event.text), error=event.error, done=event.done, counted=event.usage_tokens)


class OpenAIGenClient:
    """Generations over the OpenAI-compatible API (``/v1/completions``)."""

    def __init__(self, config: BenchConfig, clock: Clock = time.monotonic) -> None:
        self._config = config
        self._url = f"http://{config.url}/v1/completions"
        self._clock = clock
        self._errors = FirstErrors()
        headers = {k: v for k, v in config.headers}
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), headers=headers,
                                              timeout=aiohttp.ClientTimeout(total=config.timeout_s))

    async def signature(self) -> ModelSignature:
        return ModelSignature(self._config.model, self._config.model_version, 0, (), ())

    def prepare(self, payload: Any) -> bytes:
        return openai_gen_request(self._config.model, payload)

    def open(self) -> SseStreamSlot:
        return SseStreamSlot(self._session, self._url, openai_token_event, self._clock, self._errors)

    async def close(self) -> None:
        await self._session.close()


def make_gen_client(config: BenchConfig) -> StreamBenchClient:
    """The generation client of the configured protocol; create it inside the loop that uses it."""
    if config.protocol is Protocol.GRPC:
        return GrpcStreamClient(config, functools.partial(grpc_gen_request, config.model, config.model_version))
    if config.protocol is Protocol.OPENAI:
        return OpenAIGenClient(config)
    return HttpStreamClient(config, http_gen_request, generate_events(is_token_event))


# ---- the report --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GenLevel:
    """One concurrency level in genai-perf's terms; latencies in milliseconds."""

    concurrency: int
    requests: int
    output_tokens: int
    errors: int
    requests_per_s: float
    output_tokens_per_s: float
    ttft_ms: tuple[float, float, float]  # p50, p90, p99
    itl_ms: tuple[float, float, float]
    tokens_per_request: float
    stable: bool

    @staticmethod
    def of(level: StreamLevelResult) -> GenLevel:
        def ms(p: Percentiles) -> tuple[float, float, float]:
            return p.p50_us / 1000, p.p90_us / 1000, p.p99_us / 1000

        return GenLevel(level.level, level.requests, level.responses, level.error_count, level.requests_per_s,
                        level.responses_per_s, ms(level.first_response), ms(level.between_responses),
                        level.responses_per_request, level.stable)


def gen_levels(result: StreamBenchResult) -> list[GenLevel]:
    return [GenLevel.of(level) for level in result.levels]


def format_gen_table(result: StreamBenchResult) -> str:
    """The levels as a text table: requests/s, output tokens/s, TTFT and ITL percentiles."""
    head = ("Concurrency", "Req/s", "Out tok/s", "Tok/req", "TTFT p50", "p90", "p99", "ITL p50", "p90", "p99",
            "Errors")
    rows = [head]
    for g in gen_levels(result):
        rows.append((str(g.concurrency) + ("" if g.stable else "*"), _f(g.requests_per_s), _f(g.output_tokens_per_s),
                     _f(g.tokens_per_request), *(_f(v) for v in g.ttft_ms), *(_f(v) for v in g.itl_ms),
                     str(g.errors)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = [f"{result.model} over {result.protocol} at {result.url} (latencies in ms)"]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    if any(not g.stable for g in gen_levels(result)):
        lines.append("* did not stabilise within --max-trials windows")
    return "\n".join(lines)


def _f(value: float) -> str:
    if math.isnan(value):
        return "-"
    return f"{value:.1f}" if value < 1000 else f"{value:.0f}"


def gen_json(result: StreamBenchResult) -> dict[str, Any]:
    """The results as a JSON document (genai-perf's names)."""
    return {"model": result.model, "protocol": result.protocol, "url": result.url,
            "interrupted": result.interrupted,
            "levels": [{"concurrency": g.concurrency, "requests": g.requests, "output_tokens": g.output_tokens,
                        "errors": g.errors, "requests_per_s": g.requests_per_s,
                        "output_tokens_per_s": g.output_tokens_per_s,
                        "time_to_first_token_ms": dict(zip(("p50", "p90", "p99"), g.ttft_ms)),
                        "inter_token_latency_ms": dict(zip(("p50", "p90", "p99"), g.itl_ms)),
                        "stable": g.stable} for g in gen_levels(result)]}
