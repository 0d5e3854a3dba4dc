"""Servers against their ceilings, in one run: every figure beside the one it
is read against, measured in the same run on the same repository.

* ``infergate serve`` at one client: p50 against in-process ONNX Runtime at
  batch 1 on the session a lone run takes (every core; goal <= 1.15x), on a
  light model and ``cnn_large``.
* ``infergate serve`` with 8-64 clients on a compute-bound model: rows/s
  against in-process ONNX Runtime at the batch the gateway formed (the mean
  batch of the server's statistics over that level), the better of the
  server's two layouts (goal >= 0.95x).
* ``mlp`` at 64 clients: ``serve`` (one process, and a process per core) req/s against
  ``up --workers 1`` (goal >= 1.3x).
* ``infergate worker`` with its default ``cpu_sessions=adaptive``: p50 at
  one client against in-process ONNX Runtime on every core (goal <= 1.3x),
  and req/s at 32 clients against ``cpu_sessions=per_instance`` (goal >= 0.95x).

The light model is ``magika_like``, built here (not one of the examples): a
dense classifier of about the size and cost of a file-type detector, 512
features -> 448 -> 256 -> 113 classes, 1.5 MB of weights, 0.75 MFLOP a row.
In-process ONNX Runtime: ``bench/ort_ceiling.py`` (the worker backend's own
sessions, timed in this process while the servers idle). Closed-loop
``infergate bench`` over gRPC, single-row requests; the contenders of each
row take turns in a rotated order each round and each figure is the median
of its rounds (``bench/closed_loop.py``). Beside the one-client rows, a bare
``grpc.aio`` server answering a prebuilt reply (``loadtest.echo_server``,
no model run) gives the least a gRPC round trip in Python takes here. The clients share the machine with
the servers: read the ratios, within one run.

Run: ``python bench/ceilings.py [--rounds 3] [--compute-clients 8 32 64] [--json out.json]``
(about 10 minutes at 5 rounds on 2 busy cores).
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import onnx  # noqa: E402
from onnx import TensorProto  # noqa: E402

from bench.closed_loop import add_level_arguments, bench, build_bench_repository, load_average, run_rounds, write_json  # noqa: E402
from bench.ort_ceiling import OrtCeiling  # noqa: E402
from execution.devices import cpu_count  # noqa: E402
from models.build import ExampleModel  # noqa: E402
from models.graph_builder import GraphBuilder  # noqa: E402
from tests.harness import Proc, start, start_worker, worker_url  # noqa: E402


def build_magika_like() -> onnx.ModelProto:
    """512 -> 448 (Relu) -> 256 (GELU) -> 113, softmax: 373,809 weights (1.5 MB), 0.75 MFLOP a row."""
    g = GraphBuilder("magika_like", seed=5)
    x = g.input("FEATURES", TensorProto.FLOAT, ["batch", 512])
    x = g.op("Relu", g.linear(x, "fc1", 512, 448))
    x = g.gelu(g.linear(x, "fc2", 448, 256))
    g.op("Softmax", g.linear(x, "fc3", 256, 113), out="PROBS", axis=-1)
    g.output("PROBS", TensorProto.FLOAT, ["batch", 113])
    return g.model()


MAGIKA_LIKE = ExampleModel("magika_like", build_magika_like, max_batch_size=64, dynamic_batching=True)


def row(target: str, model: str, clients: int, measured: float, ceiling: float, against: str, unit: str,
        goal: str, cap: float, higher_is_better: bool, floor_ms: float = math.nan) -> dict[str, Any]:
    ratio = measured / ceiling
    met = ratio >= cap if higher_is_better else ratio <= cap
    return {"target": target, "model": model, "clients": clients, "measured": measured, "ceiling": ceiling,
            "against": against, "unit": unit, "ratio": ratio, "goal": goal, "met": met, "floor_ms": floor_ms}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--one-client-models", nargs="*", default=["magika_like", "cnn_large"])
    parser.add_argument("--compute-models", nargs="*", default=["cnn_large"])
    parser.add_argument("--compute-clients", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--light-model", default="mlp", help="serve against up --workers 1")
    parser.add_argument("--light-clients", type=int, default=64)
    parser.add_argument("--worker-clients", type=int, default=32)
    add_level_arguments(parser)
    args = parser.parse_args()
    ort_s = args.measurement_ms / 1000.0

    workdir = Path(tempfile.mkdtemp(prefix="infergate-ceilings-"))
    procs: dict[str, Proc] = {}
    rows: list[dict[str, Any]] = []
    load_before = load_average()
    try:
        repo = workdir / "models"
        names = [*args.one_client_models, *args.compute_models, args.light_model]
        build_bench_repository(repo, names, extra=(MAGIKA_LIKE,))
        ports = ["--http-port", "0", "--grpc-port", "0", "--log-level", "WARNING"]
        procs["serve"] = start(["serve", "--model-repository", str(repo), *ports])
        procs["serve --processes 0"] = start(["serve", "--model-repository", str(repo), "--processes", "0", *ports])
        procs["up --workers 1"] = start(["up", "--workers", "1", "--model-repository", str(repo), *ports])
        procs["worker"] = start_worker(repo, "--log-level", "warning")
        procs["worker per_instance"] = start_worker(repo, "--log-level", "warning",
                                                    "--backend-option", "cpu_sessions=per_instance")
        for model in args.one_client_models:  # the least a Python gRPC server takes per call: no model run at all
            procs[f"echo {model}"] = start(["--like", worker_url(procs["worker"]), "--model", model],
                                           module="loadtest.echo_server")
        url = {name: worker_url(proc) for name, proc in procs.items()}  # every one's gRPC port
        level = workdir / "level.json"

        def at(server: str, model: str, clients: int) -> Callable[[], dict[str, Any]]:
            return lambda: bench(url[server], model, clients, args, level)

        ceilings = {model: OrtCeiling(repo, model) for model in dict.fromkeys([*args.one_client_models, *args.compute_models])}
        for model in args.one_client_models:
            ceiling = ceilings[model]
            one = run_rounds({"serve": at("serve", model, 1), "worker": at("worker", model, 1),
                              "gRPC echo": at(f"echo {model}", model, 1),
                              "ORT wide, batch 1": lambda c=ceiling: c.level(1, "wide", ort_s)},
                             args.rounds, f"{model} 1 client")
            ort_p50, echo_p50 = one["ORT wide, batch 1"]["p50_ms"], one["gRPC echo"]["p50_ms"]
            rows.append(row("serve p50, 1 client", model, 1, one["serve"]["p50_ms"], ort_p50,
                            f"in-process ORT p50, batch 1, {cpu_count()} threads", "ms", "<= 1.15", 1.15, False,
                            echo_p50))
            rows.append(row("worker (adaptive) p50, 1 client", model, 1, one["worker"]["p50_ms"], ort_p50,
                            f"in-process ORT p50, batch 1, {cpu_count()} threads", "ms", "<= 1.3", 1.3, False,
                            echo_p50))
            many = run_rounds({"adaptive": at("worker", model, args.worker_clients),
                               "per_instance": at("worker per_instance", model, args.worker_clients)},
                              args.rounds, f"{model} {args.worker_clients} clients")
            rows.append(row("worker (adaptive) req/s", model, args.worker_clients, many["adaptive"]["rps"],
                            many["per_instance"]["rps"], "worker, cpu_sessions=per_instance", "req/s", ">= 0.95",
                            0.95, True))
        for model in args.compute_models:
            ceiling = ceilings[model]
            for clients in args.compute_clients:
                seen = {"batch": 1}

                def serve(model: str = model, clients: int = clients, seen: dict[str, int] = seen) -> dict[str, Any]:
                    r = bench(url["serve"], model, clients, args, level)
                    seen["batch"] = 1 if math.isnan(r["avg_batch"]) else max(1, round(r["avg_batch"]))
                    return r

                # The first round starts with serve, so ONNX Runtime runs at the batch of the latest serve level.
                got = run_rounds({"serve": serve,
                                  "ORT wide": lambda c=ceiling, s=seen: c.level(s["batch"], "wide", ort_s),
                                  "ORT side by side": lambda c=ceiling, s=seen: c.level(s["batch"], "side_by_side", ort_s)},
                                 args.rounds, f"{model} {clients} clients")
                best = max(("ORT wide", "ORT side by side"), key=lambda k: got[k]["rps"])
                rows.append(row(f"serve rows/s (mean batch {got['serve']['avg_batch']:.1f})", model, clients,
                                got["serve"]["rps"], got[best]["rps"],
                                f"in-process {best}, batch {got[best]['avg_batch']:.0f}", "rows/s", ">= 0.95", 0.95, True))
        light = run_rounds({"serve": at("serve", args.light_model, args.light_clients),
                            "serve --processes 0": at("serve --processes 0", args.light_model, args.light_clients),
                            "up --workers 1": at("up --workers 1", args.light_model, args.light_clients)},
                           args.rounds, f"{args.light_model} {args.light_clients} clients")
        for server in ("serve", "serve --processes 0"):
            rows.append(row(f"{server} req/s", args.light_model, args.light_clients, light[server]["rps"],
                            light["up --workers 1"]["rps"], "up --workers 1", "req/s", ">= 1.3", 1.3, True))
        layouts = {model: c.describe for model, c in ceilings.items()}
    finally:
        for proc in procs.values():
            proc.stop(check=False)
        shutil.rmtree(workdir, ignore_errors=True)
    load_after = load_average()

    print(f"\n{cpu_count()} cores; load average (1/5/15 min) before {load_before}, after {load_after}")
    print(f"in-process ONNX Runtime sessions: {layouts}")
    print("| target | model | clients | measured | ceiling, same run | ceiling is | ratio | goal | met "
          "| bare gRPC echo p50 |")
    print("|---|---|---:|---:|---:|---|---:|---|---|---:|")
    for r in rows:
        digits = 2 if r["unit"] == "ms" else 0
        floor = "-" if math.isnan(r["floor_ms"]) else f"{r['floor_ms']:.2f} ms"
        print(f"| {r['target']} | {r['model']} | {r['clients']} | {r['measured']:.{digits}f} {r['unit']} | "
              f"{r['ceiling']:.{digits}f} {r['unit']} | {r['against']} | {r['ratio']:.2f} | {r['goal']} | "
              f"{'yes' if r['met'] else 'no'} | {floor} |")
    write_json(args.json, {"cores": cpu_count(), "load": [load_before, load_after], "layouts": layouts, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
