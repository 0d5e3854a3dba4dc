"""``infergate serve`` (the models in the gateway process) beside
``infergate up --workers 1`` (a gateway and one worker process), in one run:
``infergate bench`` (closed loop, gRPC, single-row requests) at a few
concurrency levels on ``mlp`` (light) and ``cnn`` (compute-bound).

Both servers run on the same repository with the same execution defaults;
they take turns at each level, in a rotated order each round, and each
figure is the median of its rounds. The machine is shared with the clients:
read the numbers as ratios within one run.

Run: ``python bench/single_process.py [--concurrency 1 64] [--rounds 3] [--json out.json]``.
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
from tests.harness import Proc, start, worker_url


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    add_level_arguments(parser)
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="infergate-single-process-"))
    procs: dict[str, Proc] = {}
    load_before = load_average()
    results: dict[str, dict[str, dict[int, dict[str, Any]]]] = {}
    try:
        repo = workdir / "models"
        build_bench_repository(repo, args.models)
        ports = ["--http-port", "0", "--grpc-port", "0", "--log-level", "WARNING"]
        procs["serve"] = start(["serve", "--model-repository", str(repo), *ports])
        procs["up --workers 1"] = start(["up", "--workers", "1", "--model-repository", str(repo), *ports])
        names = list(procs)
        for model in args.models:
            results[model] = {name: {} for name in names}
            for concurrency in args.concurrency:
                got = run_rounds({name: (lambda url=worker_url(procs[name]), m=model, c=concurrency:
                                         bench(url, m, c, args, workdir / "level.json"))
                                  for name in names}, args.rounds, f"{model} c={concurrency}")
                for name, figures in got.items():
                    results[model][name][concurrency] = figures
    finally:
        for proc in procs.values():
            proc.stop(check=False)
        shutil.rmtree(workdir, ignore_errors=True)
    load_after = load_average()

    print(f"\n{os.cpu_count()} cores; load average (1/5/15 min) before {load_before}, after {load_after}")
    print("| model | server | " + " | ".join(f"c={c} req/s | c={c} p50 ms" for c in args.concurrency)
          + " | req/s vs up --workers 1 |")
    print("|" + "---|" * (3 + 2 * len(args.concurrency)))
    for model, by_server in results.items():
        for name, by in by_server.items():
            cells = " | ".join(f"{by[c]['rps']:.0f} | {by[c]['p50_ms']:.2f}" for c in args.concurrency)
            ratio = " / ".join(f"{by[c]['rps'] / by_server['up --workers 1'][c]['rps']:.2f}" for c in args.concurrency)
            print(f"| {model} | `{name}` | {cells} | {ratio} |")
    write_json(args.json, {"load": [load_before, load_after], "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
