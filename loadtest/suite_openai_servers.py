"""The suite's ``openai_servers`` section: infergate in front of ``transformers
serve``, and infergate's worker against it, on one model.

The model is the tests' tiny random-weight Llama
(``tests/fixtures/hf_decoders.py``: hidden 64, 2 layers, grouped-query
attention, a byte-level BPE tokenizer), built in the section's workdir with
its ``optimum-cli export onnx --task text-generation-with-past`` export. One
``transformers serve`` serves the checkpoint (``tests/fixtures/hf_serve.py``);
one infergate worker serves the export copied to ``REPO/llama/1/`` with no
``config.pbtxt`` (auto-complete). Three paths, every one measured with the
same client (``loadtest.openai_stream``: streamed chats, greedy,
``MAX_TOKENS`` each, ``transformers serve`` having no ``/v1/completions``):

- ``DIRECT``: ``transformers serve`` itself;
- ``VIA_GATEWAY``: a gateway in front of it (a config ``workers`` entry
  ``openai://HOST:PORT``);
- ``WORKER``: a gateway in front of the infergate worker.

At 1 and 16 streams, each stream sends its requests back to back (closed
loop) after one warmup request per stream, in ``ROUNDS`` rounds that take
the paths in turn; first, one greedy chat per prompt to each server checks
that both give the same text (so the worker's usage counts the tokens of
both). Rows: time to first token p50/p99,
the gap between text chunks p50 (the median over requests of each one's mean
gap), text chunks per request, output tokens/s, errors; ratios against
``DIRECT`` at the same streams: the chunk gap through the gateway (target
<= 1.1x at 16 streams) and the worker's output tokens/s (target >= 3x at 16).
"""

from __future__ import annotations

import asyncio
import importlib.util
import shutil
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from loadtest.latency import nearest_rank
from loadtest.openai_stream import OpenAIStreamClient, StreamTiming, completion_body, parse_event
from loadtest.suite_context import SuiteContext, grpc_address
from loadtest.suite_procs import ProcessGroup, SuiteError
from loadtest.suite_report import Column, SectionResult

MODEL = "llama"
MAX_TOKENS = 64
LEVELS = (1, 16)
REQUESTS = {1: 16, 16: 96}  # measured per level and path (a quarter with --quick), over ROUNDS rounds
ROUNDS = 2
DIRECT = "transformers serve, direct"
VIA_GATEWAY = "gateway -> transformers serve"
WORKER = "gateway -> infergate worker (export)"
PATHS = (DIRECT, VIA_GATEWAY, WORKER)
# Paths whose usage counts the model's tokens. transformers serve reports no usage, and a gateway in front of
# a server that reports none counts the chunks it relayed (here words): those paths count max_tokens.
USAGE_PATHS = frozenset({WORKER})
MAX_STREAMS = 32  # streams a gateway lets run on its one server at once: above every level
SERVE_START_S = 180.0
REQUEST_TIMEOUT_S = 300.0
# What the section needs beyond infergate's own: (module, what to install).
NEEDS = (("torch", "torch"), ("transformers", "transformers"), ("tokenizers", "tokenizers"),
         ("optimum.exporters.onnx", "optimum-onnx"), ("tests.fixtures.hf_decoders", "the repository's tests/ folder"))
# Prompts of different lengths, taken in turn.
PROMPTS = ("Once upon a time", "Tell me a story about a fox.", "Hello world, this is a tiny language model.",
           "A model speaks in tokens; a tokenizer turns text into tokens and back. Go on.")


@dataclass(frozen=True, slots=True)
class LevelSummary:
    """One path at one number of streams; latencies in milliseconds."""

    streams: int
    requests: int
    errors: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    chunk_gap_p50_ms: float
    chunks_per_request: float
    output_tokens: int
    output_tokens_per_s: float
    usage_counted: bool  # every token count came from the server's usage (else: max_tokens per request)

    @property
    def tokens_per_request(self) -> float:
        return self.output_tokens / self.requests if self.requests else 0.0


def request_tokens(timing: StreamTiming, max_tokens: int, use_usage: bool) -> int:
    """The output tokens of one request: the server's usage where its path counts tokens (``use_usage``), else
    ``max_tokens`` (a request run to the length it asked for: the section checks that the model's greedy
    texts are the same on both servers, and the worker's usage says how long they are)."""
    return timing.usage_tokens if use_usage and timing.usage_tokens is not None else max_tokens


def summarize(streams: int, timings: Sequence[StreamTiming], elapsed_s: float, max_tokens: int,
              use_usage: bool) -> LevelSummary:  # fmt: skip
    """A level from its requests' timings and the wall time they took together."""
    good = [t for t in timings if t.error is None and t.ttft_s is not None]
    ttfts = sorted(t.ttft_s * 1000 for t in good if t.ttft_s is not None)
    gaps = [t.chunk_gap_s * 1000 for t in good if t.chunk_gap_s is not None]
    tokens = sum(request_tokens(t, max_tokens, use_usage) for t in good)
    return LevelSummary(
        streams=streams, requests=len(good), errors=len(timings) - len(good),
        ttft_p50_ms=nearest_rank(ttfts, 50), ttft_p99_ms=nearest_rank(ttfts, 99),
        chunk_gap_p50_ms=statistics.median(gaps) if gaps else float("nan"),
        chunks_per_request=sum(t.chunks for t in good) / len(good) if good else 0.0,
        output_tokens=tokens, output_tokens_per_s=tokens / elapsed_s if elapsed_s > 0 else 0.0,
        usage_counted=use_usage and bool(good) and all(t.usage_tokens is not None for t in good),
    )  # fmt: skip


def _ratio(value: float, base: float) -> float | None:
    return value / base if base > 0 and value == value and base == base else None  # NaN != NaN


def servers_rows(measured: Mapping[tuple[str, int], LevelSummary]) -> list[dict[str, Any]]:
    """One row per (path, streams); ratios against ``DIRECT`` at the same streams: the chunk gap through the
    gateway in front of it, and output tokens/s of both gateway paths."""
    rows = []
    for (path, streams), s in measured.items():
        base = measured.get((DIRECT, streams))
        gap_ratio = tokens_ratio = None
        if base is not None and path != DIRECT:
            tokens_ratio = _ratio(s.output_tokens_per_s, base.output_tokens_per_s)
            # The same server's chunks on both paths: their gaps compare; the worker streams other chunks.
            if path == VIA_GATEWAY:
                gap_ratio = _ratio(s.chunk_gap_p50_ms, base.chunk_gap_p50_ms)
        rows.append({
            "path": path, "streams": streams, "requests": s.requests, "ttft_p50": s.ttft_p50_ms,
            "ttft_p99": s.ttft_p99_ms, "gap_p50": s.chunk_gap_p50_ms, "chunks": s.chunks_per_request,
            "tokens_per_request": s.tokens_per_request,
            "tokens_counted": "usage" if s.usage_counted else "max_tokens",
            "output_tokens_per_s": s.output_tokens_per_s, "gap_vs_direct": gap_ratio,
            "tokens_vs_direct": tokens_ratio, "errors": s.errors,
        })  # fmt: skip
    return rows


async def _closed_loop(base_url: str, streams: int, requests: int, max_tokens: int) -> tuple[list[StreamTiming], float]:
    """``streams`` loops sending chats back to back until ``requests`` were sent, after one warmup each."""
    client = OpenAIStreamClient(base_url, MODEL, chat=True, timeout_s=REQUEST_TIMEOUT_S)
    try:
        await asyncio.gather(*(client.generate(PROMPTS[i % len(PROMPTS)], max_tokens, temperature=0)
                               for i in range(streams)))
        queue = list(range(requests))
        timings: list[StreamTiming] = []

        async def loop() -> None:
            while queue:
                i = queue.pop()
                timings.append(await client.generate(PROMPTS[i % len(PROMPTS)], max_tokens, temperature=0))

        started = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(streams)))
        return timings, time.perf_counter() - started
    finally:
        await client.close()


async def _greedy_texts(base_url: str, max_tokens: int) -> list[str]:
    """Each prompt's streamed chat text, one request at a time."""
    texts = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)) as session:
        for prompt in PROMPTS:
            body = completion_body(MODEL, prompt, max_tokens, chat=True, temperature=0)
            text = ""
            async with session.post(base_url + "/chat/completions", data=body,
                                    headers={"Content-Type": "application/json"}) as resp:
                if resp.status != 200:
                    raise SuiteError(f"openai_servers: a chat at {base_url} answered HTTP {resp.status}")
                async for line in resp.content:
                    event = parse_event(line)
                    if event is not None:
                        text += event.text
            texts.append(text)
    return texts


def same_texts(first: Sequence[str], second: Sequence[str]) -> int:
    """How many prompts got the same text from both."""
    return sum(a == b for a, b in zip(first, second, strict=True))


def measure(base_url: str, streams: int, requests: int) -> tuple[list[StreamTiming], float]:
    """One round of a level: its requests' timings and the wall time they took."""
    timings, elapsed = asyncio.run(_closed_loop(base_url, streams, requests, MAX_TOKENS))
    if not any(t.error is None for t in timings):
        errors = sorted({t.error for t in timings if t.error})
        raise SuiteError(f"openai_servers at {base_url}, {streams} stream(s): no request succeeded; errors {errors}")
    return timings, elapsed


def _check_needs() -> None:
    lacking = []
    for module, package in NEEDS:
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # a parent package missing
            found = False
        if not found:
            lacking.append(package)
    if not lacking:
        from tests.fixtures.hf_serve import missing

        serve = missing()
        if serve is not None:
            lacking.append(serve)
    if lacking:
        raise SuiteError(f"openai_servers needs {', '.join(lacking)}: not importable here")


def _build(root: Path) -> tuple[Path, Path]:
    """The checkpoint and a repository holding its export as ``llama/1`` (no config.pbtxt)."""
    from tests.fixtures.hf_decoders import build_source, export

    source = build_source(root / "source")
    exported = export(source, root / "export")
    repo = root / "repo"
    shutil.copytree(exported, repo / MODEL / "1")
    return source, repo


def _wait_served(served: Any) -> None:
    from tests.fixtures.hf_serve import is_ready

    deadline = time.monotonic() + SERVE_START_S
    try:
        while not is_ready(served):
            if time.monotonic() > deadline:
                raise SuiteError(f"transformers serve not ready after {SERVE_START_S:.0f}s:\n{served.log_tail()}")
            time.sleep(0.2)  # polling its /health, not standing in for it
    except RuntimeError as exc:
        raise SuiteError(str(exc)) from exc


def run_openai_servers(ctx: SuiteContext) -> SectionResult:
    _check_needs()
    from tests.fixtures.hf_serve import transformers_serve

    root = ctx.workdir / "openai-servers"
    ctx.progress("openai_servers: building the tiny Llama and its optimum export")
    source, repo = _build(root)
    scale = 0.25 if ctx.settings.quick else 1.0
    bounds = {"max_inflight_per_replica": MAX_STREAMS, "busy_inflight_per_replica": MAX_STREAMS}
    measured: dict[tuple[str, int], LevelSummary] = {}
    same = 0
    served = transformers_serve(source, root / "transformers-serve.log")
    try:
        with ProcessGroup(ctx.workdir) as procs:
            worker = procs.start("openai-worker", ["worker", "--model-repository", str(repo), "--host", "127.0.0.1",
                                                   "--port", "0", "--log-level", "warning"])
            _wait_served(served)
            entry = {"address": f"openai://{served.address}", "models": [MODEL], "max_streams": MAX_STREAMS}
            fronting = ctx.start_gateway(procs, [], {"workers": [entry], "models": {MODEL: dict(bounds)}}, [MODEL])
            working = ctx.start_gateway(procs, [grpc_address(worker)], {"models": {MODEL: dict(bounds)}}, [MODEL])
            urls = {DIRECT: f"http://{served.address}/v1",
                    VIA_GATEWAY: f"http://127.0.0.1:{fronting.ready['http_port']}/v1",
                    WORKER: f"http://127.0.0.1:{working.ready['http_port']}/v1"}
            ctx.progress("openai_servers: the greedy texts of both servers")
            same = same_texts(asyncio.run(_greedy_texts(urls[DIRECT], MAX_TOKENS)),
                              asyncio.run(_greedy_texts(urls[WORKER], MAX_TOKENS)))
            for streams in LEVELS:
                requests = max(streams, round(REQUESTS[streams] * scale / ROUNDS))
                timings: dict[str, list[StreamTiming]] = {path: [] for path in PATHS}
                elapsed = dict.fromkeys(PATHS, 0.0)
                for round_ in range(ROUNDS):  # paths in turn, so a change in the machine's load falls on all
                    for path in PATHS:
                        ctx.progress(f"openai_servers: {path}, {streams} stream(s), round {round_ + 1}")
                        got, took = measure(urls[path], streams, requests)
                        timings[path] += got
                        elapsed[path] += took
                for path in PATHS:
                    measured[(path, streams)] = summarize(streams, timings[path], elapsed[path], MAX_TOKENS,
                                                          path in USAGE_PATHS)
    finally:
        served.stop()
    notes = (
        f"model: the tests' tiny random-weight Llama (hidden 64, 2 layers, 4 heads over 2 KV heads, a 320-token "
        f"byte-level BPE); `transformers serve` on the checkpoint (defaults: one `generate` per request), the "
        f"infergate worker on its optimum export with no config.pbtxt; streamed chats, greedy, max_tokens "
        f"{MAX_TOKENS}; {REQUESTS[1]} requests at 1 stream, {REQUESTS[16]} at 16"
        f"{' (a quarter with --quick)' if ctx.settings.quick else ''} per path, in {ROUNDS} rounds taking the "
        "paths in turn, each stream's back to back after one warmup request per stream; every path through the "
        "same client (loadtest.openai_stream)",
        "tokens: the worker's usage; `transformers serve` reports none (and the gateway in front of it counts the "
        f"chunks it relayed, words here), so its paths count max_tokens ({MAX_TOKENS}) per request: greedy, the "
        f"two servers gave the same text for {same} of the {len(PROMPTS)} prompts, and the worker's usage says "
        "how many tokens that is (the model's EOS is made unlikely); output tokens/s = the level's tokens over "
        "its wall time",
        "chunk gap: each request's mean gap between text chunks, the median over requests; `transformers serve` "
        "streams a chunk per word (its TextIteratorStreamer), the worker one per token (whole characters), so "
        "chunks per request differ: the gap ratio compares the gateway in front of transformers serve with it "
        "direct (the same chunks), tokens/s ratio compares the worker with it",
        "targets at 16 streams: gap through the gateway <= 1.1x direct; the worker's output tokens/s >= 3x "
        "transformers serve's",
        "every process (servers, gateways, the client) shares this machine's cores with each other and with "
        "whatever else runs on it: see the load average in the run's meta",
    )
    return SectionResult(
        key="openai_servers",
        title="OpenAI-protocol servers: in front of `transformers serve`, and infergate's worker against it",
        columns=(
            Column("path", "path"), Column("streams", "streams"), Column("requests", "requests"),
            Column("ttft_p50", "TTFT p50 ms", ".1f"), Column("ttft_p99", "TTFT p99 ms", ".1f"),
            Column("gap_p50", "chunk gap p50 ms", ".2f"), Column("chunks", "chunks/request", ".1f"),
            Column("output_tokens_per_s", "output tokens/s", ",.0f"), Column("tokens_per_request", "tokens/request", ".1f"),
            Column("tokens_counted", "tokens counted"),
            Column("gap_vs_direct", "chunk gap vs direct", ".2f"),
            Column("tokens_vs_direct", "tokens/s vs direct", ".2f"), Column("errors", "errors"),
        ),
        rows=tuple(servers_rows(measured)),
        notes=notes,
        details={"levels": {f"{p} x{n}": asdict(s) for (p, n), s in measured.items()},
                 "same_greedy_texts": same, "prompts": len(PROMPTS)},
    )
