"""Two sections of the benchmark suite on how much of the machine the gateway uses:

- ``compute``: the compute-bound ``cnn_large`` (about 5 ms a row on one core,
  built for the bench by ``infergate models build --bench``) behind one
  gateway and one worker with its default threads, at 8 to 64 single-row
  gRPC clients. Each row is set against ONNX Runtime in this process using
  every core at the mean batch the gateway formed -- the better of one
  session per core side by side and one session with a thread per core --
  measured after every process has stopped.
- ``ceiling``: the light ``mlp`` at 1 and 64 single-row gRPC clients, three
  ways: straight to the worker, through the gateway (adaptive batching), and
  to a bare ``grpc.aio`` server answering a prebuilt reply
  (``loadtest.echo_server``): the Python ceiling on this box. Its CPU per
  request is set against the gateway's (CPU seconds of the process from
  /proc over the level, divided by the requests it answered).
"""

from __future__ import annotations

import math
import os
import threading
import time
from pathlib import Path

import numpy as np

from loadtest.report import LevelResult
from loadtest.suite_context import SuiteContext, grpc_address, ms
from loadtest.suite_procs import ProcessGroup, Service, cpu_seconds
from loadtest.suite_report import Column, SectionResult
from loadtest.suite_sections import level_dict

COMPUTE_MODEL = "cnn_large"
COMPUTE_CLIENTS = (8, 32, 64)
LIGHT_MODEL = "mlp"
LIGHT_CLIENTS = (1, 64)
CEILING_RUN_S = 1.0


def _cores() -> int:
    return max(1, len(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else max(1, os.cpu_count() or 1)


def build_bench_models(ctx: SuiteContext) -> Path:
    from models.build import BENCH_MODELS, build_repository  # onnx is imported only by this section

    root = ctx.workdir / "bench-models"
    build_repository(root, BENCH_MODELS, ensembles=())
    return root


def run_compute(ctx: SuiteContext) -> SectionResult:
    repo = build_bench_models(ctx)
    measured: list[tuple[int, LevelResult]] = []
    with ProcessGroup(ctx.workdir) as procs:
        # The worker's own thread defaults: what a user gets.
        (worker,) = procs.start_many([("worker", ["worker", "--model-repository", str(repo), "--host", "127.0.0.1",
                                                  "--port", "0", "--log-level", "warning"])])  # fmt: skip
        gateway = ctx.start_gateway(procs, [grpc_address(worker)], {"batching": {"mode": "adaptive"}}, [COMPUTE_MODEL])
        url = grpc_address(gateway)
        levels = COMPUTE_CLIENTS[:1] if ctx.settings.quick else COMPUTE_CLIENTS
        for clients in levels:
            ctx.progress(f"compute: {COMPUTE_MODEL}, {clients} single-row clients through the gateway")
            measured.append((clients, ctx.bench(COMPUTE_MODEL, url, "grpc", concurrency=clients)))
    model_path = repo / COMPUTE_MODEL / "1" / "model.onnx"
    ceilings: dict[int, float] = {}
    rows = []
    for clients, lv in measured:
        mean_batch = lv.server.avg_batch if lv.server is not None else math.nan
        batch = max(1, round(mean_batch)) if not math.isnan(mean_batch) else 1
        if batch not in ceilings:
            ctx.progress(f"compute: onnxruntime on every core at batch {batch}")
            ceilings[batch] = all_cores_rows_per_s(model_path, batch, 0.3 if ctx.settings.quick else CEILING_RUN_S)
        raw = ceilings[batch]
        rows.append({
            "clients": clients, "rows_per_s": lv.rows_per_s, "p50": ms(lv.latency.p50_us), "mean_batch": mean_batch,
            "raw_rows_per_s": raw, "of_raw": lv.rows_per_s / raw if raw > 0 else math.nan,
            "client_cpu": max(lv.client_cpu, default=math.nan),
        })  # fmt: skip
    return SectionResult(
        key="compute",
        title=f"Compute-bound model: {COMPUTE_MODEL} through the gateway vs ONNX Runtime on every core ({_cores()} cores)",
        columns=(
            Column("clients", "clients", "d"), Column("rows_per_s", "rows/s via gateway", ",.0f"),
            Column("p50", "p50 ms", ".1f"), Column("mean_batch", "mean batch", ".1f"),
            Column("raw_rows_per_s", "in-process ORT rows/s, all cores, that batch", ",.0f"),
            Column("of_raw", "of in-process", ".0%"), Column("client_cpu", "bench client CPU", ".0%"),
        ),
        rows=tuple(rows),
        notes=(
            f"{COMPUTE_MODEL}: about 1 GFLOP a row (`infergate models build --bench`); one worker with its default threads",
            ("in-process = session.run at that batch, best of one session per core run side by side and one "
             "session with a thread per core, after every process stopped; the bench client, gateway and worker "
             "share the same cores during the gateway rows"),
        ),
        details={"levels": [dict(level_dict(lv), clients=c) for c, lv in measured],
                 "ceilings": [{"batch": b, "rows_per_s": r} for b, r in ceilings.items()]},
    )


def all_cores_rows_per_s(path: Path, batch: int, duration_s: float) -> float:
    """Rows/s of ``session.run`` at ``batch`` using every core: the better of two layouts."""
    import onnxruntime as ort

    cores = _cores()

    def session(threads: int) -> ort.InferenceSession:
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

    feeds = {"IMAGE": np.random.default_rng(0).standard_normal((batch, 3, 32, 32)).astype(np.float32)}

    def run(sessions: list[ort.InferenceSession]) -> float:
        for s in sessions:
            s.run(None, feeds)
        counts = [0] * len(sessions)
        stop = time.perf_counter() + duration_s

        def loop(i: int) -> None:
            while time.perf_counter() < stop:
                sessions[i].run(None, feeds)
                counts[i] += 1

        threads = [threading.Thread(target=loop, args=(i,)) for i in range(len(sessions))]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return sum(counts) * batch / (time.perf_counter() - start)

    side_by_side = run([session(1) for _ in range(cores)])
    wide = run([session(cores)])
    return max(side_by_side, wide)


def run_ceiling(ctx: SuiteContext) -> SectionResult:
    results: dict[tuple[str, int], tuple[LevelResult, float]] = {}
    with ProcessGroup(ctx.workdir) as procs:
        worker = ctx.start_workers(procs, 1)[0]
        gateway = ctx.start_gateway(procs, [grpc_address(worker)], {"batching": {"mode": "adaptive"}}, [LIGHT_MODEL])
        echo = procs.start("echo", ["--like", grpc_address(worker), "--model", LIGHT_MODEL], module="loadtest.echo_server")
        targets: dict[str, Service] = {"worker": worker, "gateway": gateway, "echo": echo}
        for clients in LIGHT_CLIENTS:
            for name, service in targets.items():
                ctx.progress(f"ceiling: {LIGHT_MODEL}, {clients} client(s), {name}")
                before, t0 = cpu_seconds(service.pid), time.monotonic()
                lv = ctx.bench(LIGHT_MODEL, grpc_address(service), "grpc", concurrency=clients)
                after, t1 = cpu_seconds(service.pid), time.monotonic()
                cores_used = (after - before) / (t1 - t0) if before is not None and after is not None else math.nan
                results[name, clients] = (lv, cores_used)
    rows = []
    for clients in LIGHT_CLIENTS:
        row: dict[str, object] = {"clients": clients}
        for name in ("worker", "gateway", "echo"):
            lv, cores_used = results[name, clients]
            row[f"{name}_rps"] = lv.throughput_rps
            row[f"{name}_p50"] = ms(lv.latency.p50_us)
            row[f"{name}_cpu_us"] = cores_used / lv.throughput_rps * 1e6 if lv.throughput_rps > 0 else math.nan
        row["added_p50"] = row["gateway_p50"] - row["worker_p50"]  # type: ignore[operator]
        row["vs_worker"] = row["gateway_rps"] / row["worker_rps"]  # type: ignore[operator]
        row["cpu_vs_echo"] = row["gateway_cpu_us"] / row["echo_cpu_us"]  # type: ignore[operator]
        rows.append(row)
    return SectionResult(
        key="ceiling",
        title=f"Light model ({LIGHT_MODEL}, single-row gRPC): worker direct, gateway, and a bare grpc.aio echo server",
        columns=(
            Column("clients", "clients", "d"),
            Column("worker_rps", "worker direct req/s", ",.0f"), Column("gateway_rps", "gateway req/s", ",.0f"),
            Column("vs_worker", "gateway / direct", ".2f"), Column("echo_rps", "echo server req/s", ",.0f"),
            Column("worker_p50", "direct p50 ms", ".2f"), Column("gateway_p50", "gateway p50 ms", ".2f"),
            Column("added_p50", "added p50 ms", "+.2f"),
            Column("gateway_cpu_us", "gateway CPU us/req", ",.0f"), Column("echo_cpu_us", "echo CPU us/req", ",.0f"),
            Column("cpu_vs_echo", "gateway / echo CPU", ".2f"),
        ),
        rows=tuple(rows),
        notes=(
            "echo server = loadtest/echo_server.py: grpc.aio, one prebuilt reply, the request never parsed",
            ("CPU us/req = the process's CPU seconds over the level (warm-up included, from /proc) per second, "
             "divided by its req/s; gateway with adaptive batching, one worker behind it"),
        ),
        details={f"{name}-{clients}": dict(level_dict(lv), cpu_cores=cores)
                 for (name, clients), (lv, cores) in results.items()},
    )
