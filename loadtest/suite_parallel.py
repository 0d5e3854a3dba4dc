"""The model-parallel sections of ``make bench``.

``parallel``: ``encoder`` unsplit vs TP2, PP2 and a hybrid (2 replicas x
TP2), each on peer collectives and on the gateway's star, with the calls
and bytes per request from the registry's counters.

``parallel_large``: ``encoder_large`` (128 tokens) unsplit on one worker vs
TP2, TP4 and PP2 -- latency at concurrency 1 and rows/s at 8 clients, with
the ratios the issue of record asks for (TP p50 over unsplit p50, PP rows/s
over unsplit rows/s). Needs a repository built with ``--large``.

Each runs ``bench/parallel_bench.py`` as its own process (that script drives
the gateway core in front of real workers of one intra-op thread each; the
harness imports no server code) and turns its JSON rows into a table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from loadtest.suite_context import SuiteContext
from loadtest.suite_report import Column, SectionResult

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "parallel_bench.py"
TIMEOUT_S = 900.0

COLUMNS = (
    Column("model", "model"),
    Column("p50_ms", "p50 ms (1 client)", ".2f"),
    Column("p99_ms", "p99 ms", ".2f"),
    Column("rows_per_s", "rows/s (64 clients)", ",.0f"),
    Column("mean_batch", "mean batch", ".1f"),
    Column("shard_calls_per_req", "gateway calls/req", ".0f"),
    Column("collective_ms_per_req", "gateway-side ms/req", ".2f"),
    Column("kib_moved_per_req", "KiB gateway<->workers/req", ".0f"),
    Column("peer_kib_per_req", "KiB worker<->worker/req", ".0f"),
)
LARGE_COLUMNS = (
    Column("model", "model"),
    Column("p50_ms", "p50 ms (1 client, 128 tokens)", ".1f"),
    Column("p50_ratio", "p50 / unsplit", ".2f"),
    Column("rows_per_s", "rows/s (8 clients)", ",.1f"),
    Column("throughput_ratio", "rows/s / unsplit", ".2f"),
    Column("shard_calls_per_req", "gateway calls/req", ".0f"),
    Column("peer_kib_per_req", "KiB worker<->worker/req", ".0f"),
)


def _bench(ctx: SuiteContext, repository: Path, out: Path, *extra: str) -> dict[str, dict[str, float]]:
    subprocess.run(
        [sys.executable, str(SCRIPT), "--model-repository", str(repository), "--workers", "4", "--json", str(out), *extra],
        cwd=ROOT, check=True, timeout=TIMEOUT_S, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    return json.loads(out.read_text())


def _numeric(name: str, row: dict[str, float]) -> dict[str, object]:
    return {"model": name, **{k: v for k, v in row.items() if isinstance(v, (int, float))}}


def run_parallel(ctx: SuiteContext) -> SectionResult:
    ctx.progress("model parallelism: encoder unsplit, TP2, PP2, 2 x TP2 (peer and star) on 4 workers")
    rows = _bench(ctx, ctx.settings.model_repository, ctx.workdir / "parallel.json")
    return SectionResult(
        key="parallel",
        title="Model parallelism: encoder split across workers (single-row requests, 32 tokens, 4 one-thread CPU workers)",
        columns=COLUMNS,
        rows=tuple(_numeric(name, row) for name, row in rows.items()),
        notes=(
            "*_star rows run the collectives through the gateway (collectives: gateway); the others on peer "
            "collectives (the default): one gateway call per rank, partial sums exchanged between workers",
            "gateway-side ms/req = plan time minus time waiting on workers, at batch 1",
            "the example encoder is tiny, so on CPUs splitting adds round trips rather than saving time",
        ),
        details={"rows": rows},
    )


def run_parallel_large(ctx: SuiteContext) -> SectionResult:
    repository = ctx.settings.large_repository
    title = "Model parallelism that pays: encoder_large (hidden 1024, 4 layers) unsplit on one worker vs split"
    if repository is None or not (repository / "encoder_large" / "1" / "model.onnx").is_file():
        return SectionResult(key="parallel_large", title=title, columns=LARGE_COLUMNS,
                             notes=("skipped: no repository with encoder_large (run `make bench`, or pass "
                                    "--large-repository DIR built by `infergate models build DIR --large`)",))
    ctx.progress("model parallelism: encoder_large unsplit vs TP2 (peers, star), TP4, PP2 on 4 workers")
    quick = ("--requests", "3", "--duration-s", "1") if ctx.settings.quick else ("--requests", "20", "--duration-s", "6")
    rows = _bench(ctx, repository, ctx.workdir / "parallel_large.json", "--large", "--seq", "128", "--clients", "8",
                  *quick)
    base = rows["encoder_large"]
    table = []
    for name, row in rows.items():
        entry = _numeric(name, row)
        entry["p50_ratio"] = row["p50_ms"] / base["p50_ms"]
        entry["throughput_ratio"] = row["rows_per_s"] / base["rows_per_s"] if base["rows_per_s"] else float("nan")
        table.append(entry)
    return SectionResult(
        key="parallel_large",
        title=title,
        columns=LARGE_COLUMNS,
        rows=tuple(table),
        notes=(
            "workers of one intra-op thread each, as one-device servers; the unsplit row runs on one of them",
            f"this machine has {os.cpu_count()} cores shared by the gateway and every worker: a split can only "
            "win while its ranks have a core each (TP4 needs 4)",
        ),
        details={"rows": rows},
    )
