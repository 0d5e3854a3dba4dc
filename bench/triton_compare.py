"""``mlp`` on a real Triton Inference Server, directly and through the gateway,
beside the gateway in front of one of our own workers, in one run.

Starts, on this machine:

* a Triton server (the ``tritonserver`` bundled with ``nvidia-pytriton``)
  serving the Python-backend copy of ``mlp`` (models/triton.py: ONNX Runtime
  on the CPU inside Triton's Python stub, Triton's dynamic batcher on);
* an infergate worker serving the ONNX ``mlp``;
* one gateway in front of the Triton server with its relay lane on
  (``relay: auto``: ``mlp``'s calls go on to Triton as their bytes while a
  Triton instance is free, and are batched by the gateway beyond), one
  more with ``relay: off`` (the default: every call read, batched and
  written again), and one in front of the worker;
* ``infergate serve`` running the same ``mlp`` in its own process (one
  process, as Triton is);
* a bare ``grpc.aio`` server that answers every call with a prebuilt reply
  (``loadtest.echo_server``, copied from the worker's answer, no model run):
  the most any Python gRPC server reaches on this machine with these
  clients, the floor of every Python server's work per request;
* a bare ``grpc.aio`` proxy in front of the same Triton server
  (``bench/proxy_floor.py --serve-proxy``: each call's bytes forwarded and the
  reply's bytes returned, unparsed, no routing, no batching): the floor of
  any Python gateway in front of Triton, one server side and one client call
  a request, which the relay lane's rate and CPU are read against.

Both servers get the same number of single-threaded ONNX Runtime executors
(Triton: instances of the model; the worker: execution threads), so the
comparison is of the serving paths, not of thread counts. Then
``infergate bench`` (closed loop, gRPC, batch 1) measures each target at each
concurrency level, targets interleaved per level so drift in the machine's
load hits all three alike: Triton directly, the gateway to Triton, the
gateway to the worker, ``serve``, the bare echo server, the bare proxy. Beside each rate, the
CPU milliseconds per request of the process that answers the client (the
gateway, where one is in front; Triton with its backend stubs when direct):
its CPU time over the level divided by the wall time and the level's rate, so
warm-up counts as measured calls do.

Run: ``python bench/triton_compare.py [--concurrency 16 64] [--json out.json]``.
Linux x86_64 only (the bundled Triton). Clients and servers share the
machine: on a small one, read the numbers as ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from loadtest.suite_procs import cpu_seconds, tree_cpu_seconds
from models.build import build_repository
from models.triton import build_triton_repository
from tests.harness import Proc, start, start_worker, worker_url
from tests.triton_harness import start_triton, triton_available

MODEL = "mlp"


def prepare_repositories(workdir: Path, executors: int) -> tuple[Path, Path]:
    """The ONNX repository (``mlp`` only) and its Triton twin with ``executors`` CPU instances."""
    full = workdir / "all-models"
    build_repository(full)
    onnx_repo = workdir / "onnx"
    onnx_repo.mkdir()
    shutil.copytree(full / MODEL, onnx_repo / MODEL)
    triton_repo = workdir / "triton"
    build_triton_repository(onnx_repo, triton_repo, [MODEL], intra_op_threads=1)
    config_path = triton_repo / MODEL / "config.pbtxt"
    config = text_format.Parse(config_path.read_text(), mc.ModelConfig())
    config.instance_group[0].count = executors
    config_path.write_text(text_format.MessageToString(config))
    return onnx_repo, triton_repo


def bench(url: str, concurrency: int, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One ``infergate bench`` level against ``url``; its level record from the JSON report."""
    cmd = [
        sys.executable, "-m", "infergate", "bench", "-m", MODEL, "-u", url, "-i", "grpc",
        "--concurrency-range", f"{concurrency}:{concurrency}:1",
        "-p", str(args.measurement_ms), "-r", str(args.max_trials), "-s", str(args.stability),
        "--warmup", args.warmup, "--processes", str(args.client_processes), "--json", str(out),
    ]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    [level] = json.loads(out.read_text())["levels"]
    return level


def summarize(level: dict[str, Any]) -> dict[str, Any]:
    server = level.get("server") or {}
    return {
        "throughput_rps": level["throughput_rps"],
        "p50_ms": level["latency"]["p50_us"] / 1000.0,
        "p99_ms": level["latency"]["p99_us"] / 1000.0,
        "errors": level["error_count"],
        "stable": level["stable"],
        "server_avg_batch": server.get("avg_batch"),
        "client_saturated": level["client_saturated"],
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--executors", type=int, default=min(4, os.cpu_count() or 1),
                        help="single-threaded ONNX Runtime executors per server (default: cores, at most 4)")
    parser.add_argument("--measurement-ms", type=int, default=4000)
    parser.add_argument("--max-trials", type=int, default=4)
    parser.add_argument("--stability", type=float, default=15.0)
    parser.add_argument("--warmup", default="2s")
    parser.add_argument("--client-processes", type=int, default=1)
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--without-burst-hold", action="store_true",
                        help="also a gateway with batching.burst_hold_us 0 in front of the same worker")
    return parser.parse_args(argv)


def measure(args: argparse.Namespace, progress: Any = print) -> dict[str, dict[int, dict[str, Any]]]:
    """Every target at every level: target -> clients -> figures (req/s, latencies, CPU ms a request).
    Raises RuntimeError where no real Triton runs here."""
    available, reason = triton_available()
    if not available:
        raise RuntimeError(f"no real Triton here: {reason}")
    workdir = Path(tempfile.mkdtemp(prefix="infergate-triton-compare-"))
    procs: list[Any] = []
    try:
        onnx_repo, triton_repo = prepare_repositories(workdir, args.executors)
        triton = start_triton(triton_repo, models=[MODEL], workdir=workdir)
        procs.append(triton)
        worker = start_worker(onnx_repo, "--execution-threads", str(args.executors), "--intra-op-threads", "1",
                              "--log-level", "warning")
        procs.append(worker)
        gateways: dict[str, Proc] = {}
        no_hold = workdir / "no_burst_hold.yaml"
        no_hold.write_text("batching:\n  burst_hold_us: 0\n")
        relay_off = workdir / "relay_off.yaml"
        relay_off.write_text("relay: \"off\"\n")
        relay_on = workdir / "relay_on.yaml"
        relay_on.write_text("relay: auto\n")
        for name, address, extra in (("triton", f"triton://{triton.grpc_url}", ["--config", str(relay_on)]),
                                     ("triton, relay off", f"triton://{triton.grpc_url}", ["--config", str(relay_off)]),
                                     ("worker", worker_url(worker), []),
                                     ("worker, no burst hold", worker_url(worker), ["--config", str(no_hold)])):
            if name.endswith("no burst hold") and not args.without_burst_hold:
                continue
            gateways[name] = start(["gateway", "--http-port", "0", "--grpc-port", "0", "--worker", address,
                                    "--log-level", "WARNING", *extra])
            procs.append(gateways[name])
        serve = start(["serve", "--model-repository", str(onnx_repo), "--http-port", "0", "--grpc-port", "0",
                       "--execution-threads", str(args.executors), "--intra-op-threads", "1", "--log-level", "WARNING"])
        procs.append(serve)
        echo = start(["--like", worker_url(worker), "--model", MODEL], module="loadtest.echo_server")
        procs.append(echo)
        proxy = start(["--serve-proxy", triton.grpc_url], module="bench.proxy_floor")
        procs.append(proxy)
        targets = {
            "triton direct": triton.grpc_url,
            "gateway -> triton (relay lane)": f"127.0.0.1:{gateways['triton'].ready['grpc_port']}",
            "gateway -> triton, relay off": f"127.0.0.1:{gateways['triton, relay off'].ready['grpc_port']}",
            "gateway -> infergate worker": f"127.0.0.1:{gateways['worker'].ready['grpc_port']}",
            "infergate serve": worker_url(serve),
            "bare grpc.aio echo, no model": worker_url(echo),
            "bare grpc.aio proxy -> triton": f"127.0.0.1:{proxy.ready['grpc_port']}",
        }
        # Whose CPU each row reports: the process the client talks to.
        answering = {
            "triton direct": (triton.pid, tree_cpu_seconds),
            "gateway -> triton (relay lane)": (gateways["triton"].pid, cpu_seconds),
            "gateway -> triton, relay off": (gateways["triton, relay off"].pid, cpu_seconds),
            "gateway -> infergate worker": (gateways["worker"].pid, cpu_seconds),
            "infergate serve": (serve.pid, cpu_seconds),
            "bare grpc.aio echo, no model": (echo.pid, cpu_seconds),
            "bare grpc.aio proxy -> triton": (proxy.pid, cpu_seconds),
        }
        if args.without_burst_hold:  # the same gateway without batching.burst_hold_us, for a before/after
            targets["gateway -> worker, no burst hold"] = (
                f"127.0.0.1:{gateways['worker, no burst hold'].ready['grpc_port']}")
        results: dict[str, dict[int, dict[str, Any]]] = {name: {} for name in targets}
        for concurrency in args.concurrency:
            for name, url in targets.items():
                pid, cpu_of = answering.get(name, (0, None))
                cpu_before, wall_before = (cpu_of(pid) or 0.0) if cpu_of else 0.0, time.monotonic()
                level = bench(url, concurrency, args, workdir / "level.json")
                cpu_s = ((cpu_of(pid) or 0.0) - cpu_before) if cpu_of else 0.0
                wall_s = time.monotonic() - wall_before
                results[name][concurrency] = summarize(level)
                r = results[name][concurrency]
                rps = r["throughput_rps"]
                r["cpu_ms_per_request"] = cpu_s / wall_s / rps * 1000 if cpu_of and rps else None
                batch = r["server_avg_batch"]
                cpu = r["cpu_ms_per_request"]
                progress(f"{name:<32} c={concurrency:<3} {rps:8.0f} req/s  "
                         f"p50 {r['p50_ms']:6.2f} ms  p99 {r['p99_ms']:6.2f} ms  errors {r['errors']}  "
                         f"server batch {batch if batch is None else round(batch, 1)}  "
                         f"CPU {'-' if cpu is None else f'{cpu:.3f}'} ms/req")
    finally:
        # Gateways first, then the servers behind them.
        for proc in reversed(procs):
            proc.stop(check=False)
        shutil.rmtree(workdir, ignore_errors=True)
    return results


def main() -> int:
    args = parse_args()
    try:
        results = measure(args, lambda line: print(line, flush=True))
    except RuntimeError as exc:
        print(f"triton_compare: {exc}", file=sys.stderr)
        return 2
    print()
    header = "| target | " + " | ".join(f"c={c} req/s | c={c} p99 ms | c={c} CPU ms/req"
                                       for c in args.concurrency) + " |"
    print(header)
    print("|" + "---|" * (1 + 3 * len(args.concurrency)))
    for name, by_level in results.items():
        cells = []
        for c in args.concurrency:
            cpu = by_level[c].get("cpu_ms_per_request")
            cells.append(f"{by_level[c]['throughput_rps']:.0f} | {by_level[c]['p99_ms']:.1f} | "
                         f"{'-' if cpu is None else f'{cpu:.3f}'}")
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({"executors": args.executors, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
