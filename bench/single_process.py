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
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.session_layouts import bench
from models.build import build_repository
from tests.harness import Proc, start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--measurement-ms", type=int, default=1500)
    parser.add_argument("--max-trials", type=int, default=3)
    parser.add_argument("--stability", type=float, default=25.0)
    parser.add_argument("--warmup", default="1s")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="infergate-single-process-"))
    procs: dict[str, Proc] = {}
    load_before = os.getloadavg()
    results: dict[str, dict[str, dict[int, dict[str, Any]]]] = {}
    try:
        repo = workdir / "models"
        build_repository(repo, ensembles=())
        ports = ["--http-port", "0", "--grpc-port", "0", "--log-level", "WARNING"]
        procs["serve"] = start(["serve", "--model-repository", str(repo), *ports])
        procs["up --workers 1"] = start(["up", "--workers", "1", "--model-repository", str(repo), *ports])
        names = list(procs)
        for model in args.models:
            results[model] = {name: {} for name in names}
            for concurrency in args.concurrency:
                runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
                for turn in range(args.rounds):
                    for name in names[turn % 2:] + names[:turn % 2]:
                        url = f"127.0.0.1:{procs[name].ready['grpc_port']}"
                        r = bench(url, model, concurrency, args, workdir / "level.json")
                        runs[name].append(r)
                        print(f"{model:<6} {name:<15} c={concurrency:<3} {r['rps']:8.0f} req/s  p50 {r['p50_ms']:7.2f} ms"
                              f"  p99 {r['p99_ms']:7.2f} ms  errors {r['errors']}", flush=True)
                for name, rs in runs.items():
                    results[model][name][concurrency] = {
                        key: statistics.median(r[key] for r in rs) for key in ("rps", "p50_ms", "p99_ms", "errors")}
    finally:
        for proc in procs.values():
            proc.stop(check=False)
        shutil.rmtree(workdir, ignore_errors=True)
    load_after = os.getloadavg()

    print(f"\n{os.cpu_count()} cores; load average before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    print("| model | server | " + " | ".join(f"c={c} req/s | c={c} p50 ms" for c in args.concurrency)
          + " | req/s vs up --workers 1 |")
    print("|" + "---|" * (3 + 2 * len(args.concurrency)))
    for model, by_server in results.items():
        for name, by in by_server.items():
            cells = " | ".join(f"{by[c]['rps']:.0f} | {by[c]['p50_ms']:.2f}" for c in args.concurrency)
            ratio = " / ".join(f"{by[c]['rps'] / by_server['up --workers 1'][c]['rps']:.2f}" for c in args.concurrency)
            print(f"| {model} | `{name}` | {cells} | {ratio} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"load": [load_before, load_after], "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
