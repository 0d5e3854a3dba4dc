"""``infergate bench --generate`` against a real worker serving ``tiny_lm``
and a gateway in front of it: every request yields exactly the tokens it
asked for (``ignore_eos``) over gRPC streams, SSE and the OpenAI API, and
the command line prints genai-perf's numbers and writes them as JSON; the
suite's generation section runs end to end (quick)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest.config import BenchConfig
from loadtest.generate import GenLevel, gen_requests, make_gen_client
from loadtest.stream_runner import run_stream_bench
from loadtest.suite_procs import wait_for_cluster
from tests.harness import ROOT, Proc, start, start_worker, worker_url

pytestmark = pytest.mark.timeout(60)

REQUESTS = 8
TOKENS = 6


@pytest.fixture(scope="module")
def gateway(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    repo = tmp_path_factory.mktemp("bench-generate")
    shutil.copytree(model_repo / "tiny_lm", repo / "tiny_lm")
    worker = start_worker(repo)
    try:
        proc = start(["gateway", "--worker", worker_url(worker), "--http-port", "0", "--grpc-port", "0",
                      "--log-level", "WARNING"])
        try:
            wait_for_cluster(proc.ready["http_port"], 1, ["tiny_lm"])
            yield proc
        finally:
            proc.stop()
    finally:
        worker.stop()


@pytest.mark.parametrize("protocol", ["grpc", "http", "openai"])
def test_every_request_yields_the_tokens_it_asked_for(gateway: Proc, protocol: str) -> None:
    port = gateway.ready["grpc_port" if protocol == "grpc" else "http_port"]
    config = BenchConfig(model="tiny_lm", url=f"127.0.0.1:{port}", protocol=protocol, generate=True,
                         concurrency=(1, 3), request_count=REQUESTS, prompt_tokens=12, output_tokens=TOKENS)
    result = run_stream_bench(config, client_factory=make_gen_client, payloads=gen_requests(config))
    assert [lv.level for lv in result.levels] == [1, 3]
    for level in result.levels:
        g = GenLevel.of(level)
        assert (g.requests, g.output_tokens, g.errors) == (REQUESTS, REQUESTS * TOKENS, 0), level.errors
        assert 0 < g.ttft_ms[0] <= g.ttft_ms[2] and g.itl_ms[0] >= 0
        assert g.output_tokens_per_s > g.requests_per_s > 0


def test_the_command_line_reports_and_writes_json(gateway: Proc, tmp_path: Path) -> None:
    out = tmp_path / "gen.json"
    cmd = [sys.executable, "-m", "infergate", "bench", "-m", "tiny_lm", "--generate", "-i", "grpc",
           "-u", f"127.0.0.1:{gateway.ready['grpc_port']}", "--concurrency-range", "2", "--prompt-tokens", "8",
           "--output-tokens", str(TOKENS), "--request-count", str(REQUESTS), "--json", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr
    assert "TTFT p50" in done.stdout and "ITL p50" in done.stdout
    (level,) = json.loads(out.read_text())["levels"]
    assert level["concurrency"] == 2 and level["output_tokens"] == REQUESTS * TOKENS
    assert level["time_to_first_token_ms"]["p50"] > 0


def test_suite_generation_section(model_repo: Path, tmp_path: Path) -> None:
    from loadtest.suite_context import SuiteContext, SuiteSettings
    from loadtest.suite_generate import run_generation

    section = run_generation(SuiteContext(SuiteSettings.for_run(model_repo, quick=True), tmp_path))
    rows = {(r["setup"], r["streams"]): r for r in section.rows}
    setups = ("1 worker, continuous batching", "1 worker, one at a time", "2 workers, continuous batching",
              "1 worker straight, continuous batching", "1 worker straight, one at a time")
    assert set(rows) == {(s, n) for s in setups for n in (1, 16)}
    assert all(r["errors"] == 0 and r["output_tokens_per_s"] > 0 and r["ttft_p50"] > 0 for r in rows.values())
    assert rows[("1 worker, one at a time", 16)]["vs_serial"] == 1.0
    assert rows[("1 worker straight, one at a time", 16)]["vs_serial"] == 1.0
