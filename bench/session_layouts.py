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
rounds (``bench/closed_loop.py``). Read the numbers as ratios within one run.

Run: ``python bench/session_layouts.py [--concurrency 1 64] [--large] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.closed_loop import add_level_arguments, bench, build_bench_repository, load_average, run_rounds, write_json
from tests.harness import Proc, start_worker, worker_url

CORES = os.cpu_count() or 1
LAYOUTS: dict[str, list[str]] = {
    "per_instance": ["--backend-option", "cpu_sessions=per_instance"],
    "shared": ["--backend-option", "cpu_sessions=shared"],
    "adaptive": ["--backend-option", "cpu_sessions=adaptive"],
    "one_wide": ["--backend-option", "cpu_sessions=per_instance", "--intra-op-threads", str(CORES),
                 "--execution-threads", "1"],
}
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn", "encoder"])
    parser.add_argument("--large", action="store_true", help="also cnn_large")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    add_level_arguments(parser, measurement_ms=2000)
    args = parser.parse_args()
    models = args.models + (["cnn_large"] if args.large else [])

    workdir = Path(tempfile.mkdtemp(prefix="infergate-session-layouts-"))
    procs: dict[str, Proc] = {}
    results: dict[str, dict[str, dict[int, dict[str, Any]]]] = {m: {name: {} for name in args.layouts} for m in models}
    load_before = load_average()
    try:
        repo = workdir / "models"
        build_bench_repository(repo, models)
        loads = [a for m in models for a in ("--load-model", m)]
        for name in args.layouts:
            procs[name] = start_worker(repo, "--model-control-mode", "explicit", *loads, "--log-level", "warning",
                                       *LAYOUTS[name])
        for model in models:
            for concurrency in args.concurrency:
                got = run_rounds({name: (lambda url=worker_url(procs[name]), m=model, c=concurrency:
                                         bench(url, m, c, args, workdir / "level.json"))
                                  for name in args.layouts}, args.rounds, f"{model} c={concurrency}")
                for name, figures in got.items():
                    results[model][name][concurrency] = figures
    finally:
        for proc in procs.values():
            proc.stop(check=False)
        shutil.rmtree(workdir, ignore_errors=True)
    load_after = load_average()

    print(f"\n{CORES} cores; load average (1/5/15 min) before {load_before}, after {load_after}")
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
    write_json(args.json, {"cores": CORES, "load": [load_before, load_after], "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
