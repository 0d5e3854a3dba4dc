"""The suite's ``prefix`` section: what the worker's prefix cache saves, and
what routing by prefix adds in front of two workers.

The model is ``prefix_lm``: the example decoder's graph (``models.decoder``)
at a size where a prompt's prefill is most of its time to first token (d_model
256, 4 layers, 8 heads, 1024 positions; random weights, byte vocabulary), built
by the section. Every request is a greedy generation of ``OUTPUT_TOKENS``
tokens after a prompt of a shared opening and ``TAIL_TOKENS`` bytes of its own
(``infergate bench --generate --num-prefix-prompts K --prefix-prompt-length
P``), over gRPC streams.

- **cache**: one worker, straight (no gateway), one stream: prompts opening
  with one 256-byte opening served before, against the same prompts to the
  same model with ``enable_prefix_caching: false``. Also for ``tiny_lm``.
  The target: time to first token p50 <= 0.5x cold.
- **routing**: 8 openings over 2 workers, two gateways side by side (each with
  its own two workers, so neither warms the other's caches): one routing by
  prefix (the default), one least loaded (``prefix_routing: false``). Each
  worker's ``max_cache_bytes`` holds its running sequences and
  :data:`FLEET_OPENINGS_CACHED` openings' blocks beside them (the openings of
  the prompts running there are in those sequences' caches: 4.5 to 6.5 of
  the 8 on a worker): the fleet's caches hold every opening only when each
  worker keeps its own half. The target: TTFT
  p50 by prefix <= 0.7x least loaded. Each row gives the workers' own hit
  rate (``infergate_generation_prefix_cache_*`` from their ``/metrics``).
"""

from __future__ import annotations

import re
import shutil
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from google.protobuf import text_format

from loadtest.config import BenchConfig, Protocol
from loadtest.generate import GenLevel, gen_requests, make_gen_client
from loadtest.stream_runner import run_stream_bench
from loadtest.streaming import StreamLevelResult
from loadtest.suite_context import SuiteContext, copy_model, grpc_address
from loadtest.suite_procs import ProcessGroup, Service, SuiteError
from loadtest.suite_report import Column, SectionResult

MODEL = "prefix_lm"
COLD = "prefix_lm_cold"
FLEET = "prefix_lm_fleet"
TINY, TINY_COLD = "tiny_lm", "tiny_lm_cold"
OPENING_TOKENS = 256
TAIL_TOKENS = 14  # with BOS and the opening, 271 tokens: whole blocks are the opening's only
OUTPUT_TOKENS = 8
OPENINGS = 8
STREAMS = 4
REQUESTS = {"cache": 40, "routing": 160}  # measured per row (a quarter with --quick)
FLEET_OPENINGS_CACHED = 4.5  # openings whose blocks a fleet worker holds beside FLEET_RUNNING running sequences
FLEET_RUNNING = STREAMS // 2  # a worker's share of the streams
MAX_SEQUENCES = 8


def _shape() -> Any:
    from models.decoder import DecoderShape

    return DecoderShape(d_model=256, heads=8, layers=4, d_ff=1024, max_positions=1024)


def _bytes_per_token() -> int:
    shape = _shape()
    return 2 * shape.layers * shape.d_model * 4  # every layer's key and value, float32


def fleet_cache_bytes() -> int:
    """A fleet worker's max_cache_bytes: FLEET_RUNNING sequences' reservations and FLEET_OPENINGS_CACHED openings
    (more sequences running there evict openings; fewer leave room for more)."""
    per_token = _bytes_per_token()
    sequence = 1 + OPENING_TOKENS + TAIL_TOKENS + OUTPUT_TOKENS
    return int((FLEET_RUNNING * sequence + FLEET_OPENINGS_CACHED * OPENING_TOKENS) * per_token)


def _config_text(name: str, shape: Any, parameters: dict[str, str]) -> str:
    from models.decoder import tiny_lm_config

    config = tiny_lm_config(name, shape)
    for key, value in parameters.items():
        config.parameters[key].string_value = value
    return text_format.MessageToString(config)


def write_repository(source: Path, root: Path) -> Path:
    """``prefix_lm`` (cache on), ``prefix_lm_cold`` (off), ``prefix_lm_fleet`` (a fleet worker's cache size),
    and ``tiny_lm`` with its cold twin."""
    from models.decoder import build_tiny_lm

    shape = _shape()
    graph = build_tiny_lm(shape, MODEL).SerializeToString()
    common = {"max_sequences": str(MAX_SEQUENCES)}
    models = {MODEL: common, COLD: {**common, "enable_prefix_caching": "false"},
              FLEET: {**common, "max_cache_bytes": str(fleet_cache_bytes())}}
    for name, parameters in models.items():
        (root / name / "1").mkdir(parents=True, exist_ok=True)
        (root / name / "1" / "model.onnx").write_bytes(graph)
        (root / name / "config.pbtxt").write_text(_config_text(name, shape, parameters))
    shutil.copytree(source / TINY, root / TINY, dirs_exist_ok=True)
    copy_model(source, root, TINY, TINY_COLD, {"enable_prefix_caching": "false"})
    return root


def level(url: str, model: str, streams: int, requests: int, openings: int, seed: int) -> StreamLevelResult:
    config = BenchConfig(model=model, url=url, protocol=Protocol.GRPC, generate=True, concurrency=(streams,),
                         request_count=requests, warmup_requests=max(streams, openings), prompt_tokens=TAIL_TOKENS,
                         output_tokens=OUTPUT_TOKENS, prefix_prompts=openings, prefix_tokens=OPENING_TOKENS,
                         timeout_ms=120_000, seed=seed)
    result = run_stream_bench(config, client_factory=make_gen_client, payloads=gen_requests(config, count=256))
    if not result.levels or result.levels[0].requests == 0:
        errors = result.levels[0].errors if result.levels else {}
        raise SuiteError(f"prefix bench of {model} at {url}: no request succeeded; errors {errors}")
    return result.levels[0]


def cache_counters(workers: Sequence[Service], model: str) -> tuple[float, float]:
    """(prompt tokens looked up, found) in ``model``'s prefix cache, summed over the workers' /metrics."""
    queried = found = 0.0
    for worker in workers:
        url = f"http://127.0.0.1:{worker.ready['metrics_port']}/metrics"
        with urllib.request.urlopen(url, timeout=10) as reply:
            text = reply.read().decode()
        for family, into in (("queries", 0), ("hits", 1)):
            match = re.search(rf'^infergate_generation_prefix_cache_{family}_total{{[^}}]*model="{model}"[^}}]*}} (\S+)$',
                              text, re.M)
            value = float(match.group(1)) if match else 0.0
            if into == 0:
                queried += value
            else:
                found += value
    return queried, found


def prefix_row(part: str, setup: str, lv: StreamLevelResult, base: StreamLevelResult | None,
         hit_rate: float | None) -> dict[str, Any]:  # fmt: skip
    g = GenLevel.of(lv)
    ratio = g.ttft_ms[0] / GenLevel.of(base).ttft_ms[0] if base is not None and GenLevel.of(base).ttft_ms[0] else None
    return {"part": part, "setup": setup, "streams": g.concurrency, "requests": g.requests,
            "ttft_p50": g.ttft_ms[0], "ttft_p99": g.ttft_ms[2], "itl_p50": g.itl_ms[0],
            "output_tokens_per_s": g.output_tokens_per_s, "hit_rate": hit_rate, "ttft_ratio": ratio,
            "errors": g.errors}


def run_prefix(ctx: SuiteContext) -> SectionResult:
    repo = write_repository(ctx.settings.model_repository, ctx.workdir / "prefix-repo")
    scale = 0.25 if ctx.settings.quick else 1.0
    counts = {part: max(STREAMS, round(n * scale)) for part, n in REQUESTS.items()}
    args = ["worker", "--model-repository", str(repo), "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
            "--log-level", "warning"]  # fmt: skip
    rows: list[dict[str, Any]] = []
    levels: dict[str, Any] = {}
    with ProcessGroup(ctx.workdir) as procs:
        workers = procs.start_many([(f"prefix-worker-{i}", args) for i in range(5)])
        straight = grpc_address(workers[0])
        for warm, cold, label in ((MODEL, COLD, MODEL), (TINY, TINY_COLD, TINY)):
            ctx.progress(f"prefix: {label} cached vs cold, straight to one worker")
            before = cache_counters(workers[:1], warm)
            cold_level = level(straight, cold, 1, counts["cache"], 1, seed=1)
            warm_level = level(straight, warm, 1, counts["cache"], 1, seed=1)
            after = cache_counters(workers[:1], warm)
            hit = (after[1] - before[1]) / (after[0] - before[0]) if after[0] > before[0] else None
            rows.append(prefix_row("cache", f"{label}, caching off", cold_level, None, None))
            rows.append(prefix_row("cache", f"{label}, caching on (opening served before)", warm_level, cold_level, hit))
            levels[f"cache {label} cold"], levels[f"cache {label} warm"] = asdict(cold_level), asdict(warm_level)
        pairs = {"by prefix": (workers[1:3], {}), "least loaded": (workers[3:5], {"prefix_routing": False})}
        bounds = {"max_inflight_per_replica": MAX_SEQUENCES, "busy_inflight_per_replica": MAX_SEQUENCES}
        gateways = {setup: ctx.start_gateway(procs, [grpc_address(w) for w in pair],
                                             {**extra, "models": {FLEET: dict(bounds)}}, [FLEET])
                    for setup, (pair, extra) in pairs.items()}
        measured: dict[str, tuple[StreamLevelResult, float | None]] = {}
        for setup, gateway in gateways.items():
            ctx.progress(f"prefix: {OPENINGS} openings over 2 workers, {setup}")
            pair = pairs[setup][0]
            before = cache_counters(pair, FLEET)
            lv = level(f"127.0.0.1:{gateway.ready['grpc_port']}", FLEET, STREAMS, counts["routing"], OPENINGS, seed=2)
            after = cache_counters(pair, FLEET)
            measured[setup] = (lv, (after[1] - before[1]) / (after[0] - before[0]) if after[0] > before[0] else None)
            levels[f"routing {setup}"] = asdict(lv)
        least = measured["least loaded"][0]
        rows.append(prefix_row("routing", "2 workers, least loaded", least, None, measured["least loaded"][1]))
        rows.append(prefix_row("routing", "2 workers, by prefix", measured["by prefix"][0], least, measured["by prefix"][1]))
    notes = (
        f"{MODEL}: the example decoder's graph at d_model 256, 4 layers, 8 heads (random weights, byte vocabulary); "
        f"prompts = one shared opening of {OPENING_TOKENS} bytes + {TAIL_TOKENS} of their own (+ BOS); greedy, "
        f"{OUTPUT_TOKENS} tokens each (ignore_eos); gRPC streams; warmup = one request per opening or stream",
        "cache rows: one worker straight, one stream, one opening; 'caching off' is the same model with "
        "enable_prefix_caching false; TTFT ratio = its p50 over the caching-off row's",
        f"routing rows: {OPENINGS} openings chosen at random (seeded), {STREAMS} streams, each gateway with its own 2 "
        f"workers; a worker's max_cache_bytes ({fleet_cache_bytes() / 2**20:.1f} MiB) holds {FLEET_RUNNING} running "
        f"sequences (its share of the streams) and {FLEET_OPENINGS_CACHED:g} openings' blocks; TTFT ratio = by prefix over least loaded",
        "hit rate: the workers' prompt tokens found cached over those looked up during the row "
        "(infergate_generation_prefix_cache_hits / _queries)",
    )
    return SectionResult(
        key="prefix",
        title="Prefix cache: cached vs cold prompts, and routing by prefix vs least loaded",
        columns=(
            Column("part", "part"), Column("setup", "setup"), Column("streams", "streams"),
            Column("ttft_p50", "TTFT p50 ms", ".2f"), Column("ttft_p99", "TTFT p99 ms", ".2f"),
            Column("ttft_ratio", "TTFT p50 ratio", ".2f"), Column("hit_rate", "hit rate", ".2f"),
            Column("itl_p50", "ITL p50 ms", ".2f"), Column("output_tokens_per_s", "output tokens/s", ",.0f"),
            Column("errors", "errors"),
        ),
        rows=tuple(rows),
        notes=notes,
        details={"levels": levels, "requests": counts},
    )
