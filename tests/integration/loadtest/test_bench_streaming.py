"""``infergate bench --streaming`` against real servers: square_int32 (n
responses for IN = n) straight to a worker over gRPC ModelStreamInfer, and
through a gateway over gRPC and HTTP generate_stream.

Every run uses ``--request-count`` and a data file of several n, so the
number of responses owed is known exactly: the sum of n over the requests
sent (requests take the data entries in turn).
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest.config import BenchConfig
from loadtest.stream_report import STREAM_CSV_COLUMNS, TABLE_HEAD
from loadtest.stream_runner import run_stream_bench
from loadtest.suite_procs import wait_for_cluster
from tests.harness import ROOT, Proc, start, start_worker, worker_url

pytestmark = pytest.mark.timeout(120)

SQUARES = [3, 0, 2, 5, 1]  # n per request, in turn
REQUESTS = 20


def owed(requests: int) -> int:
    """Data responses owed to ``requests`` requests taking SQUARES in turn."""
    return sum(SQUARES[i % len(SQUARES)] for i in range(requests))


@pytest.fixture(scope="module")
def data_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("stream") / "square.json"
    path.write_text(json.dumps({"data": [{"IN": [n]} for n in SQUARES]}))
    return path


@pytest.fixture(scope="module")
def worker(model_repo: Path) -> Iterator[Proc]:
    proc = start_worker(model_repo)
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def gateway(worker: Proc) -> Iterator[Proc]:
    proc = start(["gateway", "--worker", worker_url(worker), "--http-port", "0", "--grpc-port", "0",
                  "--log-level", "WARNING"])
    try:
        wait_for_cluster(proc.ready["http_port"], 1, ["square_int32"])
        yield proc
    finally:
        proc.stop()


def test_cli_streams_to_a_worker(worker: Proc, data_file: Path, tmp_path: Path) -> None:
    out_json, out_csv = tmp_path / "r.json", tmp_path / "r.csv"
    cmd = [sys.executable, "-m", "infergate", "bench", "-m", "square_int32", "-i", "grpc", "-u", worker_url(worker),
           "--streaming", "--concurrency-range", "1:4:x2", "--request-count", str(REQUESTS), "--warmup", "3",
           "--input-data", str(data_file), "--json", str(out_json), "--csv", str(out_csv)]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr
    for column in TABLE_HEAD:
        assert column in done.stdout
    doc = json.loads(out_json.read_text())
    assert doc["mode"] == "streaming" and [lv["level"] for lv in doc["levels"]] == [1, 2, 4]
    for lv in doc["levels"]:
        assert (lv["requests"], lv["responses"], lv["error_count"]) == (REQUESTS, owed(REQUESTS), 0)
        # One first response per request with n > 0, n - 1 gaps per request.
        assert lv["first_response"]["count"] == sum(1 for i in range(REQUESTS) if SQUARES[i % len(SQUARES)])
        assert lv["between_responses"]["count"] == owed(REQUESTS) - lv["first_response"]["count"]
        assert 0 < lv["first_response"]["p50_us"] <= lv["first_response"]["p99_us"]
        assert lv["responses_per_s"] > lv["requests_per_s"] > 0
    rows = list(csv.DictReader(out_csv.open()))
    assert tuple(rows[0]) == STREAM_CSV_COLUMNS
    assert [int(r["responses"]) for r in rows] == [owed(REQUESTS)] * 3


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_api_streams_through_a_gateway(gateway: Proc, data_file: Path, protocol: str) -> None:
    port = gateway.ready["grpc_port" if protocol == "grpc" else "http_port"]
    result = run_stream_bench(BenchConfig(model="square_int32", url=f"127.0.0.1:{port}", protocol=protocol,
                                          streaming=True, concurrency=(1, 3), request_count=REQUESTS,
                                          input_data=str(data_file)))
    assert [lv.level for lv in result.levels] == [1, 3]
    for lv in result.levels:
        assert (lv.requests, lv.responses, lv.error_count) == (REQUESTS, owed(REQUESTS), 0), lv.errors
        assert lv.first_response.count > 0 and lv.between_responses.count > 0


def test_time_windows_on_a_worker(worker: Proc) -> None:
    # Random data is one payload, so every request owes the same n (here 2..4).
    result = run_stream_bench(BenchConfig(model="square_int32", url=worker_url(worker), protocol="grpc",
                                          streaming=True, concurrency=(2,), measurement_interval_ms=300,
                                          max_trials=4, stability_percentage=100.0, int_range=(2, 5)))
    (lv,) = result.levels
    assert lv.requests > 0 and lv.error_count == 0 and 1 <= lv.windows <= 3
    assert lv.responses % lv.requests == 0 and 2 <= lv.responses // lv.requests <= 4


def test_suite_streaming_section(model_repo: Path, tmp_path: Path) -> None:
    from loadtest.suite_context import SuiteContext, SuiteSettings
    from loadtest.suite_streaming import run_streaming

    section = run_streaming(SuiteContext(SuiteSettings.for_run(model_repo, quick=True), tmp_path))
    rows = {(r["path"], r["streams"]): r for r in section.rows}
    assert set(rows) == {(p, s) for p in ("direct", "gateway grpc", "gateway http (SSE)") for s in (1, 16)}
    assert all(r["errors"] == 0 and r["between_p50"] > 0 for r in rows.values())
    assert rows[("gateway grpc", 16)]["between_p50_ratio"] > 0
    # The gateway measures its forwarding gap on the gRPC frontend.
    assert rows[("gateway grpc", 1)]["forward_p50_le"] > 0
