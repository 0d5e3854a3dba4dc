"""Results of a bench run and their four forms: terminal table, CSV, JSON, plot.

:class:`BenchResult` is what ``run_bench`` returns: one :class:`LevelResult`
per load level (client-side throughput, latency percentiles, errors by kind,
the client's own CPU use per process) with the server's view of the same
span (:class:`ServerBreakdown`, from the statistics API: queue and compute
time per request and the average batch size the server formed). Latencies
are microseconds in the records, CSV and JSON; the table shows milliseconds.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from loadtest.clients import ServerStats
from loadtest.latency import LatencySummary, Window, summarize

# A client process busier than this is probably the bottleneck, not the server.
SATURATED_CPU = 0.9


def _per(ns: int, count: int) -> float:
    return ns / count / 1000.0 if count > 0 else math.nan


@dataclass(frozen=True, slots=True)
class ServerBreakdown:
    """The server's statistics delta over a level (per request: microseconds)."""

    requests: int  # successful requests
    failures: int
    inferences: int  # rows
    executions: int  # batches the model ran
    avg_batch: float
    queue_us: float
    compute_input_us: float
    compute_infer_us: float
    compute_output_us: float

    @classmethod
    def from_delta(cls, d: ServerStats) -> ServerBreakdown:
        return cls(
            requests=d.success_count,
            failures=d.fail_count,
            inferences=d.inference_count,
            executions=d.execution_count,
            avg_batch=d.inference_count / d.execution_count if d.execution_count > 0 else math.nan,
            queue_us=_per(d.queue_ns, d.queue_count),
            compute_input_us=_per(d.compute_input_ns, d.compute_input_count),
            compute_infer_us=_per(d.compute_infer_ns, d.compute_infer_count),
            compute_output_us=_per(d.compute_output_ns, d.compute_output_count),
        )

    @property
    def compute_us(self) -> float:
        parts = [v for v in (self.compute_input_us, self.compute_infer_us, self.compute_output_us) if not math.isnan(v)]
        return sum(parts) if parts else math.nan


@dataclass(frozen=True, slots=True)
class LevelResult:
    mode: str  # "concurrency" or "request_rate"
    level: float
    requests: int  # successful requests measured
    errors: dict[str, int]
    duration_s: float
    throughput_rps: float
    rows_per_s: float
    latency: LatencySummary
    stable: bool
    windows: int
    interrupted: bool = False
    client_cpu: tuple[float, ...] = ()  # CPU time / wall time, per client process
    max_send_lag_ms: float = math.nan  # open loop only
    server: ServerBreakdown | None = None

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    @property
    def client_saturated(self) -> bool:
        return any(c >= SATURATED_CPU for c in self.client_cpu)


def level_result(mode: str, level: float, window: Window, *, batch_size: int, stable: bool, windows: int,
                 interrupted: bool = False, client_cpu: Sequence[float] = (), open_loop: bool = False,
                 server: ServerStats | None = None) -> LevelResult:
    duration = window.duration_s
    rate = window.ok / duration if duration > 0 else math.nan
    return LevelResult(
        mode=mode,
        level=level,
        requests=window.ok,
        errors=dict(sorted(window.errors.items())),
        duration_s=duration,
        throughput_rps=rate,
        rows_per_s=rate * batch_size,
        latency=summarize(window.samples),
        stable=stable,
        windows=windows,
        interrupted=interrupted,
        client_cpu=tuple(client_cpu),
        max_send_lag_ms=window.max_send_lag_s * 1000.0 if open_loop else math.nan,
        server=ServerBreakdown.from_delta(server) if server is not None else None,
    )


@dataclass(frozen=True, slots=True)
class BenchResult:
    model: str
    model_version: str
    protocol: str
    url: str
    batch_size: int
    processes: int
    mode: str
    levels: tuple[LevelResult, ...] = ()
    interrupted: bool = False
    notes: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for level, source in zip(out["levels"], self.levels, strict=True):
            level["error_count"] = source.error_count
            level["client_saturated"] = source.client_saturated
        return out


# --- terminal table -----------------------------------------------------------


def _ms(us: float) -> str:
    return "-" if math.isnan(us) else f"{us / 1000.0:.2f}"


def _num(value: float, digits: int = 1) -> str:
    return "-" if math.isnan(value) else f"{value:,.{digits}f}"


def format_table(result: BenchResult) -> str:
    head = ["Concurrency" if result.mode == "concurrency" else "Rate (req/s)", "Req/s", "Rows/s",
            "p50 ms", "p90 ms", "p95 ms", "p99 ms", "max ms", "mean ms", "Errors",
            "Srv queue ms", "Srv compute ms", "Srv batch", "Client CPU"]
    rows = [head]
    for lv in result.levels:
        level = f"{lv.level:g}" + (" (stopped)" if lv.interrupted else "" if lv.stable else "*")
        lat = lv.latency
        srv = lv.server
        rows.append([
            level, _num(lv.throughput_rps), _num(lv.rows_per_s),
            _ms(lat.p50_us), _ms(lat.p90_us), _ms(lat.p95_us), _ms(lat.p99_us), _ms(lat.max_us), _ms(lat.mean_us),
            str(lv.error_count),
            _ms(srv.queue_us) if srv else "-", _ms(srv.compute_us) if srv else "-",
            _num(srv.avg_batch, 2) if srv else "-",
            " ".join(f"{c:.0%}" for c in lv.client_cpu) or "-",
        ])  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    notes = []
    if any(not lv.stable and not lv.interrupted and lv.windows > 1 for lv in result.levels):
        notes.append("* not stable within the stability percentage after the maximum number of windows")
    for lv in result.levels:
        if lv.errors:
            kinds = ", ".join(f"{kind}: {n}" for kind, n in lv.errors.items())
            notes.append(f"errors at {lv.level:g}: {kinds}")
        if lv.client_saturated:
            notes.append(f"client CPU at {lv.level:g} is near one full core per process: "
                         f"the client may be the bottleneck (try --processes)")
        if lv.mode == "request_rate" and lv.max_send_lag_ms > 100:
            notes.append(f"at {lv.level:g} req/s sends ran up to {lv.max_send_lag_ms:.0f} ms behind schedule "
                         f"(counted in latency)")
    notes.extend(result.notes)
    return "\n".join(lines + notes)


# --- files ----------------------------------------------------------------------

CSV_COLUMNS = (
    "mode", "level", "requests", "errors", "throughput_rps", "rows_per_s",
    "latency_mean_us", "latency_p50_us", "latency_p90_us", "latency_p95_us", "latency_p99_us", "latency_max_us",
    "duration_s", "stable", "interrupted", "client_cpu_max", "max_send_lag_ms",
    "server_requests", "server_inferences", "server_executions", "server_avg_batch", "server_queue_us",
    "server_compute_input_us", "server_compute_infer_us", "server_compute_output_us", "errors_by_kind",
)  # fmt: skip


def _csv_row(lv: LevelResult) -> list[Any]:
    lat, srv = lv.latency, lv.server
    server = ([srv.requests, srv.inferences, srv.executions, srv.avg_batch, srv.queue_us,
               srv.compute_input_us, srv.compute_infer_us, srv.compute_output_us] if srv else [""] * 8)
    return [
        lv.mode, f"{lv.level:g}", lv.requests, lv.error_count, lv.throughput_rps, lv.rows_per_s,
        lat.mean_us, lat.p50_us, lat.p90_us, lat.p95_us, lat.p99_us, lat.max_us,
        lv.duration_s, int(lv.stable), int(lv.interrupted), max(lv.client_cpu, default=math.nan), lv.max_send_lag_ms,
        *server, ";".join(f"{k}={n}" for k, n in lv.errors.items()),
    ]  # fmt: skip


def _csv_cell(value: Any) -> Any:
    if isinstance(value, float):
        return "" if math.isnan(value) else round(value, 3)
    return value


def to_csv(result: BenchResult) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for lv in result.levels:
        writer.writerow([_csv_cell(v) for v in _csv_row(lv)])
    return buf.getvalue()


def to_json(result: BenchResult) -> bytes:
    # NaN is not JSON: unknown values (no samples, no server stats) become null.
    def clean(value: Any) -> Any:
        if isinstance(value, float) and math.isnan(value):
            return None
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(v) for v in value]
        return value

    return orjson.dumps(clean(result.to_dict()), option=orjson.OPT_INDENT_2)


def write_plot(result: BenchResult, path: str | Path) -> None:
    """Latency percentiles against throughput, one point per level (PNG)."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed; must precede pyplot
    import matplotlib.pyplot as plt

    levels = [lv for lv in result.levels if lv.requests > 0]
    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    try:
        x = [lv.throughput_rps for lv in levels]
        for name, attr in (("p50", "p50_us"), ("p90", "p90_us"), ("p95", "p95_us"), ("p99", "p99_us")):
            ax.plot(x, [getattr(lv.latency, attr) / 1000.0 for lv in levels], marker="o", label=name)
        for lv in levels:
            ax.annotate(f"{lv.level:g}", (lv.throughput_rps, lv.latency.p99_us / 1000.0),
                        textcoords="offset points", xytext=(4, 4), fontsize=8)
        unit = "concurrency" if result.mode == "concurrency" else "req/s offered"
        ax.set_title(f"{result.model} over {result.protocol}, batch {result.batch_size} (labels: {unit})")
        ax.set_xlabel("throughput (requests/s)")
        ax.set_ylabel("latency (ms)")
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)


def write_outputs(result: BenchResult, *, csv_path: str | None = None, json_path: str | None = None,
                  plot_path: str | None = None) -> None:
    if csv_path:
        Path(csv_path).write_text(to_csv(result))
    if json_path:
        Path(json_path).write_bytes(to_json(result))
    if plot_path:
        write_plot(result, plot_path)
