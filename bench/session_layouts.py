"""How a worker's ONNX Runtime sessions use the CPU, compared in one run:
``infergate bench`` (closed loop, gRPC, single-row requests) straight at one
``infergate worker`` per layout, at a few concurrency levels, on a light model
(``mlp``) and compute-bound ones (``cnn``, ``encoder``; ``cnn_large`` with
``--large``).

Layouts (``--backend-option cpu_sessions=...`` and the thread flags):

* ``per_instance``: one session per instance, cores/4 (at least 1) intra-op
  threads each, one instance per execution thread (the default before this
  comparison);
* ``shared``: one session per model version using every core, and as many
  concurrent ``Run`` calls on it as cores (ONNX Runtime's ``Run`` is
  thread-safe; the calls share the session's pool);
* ``adaptive``: ``per_instance``'s sessions, plus one per model version
  using every core that a run takes when no other runs;
* ``one_wide``: one session using every core, one call at a time.

Every worker is started before the first level and the layouts take turns
at each level, in a rotated order each round (``--rounds``), so drift in the
machine's load hits all of them alike; each figure is the median of its
rounds. Read the numbers as ratios within one run.

Run: ``python bench/session_layouts.py [--concurrency 1 64] [--large] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from models.build import BENCH_MODELS, build_repository
from tests.harness import Proc, start_worker, worker_url

CORES = os.cpu_count() or 1
LAYOUTS: dict[str, list[str]] = {
    "per_instance": ["--backend-option", "cpu_sessions=per_instance"],
    "shared": ["--backend-option", "cpu_sessions=shared"],
    "adaptive": ["--backend-option", "cpu_sessions=adaptive"],
    "one_wide": ["--backend-option", "cpu_sessions=per_instance", "--intra-op-threads", str(CORES),
                 "--execution-threads", "1"],
}
# Extra `infergate bench` flags per model (input shapes of variable dims).
MODEL_FLAGS: dict[str, list[str]] = {"encoder": ["--shape", "TOKENS:32", "--int-range", "0:1000"]}


def bench(url: str, model: str, concurrency: int, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    cmd = [
        sys.executable, "-m", "infergate", "bench", "-m", model, "-u", url, "-i", "grpc",
        "--concurrency-range", f"{concurrency}:{concurrency}:1", *MODEL_FLAGS.get(model, []),
        "-p", str(args.measurement_ms), "-r", str(args.max_trials), "-s", str(args.stability),
        "--warmup", args.warmup, "--json", str(out),
    ]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    [level] = json.loads(out.read_text())["levels"]
    return {"rps": level["throughput_rps"], "p50_ms": level["latency"]["p50_us"] / 1000.0,
            "p99_ms": level["latency"]["p99_us"] / 1000.0, "errors": level["error_count"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn", "encoder"])
    parser.add_argument("--large", action="store_true", help="also cnn_large")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--measurement-ms", type=int, default=2000)
    parser.add_argument("--max-trials", type=int, default=3)
    parser.add_argument("--stability", type=float, default=25.0)
    parser.add_argument("--warmup", default="1s")
    parser.add_argument("--rounds", type=int, default=3, help="turns of every layout at each level (medians)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    models = args.models + (["cnn_large"] if args.large else [])

    workdir = Path(tempfile.mkdtemp(prefix="infergate-session-layouts-"))
    procs: dict[str, Proc] = {}
    results: dict[str, dict[str, dict[int, dict[str, Any]]]] = {m: {name: {} for name in args.layouts} for m in models}
    load_before = os.getloadavg()
    try:
        repo = workdir / "models"
        build_repository(repo, ensembles=())
        if args.large:
            build_repository(repo, BENCH_MODELS, ensembles=())
        loads = [a for m in models for a in ("--load-model", m)]
        for name in args.layouts:
            procs[name] = start_worker(repo, "--model-control-mode", "explicit", *loads, "--log-level", "warning",
                                       *LAYOUTS[name])
        for model in models:
            for concurrency in args.concurrency:
                runs: dict[str, list[dict[str, Any]]] = {name: [] for name in args.layouts}
                for turn in range(args.rounds):
                    order = args.layouts[turn % len(args.layouts):] + args.layouts[:turn % len(args.layouts)]
                    for name in order:
                        r = bench(worker_url(procs[name]), model, concurrency, args, workdir / "level.json")
                        runs[name].append(r)
                        print(f"{model:<10} {name:<13} c={concurrency:<3} {r['rps']:8.0f} req/s  "
                              f"p50 {r['p50_ms']:7.2f} ms  p99 {r['p99_ms']:7.2f} ms  errors {r['errors']}", flush=True)
                for name, rs in runs.items():
                    results[model][name][concurrency] = {
                        key: statistics.median(r[key] for r in rs) for key in ("rps", "p50_ms", "p99_ms", "errors")}
    finally:
        for proc in procs.values():
            proc.stop(check=False)
        shutil.rmtree(workdir, ignore_errors=True)
    load_after = os.getloadavg()

    print(f"\n{CORES} cores; load average before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    base = args.layouts[0]
    header = "| model | layout | " + " | ".join(f"c={c} req/s | c={c} p50 ms" for c in args.concurrency)
    print(header + f" | req/s vs {base} |")
    print("|" + "---|" * (3 + 2 * len(args.concurrency)))
    for model in models:
        for name in args.layouts:
            by = results[model][name]
            cells = " | ".join(f"{by[c]['rps']:.0f} | {by[c]['p50_ms']:.2f}" for c in args.concurrency)
            ratio = " / ".join(f"{by[c]['rps'] / results[model][base][c]['rps']:.2f}" for c in args.concurrency)
            print(f"| {model} | {name} | {cells} | {ratio} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"cores": CORES, "load": [load_before, load_after],
                                               "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
