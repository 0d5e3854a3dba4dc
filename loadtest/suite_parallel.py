"""The model-parallel section of ``make bench``: ``encoder`` unsplit vs TP2,
PP2 and a hybrid (2 replicas x TP2), with the time spent in collectives.

It runs ``bench/parallel_bench.py`` as its own process (that script drives the
gateway core in front of real workers; the harness imports no server code)
and turns its JSON rows into a table.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from loadtest.suite_context import SuiteContext
from loadtest.suite_report import Column, SectionResult

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "parallel_bench.py"
TIMEOUT_S = 300.0

COLUMNS = (
    Column("model", "model"),
    Column("p50_ms", "p50 ms (1 client)", ".2f"),
    Column("p99_ms", "p99 ms", ".2f"),
    Column("rows_per_s", "rows/s (64 clients)", ",.0f"),
    Column("mean_batch", "mean batch", ".1f"),
    Column("shard_calls_per_req", "shard calls/req", ".0f"),
    Column("collective_ms_per_req", "collective ms/req", ".2f"),
    Column("kib_moved_per_req", "KiB moved/req", ".0f"),
)


def run_parallel(ctx: SuiteContext) -> SectionResult:
    out = ctx.workdir / "parallel.json"
    ctx.progress("model parallelism: encoder unsplit, TP2, PP2, 2 x TP2 on 4 workers")
    subprocess.run(
        [sys.executable, str(SCRIPT), "--model-repository", str(ctx.settings.model_repository),
         "--workers", "4", "--json", str(out)],
        cwd=ROOT, check=True, timeout=TIMEOUT_S, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    rows = json.loads(out.read_text())
    table = tuple({"model": name, **{k: v for k, v in row.items() if isinstance(v, (int, float))}} for name, row in rows.items())
    return SectionResult(
        key="parallel",
        title="Model parallelism: encoder split across workers (single-row requests, 32 tokens, 4 CPU workers)",
        columns=COLUMNS,
        rows=table,
        notes=(
            "collective ms/req = plan time minus time waiting on workers, at batch 1 (the gateway sums or "
            "concatenates partial outputs); shard calls/req = worker round trips per request",
            "the example encoder is tiny, so on CPUs splitting adds round trips rather than saving time",
        ),
        details={"rows": rows},
    )
