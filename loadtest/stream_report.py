"""Results of a streaming bench run: :class:`StreamBenchResult` and its table, CSV and JSON.

Columns per level (open streams): requests/s and responses/s, time to first
response and time between responses (p50/p90/p99), responses per request,
errors. Records and files keep microseconds; the table shows milliseconds.
The names follow perf_analyzer's decoupled-mode and LLM reports: time to
first response (TTFR) and inter-response time.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from loadtest.streaming import StreamLevelResult


@dataclass(frozen=True, slots=True)
class StreamBenchResult:
    model: str
    model_version: str
    protocol: str
    url: str
    levels: tuple[StreamLevelResult, ...] = ()
    interrupted: bool = False
    mode: str = "streaming"

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for level, source in zip(out["levels"], self.levels, strict=True):
            level["error_count"] = source.error_count
            level["responses_per_request"] = source.responses_per_request
        return out


def _ms(us: float) -> str:
    return "-" if math.isnan(us) else f"{us / 1000.0:.2f}"


def _num(value: float, digits: int = 1) -> str:
    return "-" if math.isnan(value) else f"{value:,.{digits}f}"


TABLE_HEAD = ("Streams", "Req/s", "Resp/s", "Resp/req",
              "TTFR p50 ms", "TTFR p90 ms", "TTFR p99 ms",
              "Between p50 ms", "Between p90 ms", "Between p99 ms", "Errors")  # fmt: skip


def format_stream_table(result: StreamBenchResult) -> str:
    rows = [list(TABLE_HEAD)]
    for lv in result.levels:
        first, between = lv.first_response, lv.between_responses
        rows.append([
            f"{lv.level}" + (" (stopped)" if lv.interrupted else "" if lv.stable else "*"),
            _num(lv.requests_per_s), _num(lv.responses_per_s), _num(lv.responses_per_request, 2),
            _ms(first.p50_us), _ms(first.p90_us), _ms(first.p99_us),
            _ms(between.p50_us), _ms(between.p90_us), _ms(between.p99_us),
            str(lv.error_count),
        ])  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(TABLE_HEAD))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    notes = ["TTFR: time to first response; Between: time between consecutive responses of one request"]
    if any(not lv.stable and not lv.interrupted and lv.windows > 1 for lv in result.levels):
        notes.append("* not stable within the stability percentage after the maximum number of windows")
    for lv in result.levels:
        if lv.errors:
            notes.append(f"errors at {lv.level} streams: " + ", ".join(f"{k}: {n}" for k, n in lv.errors.items()))
    return "\n".join(lines + notes)


STREAM_CSV_COLUMNS = (
    "mode", "level", "requests", "responses", "errors", "requests_per_s", "responses_per_s",
    "first_response_p50_us", "first_response_p90_us", "first_response_p99_us", "first_response_mean_us",
    "between_responses_p50_us", "between_responses_p90_us", "between_responses_p99_us",
    "between_responses_mean_us", "duration_s", "stable", "interrupted", "errors_by_kind",
)  # fmt: skip


def _cell(value: Any) -> Any:
    if isinstance(value, float):
        return "" if math.isnan(value) else round(value, 3)
    return value


def stream_to_csv(result: StreamBenchResult) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(STREAM_CSV_COLUMNS)
    for lv in result.levels:
        f, b = lv.first_response, lv.between_responses
        row = ["streaming", lv.level, lv.requests, lv.responses, lv.error_count, lv.requests_per_s, lv.responses_per_s,
               f.p50_us, f.p90_us, f.p99_us, f.mean_us, b.p50_us, b.p90_us, b.p99_us, b.mean_us,
               lv.duration_s, int(lv.stable), int(lv.interrupted),
               ";".join(f"{k}={n}" for k, n in lv.errors.items())]  # fmt: skip
        writer.writerow([_cell(v) for v in row])
    return buf.getvalue()


def stream_to_json(result: StreamBenchResult) -> bytes:
    def clean(value: Any) -> Any:  # NaN is not JSON: unknown values become null
        if isinstance(value, float) and math.isnan(value):
            return None
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(v) for v in value]
        return value

    return orjson.dumps(clean(result.to_dict()), option=orjson.OPT_INDENT_2)


def write_stream_outputs(result: StreamBenchResult, *, csv_path: str | None = None,
                         json_path: str | None = None) -> None:
    if csv_path:
        Path(csv_path).write_text(stream_to_csv(result))
    if json_path:
        Path(json_path).write_bytes(stream_to_json(result))
