"""Result forms of the bench: table, CSV, JSON, plot."""

from __future__ import annotations

import csv
import io
import json
import math
from array import array
from pathlib import Path

import pytest

from loadtest.clients import ServerStats
from loadtest.latency import Window
from loadtest.report import CSV_COLUMNS, BenchResult, format_table, level_result, to_csv, to_json, write_outputs


def _result() -> BenchResult:
    fast = Window(array("d", [0.001 * (1 + i % 10) for i in range(1000)]), {}, duration_s=2.0)
    slow = Window(array("d", [0.010] * 500), {"timeout": 3, "UNAVAILABLE": 1}, duration_s=2.0, max_send_lag_s=0.25)
    server = ServerStats(inference_count=4000, execution_count=500, success_count=1000, queue_count=1000,
                         queue_ns=1000 * 200_000, compute_infer_count=1000, compute_infer_ns=1000 * 1_500_000)
    levels = (
        level_result("request_rate", 500.0, fast, batch_size=4, stable=True, windows=3, client_cpu=[0.2, 0.3],
                     open_loop=True, server=server),
        level_result("request_rate", 2000.0, slow, batch_size=4, stable=False, windows=3, client_cpu=[0.95],
                     open_loop=True),
        level_result("request_rate", 4000.0, Window(), batch_size=4, stable=False, windows=0, interrupted=True),
    )  # fmt: skip
    return BenchResult(model="mlp", model_version="", protocol="grpc", url="h:1", batch_size=4, processes=2,
                       mode="request_rate", levels=levels, interrupted=True)


def test_level_numbers() -> None:
    first = _result().levels[0]
    assert first.requests == 1000 and first.throughput_rps == 500.0 and first.rows_per_s == 2000.0
    assert first.latency.p50_us == 5000.0 and first.latency.max_us == 10000.0
    assert first.server is not None
    assert first.server.avg_batch == 8.0
    assert first.server.queue_us == 200.0 and first.server.compute_us == 1500.0
    assert math.isnan(first.server.compute_input_us)
    assert first.max_send_lag_ms == 0.0


def test_table_mentions_what_matters() -> None:
    table = format_table(_result())
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["Rate", "(req/s)", "Req/s"]
    assert "2000*" in table and "(stopped)" in table
    assert "errors at 2000: UNAVAILABLE: 1, timeout: 3" in table
    assert "client may be the bottleneck" in table
    assert "250 ms behind schedule" in table
    row = lines[2].split()
    assert row[0] == "500" and row[1] == "500.0" and row[2] == "2,000.0"
    assert row[3] == "5.00"  # p50 ms


def test_csv_parses_back() -> None:
    rows = list(csv.DictReader(io.StringIO(to_csv(_result()))))
    assert tuple(rows[0]) == CSV_COLUMNS and len(rows) == 3
    assert float(rows[0]["throughput_rps"]) == 500.0 and float(rows[0]["latency_p99_us"]) == 10000.0
    assert float(rows[0]["server_avg_batch"]) == 8.0 and rows[0]["stable"] == "1"
    assert rows[1]["errors"] == "4" and rows[1]["errors_by_kind"] == "UNAVAILABLE=1;timeout=3"
    assert rows[1]["server_requests"] == "" and float(rows[1]["client_cpu_max"]) == 0.95
    assert rows[2]["latency_p50_us"] == "" and rows[2]["interrupted"] == "1"


def test_json_parses_back_without_nan() -> None:
    doc = json.loads(to_json(_result()))
    assert doc["model"] == "mlp" and doc["interrupted"] is True and len(doc["levels"]) == 3
    first, second, third = doc["levels"]
    assert first["latency"]["p90_us"] == pytest.approx(9000.0) and first["server"]["avg_batch"] == 8.0
    assert first["client_cpu"] == [0.2, 0.3] and first["client_saturated"] is False
    assert second["errors"] == {"UNAVAILABLE": 1, "timeout": 3} and second["error_count"] == 4
    assert second["server"] is None and second["client_saturated"] is True
    assert third["latency"]["p50_us"] is None  # NaN is not JSON


def test_plot_is_a_png(tmp_path: Path) -> None:
    paths = {name: tmp_path / name for name in ("r.csv", "r.json", "r.png")}
    write_outputs(_result(), csv_path=str(paths["r.csv"]), json_path=str(paths["r.json"]),
                  plot_path=str(paths["r.png"]))
    assert paths["r.png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert paths["r.png"].stat().st_size > 5000
    assert paths["r.csv"].read_text().startswith("mode,level,")
    assert json.loads(paths["r.json"].read_text())["levels"][0]["level"] == 500.0
