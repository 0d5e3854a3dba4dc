"""Gateway overhead and batching gain on ``mlp``, measured against the worker itself.

Starts ``infergate up`` (one worker by default, so "direct" and "through the
gateway" use the same replica), then measures:

* latency at low load: one client, sequential, batch 1, to the worker over
  gRPC and to the gateway over gRPC and HTTP (binary tensors). Samples are
  taken in interleaved blocks so drift in the machine's load hits every
  target alike. Workers speak gRPC only, so the HTTP overhead is "gateway
  HTTP minus worker gRPC": the protocol change is part of what it costs.
* throughput: many concurrent single-row clients (asyncio gRPC) through the
  gateway, which batches them, against the worker fed batch-64 requests
  directly (the best the worker does with perfect client-side batching), and
  against the worker fed the same single-row clients without a gateway.

Run: ``python bench/gateway_overhead.py [--workers 1] [--json out.json]``.
The client runs on the same machine as the servers, so on a small machine
the numbers are ratios to read together, not absolute capacities.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcclient_aio
import tritonclient.http as httpclient
import tritonclient.http.aio as httpclient_aio

ROOT = Path(__file__).resolve().parent.parent


def start_cluster(repo: Path, workers: int, workdir: Path, config: Path | None) -> tuple[subprocess.Popen, dict]:
    ready = workdir / "ready.json"
    cmd = [sys.executable, "-m", "infergate", "up", "--workers", str(workers), "--model-repository", str(repo),
           "--http-port", "0", "--grpc-port", "0", "--ready-file", str(ready), "--log-level", "WARNING"]
    if config is not None:
        cmd += ["--config", str(config)]
    with open(workdir / "up.log", "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 120
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"infergate up did not start; see {workdir / 'up.log'}")
        time.sleep(0.05)
    return proc, json.loads(ready.read_text())


def stop_cluster(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# ---- latency -------------------------------------------------------------------


def cpu_s(pid: int) -> float:
    """User + system CPU seconds used so far by process ``pid`` (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_snapshot(pids: dict[str, int]) -> dict[str, float]:
    return {name: cpu_s(pid) for name, pid in pids.items()}


def cpu_share(before: dict[str, float], after: dict[str, float], span_s: float) -> dict[str, float]:
    """Share of one core each process used between two snapshots."""
    return {name: (after[name] - before[name]) / span_s for name in before}


def worker_headers(ready: dict) -> dict[str, str]:
    """gRPC metadata for calling the cluster's workers directly (`up` gives them a shared token)."""
    token_file = ready.get("worker_token_file")
    return {"authorization": f"Bearer {Path(token_file).read_text().strip()}"} if token_file else {}


def grpc_caller(url: str, x: np.ndarray, headers: dict[str, str] | None = None) -> Callable[[], None]:
    client = grpcclient.InferenceServerClient(url)
    tensor = grpcclient.InferInput("INPUT", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)

    def call() -> None:
        client.infer("mlp", [tensor], headers=headers)

    return call


def http_caller(url: str, x: np.ndarray) -> Callable[[], None]:
    client = httpclient.InferenceServerClient(url)
    tensor = httpclient.InferInput("INPUT", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=True)
    output = httpclient.InferRequestedOutput("OUTPUT", binary_data=True)

    def call() -> None:
        client.infer("mlp", [tensor], outputs=[output])

    return call


def measure_latency(callers: dict[str, Callable[[], None]], requests: int, warmup: int, block: int = 100) -> dict[str, np.ndarray]:
    for call in callers.values():
        for _ in range(warmup):
            call()
    samples: dict[str, list[float]] = {name: [] for name in callers}
    while any(len(s) < requests for s in samples.values()):
        for name, call in callers.items():
            for _ in range(min(block, requests - len(samples[name]))):
                t0 = time.perf_counter()
                call()
                samples[name].append(time.perf_counter() - t0)
    return {name: np.array(s) * 1e6 for name, s in samples.items()}  # microseconds


# ---- throughput ----------------------------------------------------------------


async def rows_per_s(url: str, rows: int, clients: int, duration_s: float, warmup_s: float, *, http: bool = False,
                     headers: dict[str, str] | None = None) -> float:
    """Rows per second answered to ``clients`` concurrent loops each sending ``rows``-row requests."""
    x = np.random.default_rng(0).standard_normal((rows, 64), dtype=np.float32)
    lib = httpclient if http else grpcclient
    client = (httpclient_aio.InferenceServerClient(url, conn_limit=clients) if http
              else grpcclient_aio.InferenceServerClient(url))
    counted = 0
    measuring = False
    stop_at = time.monotonic() + warmup_s + duration_s

    async def loop() -> None:
        nonlocal counted
        tensor = lib.InferInput("INPUT", [rows, 64], "FP32")
        tensor.set_data_from_numpy(x)
        while time.monotonic() < stop_at:
            await client.infer("mlp", [tensor], headers=headers)
            if measuring:
                counted += rows

    async def clock() -> float:
        nonlocal measuring
        await asyncio.sleep(warmup_s)
        measuring, t0 = True, time.monotonic()
        await asyncio.sleep(duration_s)
        measuring = False
        return time.monotonic() - t0

    try:
        results = await asyncio.gather(clock(), *(loop() for _ in range(clients)))
    finally:
        await client.close()
    return counted / results[0]


async def gateway_batching(url: str) -> tuple[int, int]:
    client = grpcclient_aio.InferenceServerClient(url)
    try:
        s = (await client.get_inference_statistics("mlp")).model_stats[0]
        return s.inference_count, s.execution_count
    finally:
        await client.close()


# ---- main ------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-repository", type=Path, help="built example repository (default: build one)")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--requests", type=int, default=2000, help="latency samples per target")
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--clients", type=int, default=64, help="concurrent single-row clients for throughput")
    parser.add_argument("--duration-s", type=float, default=10.0)
    parser.add_argument("--config", type=Path, help="gateway YAML config for `infergate up`")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="gateway-overhead-"))
    repo = args.model_repository
    if repo is None:
        from models.build import build_repository

        repo = workdir / "models"
        build_repository(repo)
    proc, ready = start_cluster(repo, args.workers, workdir, args.config)
    gateway_grpc = f"127.0.0.1:{ready['grpc_port']}"
    gateway_http = f"127.0.0.1:{ready['http_port']}"
    worker = ready["workers"][0]["address"]
    direct = worker_headers(ready)
    results: dict[str, object] = {"workers": args.workers, "cpus": os.cpu_count()}
    try:
        x = np.random.default_rng(1).standard_normal((1, 64), dtype=np.float32)
        lat = measure_latency(
            {"worker grpc": grpc_caller(worker, x, direct), "gateway grpc": grpc_caller(gateway_grpc, x),
             "gateway http": http_caller(gateway_http, x)},
            args.requests, args.warmup,
        )
        pct = {name: {"p50": float(np.percentile(v, 50)), "p99": float(np.percentile(v, 99))} for name, v in lat.items()}
        results["latency_us"] = pct
        base = pct["worker grpc"]
        results["overhead_us"] = {
            name: {q: pct[name][q] - base[q] for q in ("p50", "p99")} for name in ("gateway grpc", "gateway http")
        }
        print(f"latency, mlp batch 1, sequential, {args.requests} requests each (microseconds):")
        for name, p in pct.items():
            extra = "" if name == "worker grpc" else (
                f"   overhead p50 {p['p50'] - base['p50']:+8.0f}  p99 {p['p99'] - base['p99']:+8.0f}")
            print(f"  {name:<13} p50 {p['p50']:8.0f}  p99 {p['p99']:8.0f}{extra}")

        warmup_s = min(2.0, args.duration_s / 4)
        pids = {"client": os.getpid(), "gateway": ready["gateway_pid"], "worker": ready["workers"][0]["pid"]}
        before = asyncio.run(gateway_batching(gateway_grpc))
        span = warmup_s + args.duration_s
        cpu0 = cpu_snapshot(pids)
        through = asyncio.run(rows_per_s(gateway_grpc, 1, args.clients, args.duration_s, warmup_s))
        cpu1 = cpu_snapshot(pids)
        after = asyncio.run(gateway_batching(gateway_grpc))
        through_http = asyncio.run(rows_per_s(gateway_http, 1, args.clients, args.duration_s, warmup_s, http=True))
        cpu2 = cpu_snapshot(pids)
        after_http = asyncio.run(gateway_batching(gateway_grpc))
        direct_64 = asyncio.run(rows_per_s(worker, 64, 1, args.duration_s, warmup_s, headers=direct))
        direct_64x2 = asyncio.run(rows_per_s(worker, 64, 2, args.duration_s, warmup_s, headers=direct))
        cpu3 = cpu_snapshot(pids)
        direct_single = asyncio.run(rows_per_s(worker, 1, args.clients, args.duration_s, warmup_s, headers=direct))
        cpu4 = cpu_snapshot(pids)
        inferences, executions = after[0] - before[0], after[1] - before[1]
        results["throughput_rows_per_s"] = {
            f"gateway, {args.clients} single-row gRPC clients": through,
            f"gateway, {args.clients} single-row HTTP clients": through_http,
            "worker direct, 1 client batch 64": direct_64,
            "worker direct, 2 clients batch 64": direct_64x2,
            f"worker direct, {args.clients} single-row clients": direct_single,
        }
        http_inferences, http_executions = after_http[0] - after[0], after_http[1] - after[1]
        results["gateway_mean_batch_rows"] = {
            "grpc": inferences / executions if executions else None,
            "http": http_inferences / http_executions if http_executions else None,
        }
        print(f"throughput, mlp, {args.duration_s:.0f} s each (rows/s):")
        for name, value in results["throughput_rows_per_s"].items():  # type: ignore[union-attr]
            print(f"  {name:<40} {value:10.0f}")
        for name, mean in results["gateway_mean_batch_rows"].items():  # type: ignore[union-attr]
            if mean:
                print(f"  gateway mean batch over {name}: {mean:.1f} rows")
        best_direct = max(direct_64, direct_64x2)
        print(f"  gateway / worker batch-64: gRPC {through / best_direct:.2f}, HTTP {through_http / best_direct:.2f}")
        results["cpu_share_of_a_core"] = {
            "gateway gRPC run": cpu_share(cpu0, cpu1, span),
            "gateway HTTP run": cpu_share(cpu1, cpu2, span),
            "worker direct single-row run": cpu_share(cpu3, cpu4, span),
        }
        for name, used in results["cpu_share_of_a_core"].items():  # type: ignore[union-attr]
            print(f"  cpu during {name}: " + ", ".join(f"{k} {v:.0%}" for k, v in used.items()))
    finally:
        stop_cluster(proc)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
