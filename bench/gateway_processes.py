"""Gateway throughput with 1 vs N gateway processes (``infergate gateway --processes N``).

Zero-CPU simulated workers (``--backend sim --sim-latency-ms 0``), so the
gateway is the bottleneck; the client is ``infergate bench`` over HTTP with
many connections (the kernel spreads connections, not requests, across the
processes). For each process count: requests/s, p50/p99, and the CPU the
gateway processes and the client used during the run, read from ``/proc``
(on a small machine the client's own share of the cores bounds what more
gateway processes can add).

Run: ``python bench/gateway_processes.py [--processes 1 2] [--workers 2] [--concurrency 64]``.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from loadtest.suite_procs import ProcessGroup, cpu_seconds  # noqa: E402


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measure(processes: int, workers: int, concurrency: int, window_ms: int, repo: str) -> dict[str, float]:
    with ProcessGroup() as group:
        sims = group.start_many([(f"sim{i}", ["worker", "--model-repository", repo, "--port", "0", "--backend", "sim",
                                              "--sim-latency-ms", "0"]) for i in range(workers)])
        addresses = [a for s in sims for a in ("--worker", f"127.0.0.1:{s.ready['grpc_port']}")]
        gateway = group.start("gateway", ["gateway", *addresses, "--http-port", "0", "--grpc-port", "0",
                                          "--processes", str(processes), "--log-level", "WARNING"])
        pids = gateway.ready.get("gateway_pids", [gateway.ready["pid"]])
        out = Path(tempfile.mkdtemp()) / "bench.json"
        cmd = [sys.executable, "-m", "infergate", "bench", "-m", "simple", "-i", "http",
               "-u", f"127.0.0.1:{gateway.ready['http_port']}", "--concurrency-range", str(concurrency),
               "-p", str(window_ms), "--json", str(out)]
        gateway_cpu0 = sum(cpu_seconds(p) or 0.0 for p in pids)
        client_cpu0, t0 = _children_cpu_s(), time.monotonic()
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
        wall = time.monotonic() - t0
        client_cpu = _children_cpu_s() - client_cpu0
        gateway_cpu = sum(cpu_seconds(p) or 0.0 for p in pids) - gateway_cpu0
        level = json.loads(out.read_text())["levels"][-1]
    return {"processes": processes, "req_s": level["throughput_rps"], "p50_ms": level["latency"]["p50_us"] / 1000,
            "p99_ms": level["latency"]["p99_us"] / 1000, "gateway_cores": gateway_cpu / wall, "client_cores": client_cpu / wall}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--window-ms", type=int, default=4000)
    parser.add_argument("--model-repository", default=str(ROOT / "models"))
    args = parser.parse_args()
    rows = [measure(n, args.workers, args.concurrency, args.window_ms, args.model_repository) for n in args.processes]
    base = rows[0]["req_s"]
    print("| gateway processes | req/s | vs 1 process | p50 ms | p99 ms | gateway CPU (cores) | client CPU (cores) |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['processes']} | {r['req_s']:,.0f} | {r['req_s'] / base:.2f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} "
              f"| {r['gateway_cores']:.2f} | {r['client_cores']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
