"""The ``streaming`` section of the benchmark suite: decoupled models through the gateway.

``repeat_int32`` answers one request with one response per value, DELAY ms
apart: 32 values at 4 ms each (8 with ``--quick``). The section measures, with ``infergate bench
--streaming``, the time to first response and the time between responses
straight to a worker and through a gateway (gRPC ``ModelStreamInfer``, and
HTTP ``generate_stream`` where the gateway serves it) at 1 and 16 open
streams, and gives each gateway row as ratios to the direct row of the same
run. A gateway that forwards every response as it arrives keeps the time
between responses at the model's DELAY (ratio ~1.0); one that buffers
shows it as larger gaps and a later first response.

The gateway's own forwarding gap (a worker's response arriving -> written to
the client) is read from its ``/metrics`` when it exposes a histogram of it
(a metric family whose name holds ``forward``), snapshotted around each
gateway run so every row has its own; the notes say so when there is none.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
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
QUICK_VALUES = 8  # --quick checks the pipeline: shorter requests
STREAM_DELAY_MS = 4
STREAM_LEVELS = (1, 16)
# Requests measured per level: each takes 32 x 4 ms, and the model's two
# instances serve two streams at a time, so 16 streams queue (seen in the TTFR).
LEVEL_REQUESTS = {1: 16, 16: 96}


def write_repeat_data(path: Path, values: int = STREAM_VALUES, delay_ms: int = STREAM_DELAY_MS) -> str:
    """A perf_analyzer data file of one repeat_int32 request: IN 0..values-1, DELAY ms each, WAIT 0."""
    entry = {"IN": {"content": list(range(values)), "shape": [values]},
             "DELAY": {"content": [delay_ms] * values, "shape": [values]},
             "WAIT": {"content": [0], "shape": [1]}}  # fmt: skip
    path.write_text(json.dumps({"data": [entry]}))
    return str(path)


def stream_level(url: str, protocol: str, streams: int, data: str, requests: int) -> StreamLevelResult:
    config = BenchConfig(model=STREAM_MODEL, url=url, protocol=Protocol(protocol), streaming=True,
                         concurrency=(streams,), request_count=requests,
                         warmup_requests=streams, input_data=data, timeout_ms=60_000)  # fmt: skip
    result = run_stream_bench(config)
    if not result.levels or result.levels[0].requests == 0:
        errors = result.levels[0].errors if result.levels else {}
        raise SuiteError(f"streaming bench of {STREAM_MODEL} at {url} ({protocol}): no request succeeded; {errors}")
    return result.levels[0]


# --- the gateway's forwarding-gap histogram ----------------------------------------------

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LE = re.compile(r'le="([^"]+)"')


@dataclass(frozen=True, slots=True)
class ForwardHistogram:
    """A cumulative Prometheus histogram (every label set summed); two snapshots subtract."""

    metric: str
    buckets: tuple[tuple[float, float], ...]  # (upper bound in s, cumulative count), ascending
    sum_s: float
    count: float

    def __sub__(self, other: ForwardHistogram) -> ForwardHistogram:
        before = dict(other.buckets)
        return ForwardHistogram(self.metric, tuple((b, n - before.get(b, 0.0)) for b, n in self.buckets),
                                self.sum_s - other.sum_s, self.count - other.count)

    def summary(self) -> dict[str, Any]:
        """Count, mean and p50/p90/p99 as the upper bound of the bucket the rank falls in (seconds)."""
        total = self.count
        out: dict[str, Any] = {"metric": self.metric, "count": int(total),
                               "mean_s": self.sum_s / total if total else math.nan}
        for pct in (50, 90, 99):
            rank = pct / 100.0 * total
            out[f"p{pct}_le_s"] = next((b for b, n in self.buckets if n >= rank), math.inf) if total else math.nan
        out["buckets"] = {("+Inf" if math.isinf(b) else f"{b:g}"): n for b, n in self.buckets}
        return out


def parse_forward_histogram(metrics_text: str) -> ForwardHistogram | None:
    """The histogram whose name holds ``forward`` (the gateway's ``stream_forward`` first); None if absent."""
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
    if not buckets:
        return None
    family = min(buckets, key=lambda name: ("stream_forward" not in name, name))
    by_bound = buckets[family]
    return ForwardHistogram(family, tuple(sorted(by_bound.items())), sums.get(family, math.nan),
                            counts.get(family, max(by_bound.values(), default=0.0)))


def forward_histogram(metrics_text: str) -> dict[str, Any] | None:
    """The summary of the forwarding-gap histogram in a /metrics text (None when it has none)."""
    histogram = parse_forward_histogram(metrics_text)
    return histogram.summary() if histogram is not None else None


def read_forward(http_port: int) -> ForwardHistogram | None:
    text = read_metrics(http_port)
    return parse_forward_histogram(text) if text is not None else None


def read_metrics(http_port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=5) as reply:
            return reply.read().decode(errors="replace")
    except (urllib.error.URLError, OSError):
        return None


# --- the section ------------------------------------------------------------------------


def _ratio(value: float, base: float) -> float:
    return value / base if base > 0 and not math.isnan(value) and not math.isnan(base) else math.nan


def stream_rows(measured: Mapping[tuple[str, int], StreamLevelResult],
                forward: Mapping[tuple[str, int], Mapping[str, Any]] | None = None) -> list[dict[str, Any]]:
    """One row per (path, streams); gateway rows carry ratios to the direct row of the same streams,
    and the forwarding gap the gateway measured over that run when ``forward`` has it."""
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
        gap = (forward or {}).get((path, streams))
        if gap is not None and gap["count"] > 0:
            row["forward_p50_le"] = gap["p50_le_s"] * 1e6
            row["forward_p99_le"] = gap["p99_le_s"] * 1e6
        rows.append(row)
    return rows


def run_streaming(ctx: SuiteContext) -> SectionResult:
    values = QUICK_VALUES if ctx.settings.quick else STREAM_VALUES
    data = write_repeat_data(ctx.workdir / "repeat_int32.json", values)
    scale = 0.25 if ctx.settings.quick else 1.0
    measured: dict[tuple[str, int], StreamLevelResult] = {}
    forward: dict[tuple[str, int], dict[str, Any]] = {}
    notes: list[str] = []
    with ProcessGroup(ctx.workdir) as procs:
        worker = grpc_address(ctx.start_workers(procs, 1)[0])
        gateway = ctx.start_gateway(procs, [worker], {}, [STREAM_MODEL])
        http_port = gateway.ready["http_port"]
        paths = {"direct": (worker, "grpc"), "gateway grpc": (f"127.0.0.1:{gateway.ready['grpc_port']}", "grpc"),
                 "gateway http (SSE)": (f"127.0.0.1:{http_port}", "http")}  # fmt: skip
        has_histogram = read_forward(http_port) is not None
        for streams in STREAM_LEVELS:
            for path, (url, protocol) in paths.items():
                ctx.progress(f"streaming: {STREAM_MODEL}, {streams} stream(s), {path}")
                before = read_forward(http_port) if path != "direct" else None
                try:
                    requests = max(streams, round(LEVEL_REQUESTS[streams] * scale))
                    measured[(path, streams)] = stream_level(url, protocol, streams, data, requests)
                except (SuiteError, BenchError) as exc:
                    if path == "direct" or path == "gateway grpc":
                        raise
                    notes.append(f"{path} at {streams} stream(s) not measured: {exc}")
                    continue
                after = read_forward(http_port) if before is not None else None
                if before is not None and after is not None:
                    forward[(path, streams)] = (after - before).summary()  # warmup requests included
    if not has_histogram:
        notes.append("the gateway's /metrics has no forwarding-gap histogram (no metric family named *forward*)")
    else:
        metric = next(iter(forward.values()))["metric"] if forward else "the forwarding histogram"
        notes.append(f"forward gap = the gateway's `{metric}` over that run (a worker's response arriving -> "
                     "written to the client), as the upper bound of the bucket the percentile falls in")
        silent = sorted({p for (p, _), gap in forward.items() if gap["count"] == 0})
        if silent:
            notes.append(f"no forward gap for {', '.join(silent)}: that frontend does not report its writes")
    notes.append(f"{STREAM_MODEL}: {values} values, DELAY {STREAM_DELAY_MS} ms per response, "
                 f"{LEVEL_REQUESTS[1]} requests at 1 stream, {LEVEL_REQUESTS[16]} at 16"
                 f"{' (a quarter of that with --quick)' if ctx.settings.quick else ''}, after one warmup request "
                 "per stream; direct = gRPC ModelStreamInfer straight to the worker; ratios = gateway / direct "
                 "at the same number of streams, from one run")
    return SectionResult(
        key="streaming",
        title=f"Streaming through the gateway ({STREAM_MODEL}, {values} responses of {STREAM_DELAY_MS} ms)",
        columns=(
            Column("path", "path"), Column("streams", "streams"),
            Column("responses_per_s", "responses/s", ",.0f"),
            Column("ttfr_p50", "TTFR p50 ms", ".2f"), Column("ttfr_p99", "TTFR p99 ms", ".2f"),
            Column("between_p50", "between p50 ms", ".2f"), Column("between_p99", "between p99 ms", ".2f"),
            Column("between_p50_ratio", "between p50 / direct", ".2f"),
            Column("between_p99_ratio", "between p99 / direct", ".2f"),
            Column("ttfr_p50_ratio", "TTFR p50 / direct", ".2f"),
            Column("forward_p50_le", "forward gap p50 <= us", ",.0f"),
            Column("forward_p99_le", "forward gap p99 <= us", ",.0f"),
            Column("errors", "errors"),
        ),
        rows=tuple(stream_rows(measured, forward)),
        notes=tuple(notes),
        details={"forward_histograms": {f"{p} x{s}": gap for (p, s), gap in forward.items()},
                 "levels": {f"{p} x{s}": asdict(lv) for (p, s), lv in measured.items()}},
    )
