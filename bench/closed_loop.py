"""What the closed-loop comparisons of servers share (``single_process.py``,
``session_layouts.py``, ``ceilings.py``): a benchmark repository, one
``infergate bench`` level (gRPC, single-row requests) read back from its JSON
report, rounds in which the contenders take turns in a rotated order, the
median of each figure over its rounds, and the machine's load average.

Every figure of a run is the median of its rounds and the contenders take
turns at each level, so drift in the machine's load hits all of them alike;
read the numbers as ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from models.build import BENCH_MODELS, EXAMPLE_MODELS, ExampleModel, build_repository  # noqa: E402

# Extra `infergate bench` flags per model (input shapes of variable dims).
MODEL_FLAGS: dict[str, list[str]] = {"encoder": ["--shape", "TOKENS:32", "--int-range", "0:1000"]}
# What one level reports; each figure is the median over the rounds.
FIGURES = ("rps", "p50_ms", "p99_ms", "errors", "avg_batch")


def add_level_arguments(parser: argparse.ArgumentParser, measurement_ms: int = 1500) -> None:
    """The ``infergate bench`` settings of one level, and the rounds."""
    parser.add_argument("--measurement-ms", type=int, default=measurement_ms)
    parser.add_argument("--max-trials", type=int, default=3)
    parser.add_argument("--stability", type=float, default=25.0)
    parser.add_argument("--warmup", default="1s")
    parser.add_argument("--rounds", type=int, default=3, help="turns of every contender at each level (medians)")
    parser.add_argument("--json", default=None, help="write the results here")


def build_bench_repository(repo: Path, names: Sequence[str], extra: Sequence[ExampleModel] = ()) -> None:
    """Only the models named (examples, bench models or ``extra``) and the stateful ones ``build_repository`` adds."""
    known = {m.name: m for m in (*EXAMPLE_MODELS, *BENCH_MODELS, *extra)}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown models {unknown}; known: {sorted(known)}")
    build_repository(repo, tuple(known[n] for n in dict.fromkeys(names)), ensembles=())


def bench(url: str, model: str, concurrency: int, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One ``infergate bench`` level at ``concurrency`` clients; the server's mean batch from its statistics."""
    cmd = [
        sys.executable, "-m", "infergate", "bench", "-m", model, "-u", url, "-i", "grpc",
        "--concurrency-range", f"{concurrency}:{concurrency}:1", *MODEL_FLAGS.get(model, []),
        "-p", str(args.measurement_ms), "-r", str(args.max_trials), "-s", str(args.stability),
        "--warmup", args.warmup, "--json", str(out),
    ]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return level_figures(json.loads(out.read_text()))


def level_figures(report: dict[str, Any]) -> dict[str, Any]:
    """The figures of the one level of an ``infergate bench --json`` report."""
    [level] = report["levels"]
    server = level.get("server") or {}
    avg_batch = server.get("avg_batch")
    return {"rps": level["throughput_rps"], "p50_ms": level["latency"]["p50_us"] / 1000.0,
            "p99_ms": level["latency"]["p99_us"] / 1000.0, "errors": level["error_count"],
            "avg_batch": math.nan if avg_batch is None else float(avg_batch)}


def rotated(names: Sequence[str], turn: int) -> list[str]:
    """``names`` starting at the turn's one: each contender goes first in its round."""
    k = turn % len(names) if names else 0
    return [*names[k:], *names[:k]]


def medians(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the rounds (NaN where no round had it)."""
    out: dict[str, Any] = {}
    for key in runs[0]:
        values = [r[key] for r in runs if not (isinstance(r[key], float) and math.isnan(r[key]))]
        out[key] = statistics.median(values) if values else math.nan
    return out


def run_rounds(contenders: dict[str, Callable[[], dict[str, Any]]], rounds: int, label: str) -> dict[str, dict[str, Any]]:
    """Every contender once a round, in a rotated order; the median of each figure by contender."""
    names = list(contenders)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for turn in range(rounds):
        for name in rotated(names, turn):
            r = contenders[name]()
            runs[name].append(r)
            print(f"{label:<22} {name:<28} {r['rps']:8.0f} /s  p50 {r['p50_ms']:7.2f} ms  "
                  f"p99 {r['p99_ms']:7.2f} ms  batch {r['avg_batch']:5.2f}  errors {r['errors']}", flush=True)
    return {name: medians(rs) for name, rs in runs.items()}


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def write_json(path: str | None, doc: dict[str, Any]) -> None:
    """NaN (no figure) written as null, as JSON has it."""
    if path:
        def clean(value: Any) -> Any:
            if isinstance(value, float) and math.isnan(value):
                return None
            if isinstance(value, dict):
                return {str(k): clean(v) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return [clean(v) for v in value]
            return value

        Path(path).write_text(json.dumps(clean(doc), indent=2))
