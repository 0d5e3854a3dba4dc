"""The ``streaming`` section of the benchmark suite: decoupled models through the gateway.

``repeat_int32`` answers one request with one response per value, DELAY ms
apart: 32 values at 4 ms each. The section measures, with ``infergate bench
--streaming``, the time to first response and the time between responses
straight to a worker and through a gateway (gRPC ``ModelStreamInfer``, and
HTTP ``generate_stream`` where the gateway serves it) at 1 and 16 open
streams, and gives each gateway row as ratios to the direct row of the same
run. A gateway that forwards every response as it arrives keeps the time
between responses at the model's DELAY (ratio ~1.0); one that buffers
shows it as larger gaps and a later first response.

The gateway's own forwarding gap (a worker's response arriving -> written to
the client) is read from its ``/metrics`` when it exposes a histogram of it
(a metric family whose name holds ``forward``); the notes say so when not.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
import re
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from loadtest.config import BenchConfig, BenchError, Protocol
from loadtest.stream_runner import run_stream_bench
from loadtest.streaming import StreamLevelResult
from loadtest.suite_context import SuiteContext, grpc_address
from loadtest.suite_procs import ProcessGroup, SuiteError
from loadtest.suite_report import Column, SectionResult

STREAM_MODEL = "repeat_int32"
STREAM_VALUES = 32
STREAM_DELAY_MS = 4
STREAM_LEVELS = (1, 16)
REQUESTS_PER_STREAM = 12  # per level: 12 requests of 32 x 4 ms per stream, about 1.5 s


def write_repeat_data(path: Path, values: int = STREAM_VALUES, delay_ms: int = STREAM_DELAY_MS) -> str:
    """A perf_analyzer data file of one repeat_int32 request: IN 0..values-1, DELAY ms each, WAIT 0."""
    entry = {"IN": {"content": list(range(values)), "shape": [values]},
             "DELAY": {"content": [delay_ms] * values, "shape": [values]},
             "WAIT": {"content": [0], "shape": [1]}}  # fmt: skip
    path.write_text(json.dumps({"data": [entry]}))
    return str(path)


def stream_level(url: str, protocol: str, streams: int, data: str, requests_per_stream: int) -> StreamLevelResult:
    config = BenchConfig(model=STREAM_MODEL, url=url, protocol=Protocol(protocol), streaming=True,
                         concurrency=(streams,), request_count=requests_per_stream * streams,
                         warmup_requests=streams, input_data=data, timeout_ms=60_000)  # fmt: skip
    result = run_stream_bench(config)
    if not result.levels or result.levels[0].requests == 0:
        errors = result.levels[0].errors if result.levels else {}
        raise SuiteError(f"streaming bench of {STREAM_MODEL} at {url} ({protocol}): no request succeeded; {errors}")
    return result.levels[0]


# --- the gateway's forwarding-gap histogram ----------------------------------------------

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LE = re.compile(r'le="([^"]+)"')


def forward_histogram(metrics_text: str) -> dict[str, Any] | None:
    """The first histogram whose name holds ``forward``: its name, count, mean and bucket-bound percentiles (s).

    Buckets of every label set are summed. Percentiles are the upper bound of
    the bucket the rank falls in (what a Prometheus histogram can say).
    """
    buckets: dict[str, dict[float, float]] = {}
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for line in metrics_text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or "forward" not in match.group(1):
            continue
        name, labels, value = match.group(1), match.group(2) or "", float(match.group(3))
        if name.endswith("_bucket"):
            le = _LE.search(labels)
            if le is not None:
                family = buckets.setdefault(name[: -len("_bucket")], {})
                bound = math.inf if le.group(1) == "+Inf" else float(le.group(1))
                family[bound] = family.get(bound, 0.0) + value
        elif name.endswith("_sum"):
            sums[name[:-4]] = sums.get(name[:-4], 0.0) + value
        elif name.endswith("_count"):
            counts[name[:-6]] = counts.get(name[:-6], 0.0) + value
    # The gateway's own name first, should another family mention forwarding too.
    for family, by_bound in sorted(buckets.items(), key=lambda item: ("stream_forward" not in item[0], item[0])):
        total = counts.get(family, max(by_bound.values(), default=0.0))
        out: dict[str, Any] = {"metric": family, "count": int(total),
                               "mean_s": sums.get(family, math.nan) / total if total else math.nan}
        bounds = sorted(by_bound)
        for pct in (50, 90, 99):
            rank = pct / 100.0 * total
            out[f"p{pct}_le_s"] = next((b for b in bounds if by_bound[b] >= rank), math.inf) if total else math.nan
        out["buckets"] = {("+Inf" if math.isinf(b) else f"{b:g}"): by_bound[b] for b in bounds}
        return out
    return None


def read_metrics(http_port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=5) as reply:
            return reply.read().decode(errors="replace")
    except (urllib.error.URLError, OSError):
        return None


# --- the section ------------------------------------------------------------------------


def _ratio(value: float, base: float) -> float:
    return value / base if base > 0 and not math.isnan(value) and not math.isnan(base) else math.nan


def stream_rows(measured: Mapping[tuple[str, int], StreamLevelResult]) -> list[dict[str, Any]]:
    """One row per (path, streams); gateway rows carry ratios to the direct row of the same streams."""
    rows = []
    for (path, streams), lv in measured.items():
        direct = measured.get(("direct", streams))
        row: dict[str, Any] = {
            "path": path, "streams": streams, "responses_per_s": lv.responses_per_s,
            "ttfr_p50": lv.first_response.p50_us / 1000, "ttfr_p99": lv.first_response.p99_us / 1000,
            "between_p50": lv.between_responses.p50_us / 1000, "between_p99": lv.between_responses.p99_us / 1000,
            "errors": lv.error_count,
        }
        if direct is not None and path != "direct":
            row["between_p50_ratio"] = _ratio(lv.between_responses.p50_us, direct.between_responses.p50_us)
            row["between_p99_ratio"] = _ratio(lv.between_responses.p99_us, direct.between_responses.p99_us)
            row["ttfr_p50_ratio"] = _ratio(lv.first_response.p50_us, direct.first_response.p50_us)
        rows.append(row)
    return rows


def run_streaming(ctx: SuiteContext) -> SectionResult:
    data = write_repeat_data(ctx.workdir / "repeat_int32.json")
    per_stream = 4 if ctx.settings.quick else REQUESTS_PER_STREAM
    measured: dict[tuple[str, int], StreamLevelResult] = {}
    notes: list[str] = []
    histogram: dict[str, Any] | None = None
    with ProcessGroup(ctx.workdir) as procs:
        worker = grpc_address(ctx.start_workers(procs, 1)[0])
        gateway = ctx.start_gateway(procs, [worker], {}, [STREAM_MODEL])
        http_port = gateway.ready["http_port"]
        paths = {"direct": (worker, "grpc"), "gateway grpc": (f"127.0.0.1:{gateway.ready['grpc_port']}", "grpc"),
                 "gateway http (SSE)": (f"127.0.0.1:{http_port}", "http")}  # fmt: skip
        for streams in STREAM_LEVELS:
            for path, (url, protocol) in paths.items():
                ctx.progress(f"streaming: {STREAM_MODEL}, {streams} stream(s), {path}")
                try:
                    measured[(path, streams)] = stream_level(url, protocol, streams, data, per_stream)
                except (SuiteError, BenchError) as exc:
                    if path == "direct" or path == "gateway grpc":
                        raise
                    notes.append(f"{path} at {streams} stream(s) not measured: {exc}")
        metrics = read_metrics(http_port)
        histogram = forward_histogram(metrics) if metrics is not None else None
    if histogram is None:
        notes.append("the gateway's /metrics has no forwarding-gap histogram (no metric family named *forward*)")
    else:
        notes.append(
            f"gateway forwarding gap (worker response arrived -> written to the client), `{histogram['metric']}` "
            f"over every run above: {histogram['count']} responses, mean {histogram['mean_s'] * 1e6:.0f} us, "
            f"p50 <= {histogram['p50_le_s'] * 1e6:g} us, p90 <= {histogram['p90_le_s'] * 1e6:g} us, "
            f"p99 <= {histogram['p99_le_s'] * 1e6:g} us (bucket bounds)")
    notes.append(f"{STREAM_MODEL}: {STREAM_VALUES} values, DELAY {STREAM_DELAY_MS} ms per response, "
                 f"{per_stream} requests per stream after one warmup request per stream; direct = gRPC "
                 "ModelStreamInfer straight to the worker; ratios = gateway / direct at the same number of streams")
    return SectionResult(
        key="streaming",
        title=f"Streaming through the gateway ({STREAM_MODEL}, {STREAM_VALUES} responses of {STREAM_DELAY_MS} ms)",
        columns=(
            Column("path", "path"), Column("streams", "streams"),
            Column("responses_per_s", "responses/s", ",.0f"),
            Column("ttfr_p50", "TTFR p50 ms", ".2f"), Column("ttfr_p99", "TTFR p99 ms", ".2f"),
            Column("between_p50", "between p50 ms", ".2f"), Column("between_p99", "between p99 ms", ".2f"),
            Column("between_p50_ratio", "between p50 / direct", ".2f"),
            Column("between_p99_ratio", "between p99 / direct", ".2f"),
            Column("ttfr_p50_ratio", "TTFR p50 / direct", ".2f"),
            Column("errors", "errors"),
        ),
        rows=tuple(stream_rows(measured)),
        notes=tuple(notes),
        details={"forward_histogram": histogram,
                 "levels": {f"{p} x{s}": asdict(lv) for (p, s), lv in measured.items()}},
    )
