"""A compute-bound model through ``infergate up --workers 1`` against in-process
ONNX Runtime at the batch the gateway formed, in one run, with the worker's CPU
session layouts side by side.

The model is ``heavy``, built here: ``POSITIONS`` positions of 1024 features
through 4 dense 1024 x 1024 layers (ReLU between), a few milliseconds a row on
one core, batched by the gateway (``max_batch_size`` 16, dynamic batching).
Setups, each its own ``up --workers 1`` on the same repository: the worker's
default (``cpu_sessions=adaptive``), ``per_instance`` and ``shared``, and the
default with the gateway's burst hold off (``batching.burst_hold_us: 0``).
Closed-loop single-row gRPC clients (``infergate bench``), the setups in turn
in a rotated order each round; after each round ONNX Runtime runs the batch the
default setup formed (its server statistics' mean batch), on every core
("wide") and as two one-thread sessions side by side, timed in this process
while the servers idle (``bench/ort_ceiling.py``). Ratio = rows/s over the
better of the two ceilings.

Run: ``python bench/heavy_ceiling.py [--clients 16] [--rounds 3]``. The
clients share the machine with the servers: read the ratios within one run.
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import onnx  # noqa: E402
from onnx import TensorProto  # noqa: E402

from bench.closed_loop import add_level_arguments, bench, build_bench_repository, load_average, run_rounds  # noqa: E402
from bench.ort_ceiling import OrtCeiling  # noqa: E402
from execution.devices import cpu_count  # noqa: E402
from models.build import ExampleModel  # noqa: E402
from models.graph_builder import GraphBuilder  # noqa: E402
from tests.harness import Proc, start, worker_url  # noqa: E402

POSITIONS = 32
WIDTH = 1024


def build_heavy() -> onnx.ModelProto:
    g = GraphBuilder("heavy", seed=9)
    x = g.input("INPUT", TensorProto.FLOAT, ["batch", POSITIONS, WIDTH])
    for layer in range(4):
        x = g.linear(x, f"fc{layer}", WIDTH, WIDTH)
        if layer < 3:
            x = g.op("Relu", x)
    g.op("Identity", x, out="OUTPUT")
    g.output("OUTPUT", TensorProto.FLOAT, ["batch", POSITIONS, WIDTH])
    return g.model()


HEAVY = ExampleModel("heavy", build_heavy, max_batch_size=16, dynamic_batching=True)
SETUPS = {
    "adaptive (default)": ([], ""),
    "per_instance": (["--worker-arg=--backend-option", "--worker-arg=cpu_sessions=per_instance"], ""),
    "shared": (["--worker-arg=--backend-option", "--worker-arg=cpu_sessions=shared"], ""),
    "adaptive, burst hold off": ([], "batching:\n  burst_hold_us: 0\n"),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=16)
    add_level_arguments(parser, measurement_ms=3000)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="infergate-heavy-"))
    procs: dict[str, Proc] = {}
    load_before = load_average()
    try:
        repo = workdir / "models"
        build_bench_repository(repo, ["heavy"], extra=(HEAVY,))
        for name, (flags, config) in SETUPS.items():
            extra = list(flags)
            if config:
                path = workdir / f"{len(procs)}.yaml"
                path.write_text(config)
                extra += ["--config", str(path)]
            procs[name] = start(["up", "--workers", "1", "--model-repository", str(repo), "--http-port", "0",
                                 "--grpc-port", "0", "--log-level", "WARNING", *extra])
        level = workdir / "level.json"
        ceiling = OrtCeiling(repo, "heavy")
        seen = {"batch": 1}

        def at(name: str) -> Any:
            def run() -> dict[str, Any]:
                r = bench(worker_url(procs[name]), "heavy", args.clients, args, level)
                if name == "adaptive (default)":
                    seen["batch"] = 1 if math.isnan(r["avg_batch"]) else max(1, round(r["avg_batch"]))
                return r
            return run

        contenders: dict[str, Any] = {name: at(name) for name in SETUPS}
        contenders["ORT wide"] = lambda: ceiling.level(seen["batch"], "wide", args.measurement_ms / 1000)
        contenders["ORT side by side"] = lambda: ceiling.level(seen["batch"], "side_by_side",
                                                               args.measurement_ms / 1000)
        got = run_rounds(contenders, args.rounds, f"heavy {args.clients} clients")
    finally:
        for proc in procs.values():
            proc.stop(check=False)
        shutil.rmtree(workdir, ignore_errors=True)
    best = max(("ORT wide", "ORT side by side"), key=lambda k: got[k]["rps"])
    print(f"\n{cpu_count()} cores; load average before {load_before}, after {load_average()}; "
          f"{ceiling.describe}")
    print("| setup | rows/s | mean batch | p50 ms | ratio to the better ORT |")
    print("|---|---:|---:|---:|---:|")
    for name in (*SETUPS, "ORT wide", "ORT side by side"):
        r = got[name]
        print(f"| {name} | {r['rps']:.0f} | {r['avg_batch']:.1f} | {r.get('p50_ms', math.nan):.2f} | "
              f"{r['rps'] / got[best]['rps']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
