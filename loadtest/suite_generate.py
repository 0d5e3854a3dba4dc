"""The suite's ``generation`` section: the example decoder through the gateway,
continuous batching against one sequence at a time, and one worker against two.

Workers serve ``tiny_lm`` as built (continuous batching: every running
sequence in each decoder step) and ``tiny_lm_serial`` (the same model with
``max_batch_sequences: 1``: sequences run one at a time). One gateway sits
in front of the first worker, another in front of both; the first worker is
also measured straight (``DIRECT``: its own scheduling, without the
gateway's read and write of every token on the same cores). Every level is
``infergate bench --generate`` over gRPC streams (``loadtest.generate``):
greedy generations of ``OUTPUT_TOKENS`` tokens after ``PROMPT_TOKENS``,
``ignore_eos``, so every request costs the same.

Rows: output tokens/s, requests/s, time to first token and inter-token
latency (p50, p99), and output tokens/s over the one-at-a-time row of the
same path (through the gateway or straight) at the same number of streams
(the target: >= 4x at 16 streams).
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from loadtest.config import BenchConfig, Protocol
from loadtest.generate import GenLevel, gen_requests, make_gen_client
from loadtest.stream_runner import run_stream_bench
from loadtest.streaming import StreamLevelResult
from loadtest.suite_context import SuiteContext, copy_model, grpc_address
from loadtest.suite_procs import ProcessGroup, SuiteError
from loadtest.suite_report import Column, SectionResult

MODEL = "tiny_lm"
SERIAL = "tiny_lm_serial"
PROMPT_TOKENS = 32
OUTPUT_TOKENS = 32
LEVELS = (1, 16)
REQUESTS = {1: 8, 16: 64}  # requests measured per level (a quarter with --quick, at least one per stream)
MAX_SEQUENCES = 32  # tiny_lm's max_sequences: the gateway lets that many streams run on a worker
SERIAL_SETUP = "1 worker, one at a time"
DIRECT = "1 worker straight, "  # the setups measured without a gateway


def write_repository(source: Path, root: Path) -> Path:
    """``tiny_lm`` and ``tiny_lm_serial`` (one sequence per decoder step) under ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    shutil.copytree(source / MODEL, root / MODEL, dirs_exist_ok=True)
    copy_model(source, root, MODEL, SERIAL, {"max_batch_sequences": "1"})
    return root


def gateway_config() -> dict[str, Any]:
    """Streams of a generative model in flight per worker up to its sequences, not its execution slots."""
    bounds = {"max_inflight_per_replica": MAX_SEQUENCES, "busy_inflight_per_replica": MAX_SEQUENCES}
    return {"models": {MODEL: dict(bounds), SERIAL: dict(bounds)}}


def gen_level(url: str, model: str, streams: int, requests: int) -> StreamLevelResult:
    config = BenchConfig(model=model, url=url, protocol=Protocol.GRPC, generate=True, concurrency=(streams,),
                         request_count=requests, warmup_requests=streams, prompt_tokens=PROMPT_TOKENS,
                         output_tokens=OUTPUT_TOKENS, timeout_ms=120_000)
    result = run_stream_bench(config, client_factory=make_gen_client, payloads=gen_requests(config))
    if not result.levels or result.levels[0].requests == 0:
        errors = result.levels[0].errors if result.levels else {}
        raise SuiteError(f"generation bench of {model} at {url}: no request succeeded; errors {errors}")
    return result.levels[0]


def gen_rows(measured: Mapping[tuple[str, int], StreamLevelResult]) -> list[dict[str, Any]]:
    """One row per (setup, streams); ratios against one sequence at a time on the same path at the same streams."""
    rows = []
    for (setup, streams), level in measured.items():
        g = GenLevel.of(level)
        serial = measured.get((DIRECT + "one at a time" if setup.startswith(DIRECT) else SERIAL_SETUP, streams))
        base = GenLevel.of(serial).output_tokens_per_s if serial is not None else 0.0
        rows.append({
            "setup": setup, "streams": streams, "output_tokens_per_s": g.output_tokens_per_s,
            "requests_per_s": g.requests_per_s, "ttft_p50": g.ttft_ms[0], "ttft_p99": g.ttft_ms[2],
            "itl_p50": g.itl_ms[0], "itl_p99": g.itl_ms[2],
            "vs_serial": g.output_tokens_per_s / base if base > 0 else None, "errors": g.errors,
        })  # fmt: skip
    return rows


def run_generation(ctx: SuiteContext) -> SectionResult:
    repo = write_repository(ctx.settings.model_repository, ctx.workdir / "generation-repo")
    scale = 0.25 if ctx.settings.quick else 1.0
    measured: dict[tuple[str, int], StreamLevelResult] = {}
    args = ["worker", "--model-repository", str(repo), "--host", "127.0.0.1", "--port", "0",
            "--log-level", "warning"]
    with ProcessGroup(ctx.workdir) as procs:
        workers = [grpc_address(w) for w in procs.start_many([(f"gen-worker-{i}", args) for i in range(2)])]
        one = ctx.start_gateway(procs, workers[:1], gateway_config(), [MODEL, SERIAL])
        two = ctx.start_gateway(procs, workers, gateway_config(), [MODEL])
        via_one, via_two = (f"127.0.0.1:{gateway.ready['grpc_port']}" for gateway in (one, two))
        setups = {"1 worker, continuous batching": (via_one, MODEL), SERIAL_SETUP: (via_one, SERIAL),
                  "2 workers, continuous batching": (via_two, MODEL),
                  DIRECT + "continuous batching": (workers[0], MODEL), DIRECT + "one at a time": (workers[0], SERIAL)}
        for streams in LEVELS:
            for setup, (address, model) in setups.items():
                ctx.progress(f"generation: {setup}, {streams} stream(s)")
                requests = max(streams, round(REQUESTS[streams] * scale))
                measured[(setup, streams)] = gen_level(address, model, streams, requests)
    notes = (
        f"{MODEL}: greedy, {PROMPT_TOKENS}-token prompts, {OUTPUT_TOKENS} tokens each (ignore_eos); "
        f"{REQUESTS[1]} requests at 1 stream, {REQUESTS[16]} at 16"
        f"{' (a quarter of that with --quick)' if ctx.settings.quick else ''}, after one warmup request per "
        "stream; gRPC streams through a gateway, or straight to the first worker (\"straight\")",
        f"one at a time = {SERIAL}: the same model with max_batch_sequences 1 on the same worker; "
        "vs one at a time = output tokens/s over the one-at-a-time row of the same path at the same streams "
        "(target >= 4x at 16)",
        "through a gateway a decode step's tokens reach it as one message (the worker's packed call) and each is "
        "written once more to its client, on the same cores as the worker and the client: where the cores are "
        "full, that caps the batched rows, not the one-at-a-time ones",
        "the workers share this machine's cores: 2 workers gain only where cores are free",
    )
    return SectionResult(
        key="generation",
        title=f"Generation ({MODEL}): continuous batching vs one sequence at a time, 1 vs 2 workers",
        columns=(
            Column("setup", "setup"), Column("streams", "streams"),
            Column("output_tokens_per_s", "output tokens/s", ",.0f"),
            Column("requests_per_s", "requests/s", ",.1f"),
            Column("ttft_p50", "TTFT p50 ms", ".1f"), Column("ttft_p99", "TTFT p99 ms", ".1f"),
            Column("itl_p50", "ITL p50 ms", ".2f"), Column("itl_p99", "ITL p99 ms", ".2f"),
            Column("vs_serial", "tokens/s vs one at a time", ".2f"),
            Column("errors", "errors"),
        ),
        rows=tuple(gen_rows(measured)),
        notes=notes,
        details={"levels": {f"{s} x{n}": asdict(lv) for (s, n), lv in measured.items()}},
    )
