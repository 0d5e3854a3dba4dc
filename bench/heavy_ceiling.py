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

The floor, in the same rounds: ``heavy_io``, an identity model with
``heavy``'s shapes (the same bytes in and out a row, no compute), through the
default setup, with the CPU a row of the client, the gateway and its worker
together (``/proc`` and the client's rusage over the level); and the CPU a
row of ONNX Runtime itself (this process's CPU over the side-by-side level).
On ``C`` shared cores a served row costs both, so no served rate passes
``C / (ORT + I/O)`` rows/s, while in-process ONNX Runtime reaches
``C / ORT``: the cap on the ratio is ``ORT / (ORT + I/O)``, printed last.

Run: ``python bench/heavy_ceiling.py [--clients 16] [--rounds 3]``. The
clients share the machine with the servers: read the ratios within one run.
"""

from __future__ import annotations

import argparse
import math
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import onnx  # noqa: E402
from onnx import TensorProto  # noqa: E402

from bench.closed_loop import add_level_arguments, bench, build_bench_repository, load_average, run_rounds  # noqa: E402
from bench.ort_ceiling import OrtCeiling  # noqa: E402
from execution.devices import cpu_count  # noqa: E402
from loadtest.suite_procs import tree_cpu_seconds  # noqa: E402
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


def build_heavy_io() -> onnx.ModelProto:
    """``heavy``'s input and output, no compute: what the bytes of a row cost to serve."""
    g = GraphBuilder("heavy_io", seed=9)
    x = g.input("INPUT", TensorProto.FLOAT, ["batch", POSITIONS, WIDTH])
    g.op("Identity", x, out="OUTPUT")
    g.output("OUTPUT", TensorProto.FLOAT, ["batch", POSITIONS, WIDTH])
    return g.model()


HEAVY = ExampleModel("heavy", build_heavy, max_batch_size=16, dynamic_batching=True)
HEAVY_IO = ExampleModel("heavy_io", build_heavy_io, max_batch_size=16, dynamic_batching=True)
DEFAULT = "adaptive (default)"
IO_FLOOR = "I/O alone (heavy_io, default)"


def with_cpu(measure: Any, pids: list[int]) -> dict[str, Any]:
    """``measure()``'s level with ``cpu_ms_per_row``: the CPU of ``pids``' process trees and of this
    process's finished children (the bench client) over the level, or this process's own CPU when no
    pids are named (in-process ONNX Runtime), per row served at the level's rate over its wall time."""
    def cpu() -> float:
        if not pids:
            return time.process_time()
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        return sum(tree_cpu_seconds(pid) for pid in pids) + children.ru_utime + children.ru_stime

    before, wall = cpu(), time.monotonic()
    r = measure()
    spent, wall = cpu() - before, time.monotonic() - wall
    rows = r["rps"] * wall
    r["cpu_ms_per_row"] = spent / rows * 1000 if rows else math.nan
    return r


SETUPS = {
    DEFAULT: ([], ""),
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
        build_bench_repository(repo, ["heavy", "heavy_io"], extra=(HEAVY, HEAVY_IO))
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

        def at(name: str, model: str = "heavy") -> Any:
            def run() -> dict[str, Any]:
                r = with_cpu(lambda: bench(worker_url(procs[name]), model, args.clients, args, level),
                             [procs[name].pid])
                if name == DEFAULT and model == "heavy":
                    seen["batch"] = 1 if math.isnan(r["avg_batch"]) else max(1, round(r["avg_batch"]))
                return r
            return run

        window_s = args.measurement_ms / 1000
        contenders: dict[str, Any] = {name: at(name) for name in SETUPS}
        contenders[IO_FLOOR] = at(DEFAULT, "heavy_io")
        contenders["ORT wide"] = lambda: with_cpu(lambda: ceiling.level(seen["batch"], "wide", window_s), [])
        contenders["ORT side by side"] = lambda: with_cpu(
            lambda: ceiling.level(seen["batch"], "side_by_side", window_s), [])
        got = run_rounds(contenders, args.rounds, f"heavy {args.clients} clients")
    finally:
        for proc in procs.values():
            proc.stop(check=False)
        shutil.rmtree(workdir, ignore_errors=True)
    best = max(("ORT wide", "ORT side by side"), key=lambda k: got[k]["rps"])
    print(f"\n{cpu_count()} cores; load average before {load_before}, after {load_average()}; "
          f"{ceiling.describe}")
    print("| setup | rows/s | mean batch | p50 ms | CPU ms a row | ratio to the better ORT |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in (*SETUPS, IO_FLOOR, "ORT wide", "ORT side by side"):
        r = got[name]
        ratio = "-" if name == IO_FLOOR else f"{r['rps'] / got[best]['rps']:.2f}"
        print(f"| {name} | {r['rps']:.0f} | {r['avg_batch']:.1f} | {r.get('p50_ms', math.nan):.2f} | "
              f"{r['cpu_ms_per_row']:.2f} | {ratio} |")
    ort, io = got["ORT side by side"]["cpu_ms_per_row"], got[IO_FLOOR]["cpu_ms_per_row"]
    print(f"\nThe floor: ONNX Runtime {ort:.2f} ms of CPU a row, the bytes of a row through client, gateway and "
          f"worker {io:.2f} ms: on shared cores a served row costs both, so the ratio cannot pass "
          f"{ort:.2f} / ({ort:.2f} + {io:.2f}) = {ort / (ort + io):.2f}; measured {got[DEFAULT]['rps'] / got[best]['rps']:.2f} "
          f"({DEFAULT}).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
