"""Two sections of the benchmark suite on simulated-accelerator workers
(``infergate worker --backend sim``), which cost almost no CPU while a batch
"runs", so one small machine can stand in for many accelerator servers:

- ``sim_check``: the sim's latency model holds. One sim worker with
  ``A`` ms per batch plus ``B`` us per row, benchmarked directly at two batch
  sizes; the worker's own compute time per execution (statistics API) is set
  against ``A + n*B``, and A and B are fitted back from the two points.
- ``scale``: 1, 2, 4 ... N sim workers behind one gateway with batching off,
  so each request is one ``A`` ms execution and N workers can serve at most
  ``N * 1000 / A`` requests/s. Where throughput stops following that line,
  something else is the limit; the gateway's CPU use (from /proc, over the
  whole level), the bench client's and the machine's say which.
"""

from __future__ import annotations

import math
import time

from loadtest.report import LevelResult
from loadtest.suite_context import SuiteContext, grpc_address, ms
from loadtest.suite_procs import ProcessGroup, cpu_seconds, machine_busy_seconds
from loadtest.suite_report import Column, SectionResult
from loadtest.suite_sections import level_dict

CHECK_LATENCY_MS = 5.0
CHECK_PER_ROW_US = 100.0
CHECK_BATCHES = (1, 32)
CHECK_TOLERANCE = 0.05  # relative; timers on an event loop are about a millisecond coarse per call

SCALE_MODEL = "mlp"
SCALE_LATENCY_MS = 5.0
# In-flight requests per worker the client keeps: the gateway sends 2 per
# replica (max_inflight_per_replica), so the rest waits in its queue and no
# worker ever idles for want of work.
SCALE_CLIENTS_PER_WORKER = 4


def run_sim_check(ctx: SuiteContext) -> SectionResult:
    requests = 40 if ctx.settings.quick else 200
    measured: dict[int, LevelResult] = {}
    with ProcessGroup(ctx.workdir) as procs:
        (started,) = ctx.start_workers(
            procs, 1, "--backend", "sim", "--sim-latency-ms", str(CHECK_LATENCY_MS), "--sim-per-row-us", str(CHECK_PER_ROW_US),
            name="sim-worker",
        )  # fmt: skip
        worker = grpc_address(started)
        for batch in CHECK_BATCHES:
            ctx.progress(f"sim_check: batch {batch} direct to a sim worker")
            measured[batch] = ctx.bench("mlp", worker, "grpc", batch_size=batch, requests=requests, warmup_requests=20)
    rows = []
    infer_ms: dict[int, float] = {}
    for batch, lv in measured.items():
        expected = CHECK_LATENCY_MS + batch * CHECK_PER_ROW_US / 1000.0
        got = ms(lv.server.compute_infer_us) if lv.server is not None else math.nan
        infer_ms[batch] = got
        error = got / expected - 1.0
        rows.append({"batch": batch, "expected": expected, "measured": got, "error": error,
                     "within": abs(error) <= CHECK_TOLERANCE, "client_p50": ms(lv.latency.p50_us)})  # fmt: skip
    low, high = CHECK_BATCHES
    per_row_us = (infer_ms[high] - infer_ms[low]) / (high - low) * 1000.0
    fixed_ms = infer_ms[low] - low * per_row_us / 1000.0
    return SectionResult(
        key="sim_check",
        title=f"Simulated accelerator: a batch of n rows takes A + n*B (A = {CHECK_LATENCY_MS:g} ms, B = {CHECK_PER_ROW_US:g} us)",
        columns=(
            Column("batch", "rows n", "d"), Column("expected", "A + n*B ms", ".3f"),
            Column("measured", "worker compute ms", ".3f"), Column("error", "error", "+.1%"),
            Column("within", f"within {CHECK_TOLERANCE:.0%}"), Column("client_p50", "client p50 ms", ".3f"),
        ),
        rows=tuple(rows),
        notes=(
            f"fitted from the two batch sizes: A = {fixed_ms:.3f} ms, B = {per_row_us:.1f} us per row",
            "the worker's time includes its event loop waking up after the timer, which grows with machine load",
            ("worker compute = the worker's compute_infer time per execution (statistics API), "
             f"{requests} requests per batch size, one in flight"),
        ),
        details={"fitted_latency_ms": fixed_ms, "fitted_per_row_us": per_row_us,
                 "levels": {str(b): level_dict(lv) for b, lv in measured.items()}},
    )


def run_scale(ctx: SuiteContext) -> SectionResult:
    levels = ctx.settings.scale_workers
    rows = []
    details = []
    with ProcessGroup(ctx.workdir) as procs:
        ctx.progress(f"scale: starting {max(levels)} sim workers ({SCALE_LATENCY_MS:g} ms per batch)")
        # Started once for every level: each level's gateway is given the first N.
        workers = ctx.start_workers(procs, max(levels), "--backend", "sim", "--sim-latency-ms", str(SCALE_LATENCY_MS),
                                    name="sim-worker")  # fmt: skip
        addresses = [grpc_address(w) for w in workers]
        for n in levels:
            gateway = ctx.start_gateway(procs, addresses[:n], {"batching": {"mode": "off"}}, [SCALE_MODEL])
            clients = SCALE_CLIENTS_PER_WORKER * n
            ctx.progress(f"scale: {n} sim worker(s), {clients} clients")
            worker_pids = [w.pid for w in workers[:n]]
            before = _clocks(gateway.pid, worker_pids)
            lv = ctx.bench(SCALE_MODEL, f"127.0.0.1:{gateway.ready['grpc_port']}", "grpc", concurrency=clients)
            after = _clocks(gateway.pid, worker_pids)
            procs.stop(gateway)
            wall = after["wall"] - before["wall"]
            use = {k: (after[k] - before[k]) / wall if wall > 0 else math.nan for k in ("gateway", "workers", "machine")}
            ideal = n * 1000.0 / SCALE_LATENCY_MS
            rows.append({
                "workers": n, "clients": clients, "ideal_rps": ideal, "rps": lv.throughput_rps,
                "of_ideal": lv.throughput_rps / ideal, "p50": ms(lv.latency.p50_us), "p99": ms(lv.latency.p99_us),
                "gateway_cpu": use["gateway"], "workers_cpu": use["workers"],
                "client_cpu": max(lv.client_cpu, default=math.nan), "machine_cpu": use["machine"],
                "errors": lv.error_count,
            })  # fmt: skip
            details.append(dict(level_dict(lv), workers=n, cpu_cores=use))
    return SectionResult(
        key="scale",
        title=f"Scale-out: sim workers ({SCALE_LATENCY_MS:g} ms per request) behind one gateway, batching off, {SCALE_MODEL} over gRPC",
        columns=(
            Column("workers", "workers", "d"), Column("clients", "clients", "d"),
            Column("ideal_rps", "ideal req/s", ",.0f"), Column("rps", "req/s", ",.0f"), Column("of_ideal", "of ideal", ".0%"),
            Column("p50", "p50 ms", ".1f"), Column("p99", "p99 ms", ".1f"),
            Column("gateway_cpu", "gateway CPU (cores)", ".2f"), Column("workers_cpu", "workers CPU (cores)", ".2f"),
            Column("client_cpu", "bench client CPU", ".0%"), Column("machine_cpu", "machine busy (cores)", ".2f"),
            Column("errors", "errors", "d"),
        ),
        rows=tuple(rows),
        notes=(
            f"ideal = workers x 1000 / {SCALE_LATENCY_MS:g} ms: one simulated execution at a time per worker",
            ("CPU columns are CPU-seconds per wall second over the whole level (warm-up included), from /proc; "
             "a single-process gateway or client near 1.0 core is saturated"),
        ),
        details={"levels": details},
    )


def _clocks(gateway_pid: int, worker_pids: list[int]) -> dict[str, float]:
    def cpu(pid: int) -> float:
        value = cpu_seconds(pid)
        return math.nan if value is None else value

    machine = machine_busy_seconds()
    return {
        "wall": time.monotonic(),
        "gateway": cpu(gateway_pid),
        "workers": sum(cpu(pid) for pid in worker_pids),
        "machine": math.nan if machine is None else machine,
    }
