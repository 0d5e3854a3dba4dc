"""Two sections of the benchmark suite on real ONNX Runtime workers:

- ``overhead``: what the gateway adds to one request at low load. ``mlp``,
  batch 1, one request in flight, direct to a worker and through a gateway
  (gRPC and HTTP with the binary tensor extension); p50 and p99, the median
  of a few interleaved rounds so drifting machine load hits every path alike.
  Rounds are timed windows, not request counts, so a slow machine still
  finishes in bounded time.
  Workers speak gRPC only, so the HTTP row's baseline is the direct gRPC call.
- ``batching``: ``mlp`` and ``cnn`` with 64 clients through a gateway whose
  batching is off, Triton-style fixed (``max_queue_delay_us`` 2000) or
  adaptive. Each row is set against raw ONNX Runtime in this process at the
  mean batch the gateway formed (its statistics' inference_count /
  execution_count over the measurement), with the worker's session settings
  (one intra-op thread): the rows/s the model itself allows at that batch.
"""

from __future__ import annotations

import math
import time

import numpy as np

from loadtest.report import LevelResult
from loadtest.suite_context import SuiteContext, grpc_address, median, ms
from loadtest.suite_procs import ProcessGroup
from loadtest.suite_report import Column, SectionResult

BATCHING_CLIENTS = 64
FIXED_DELAY_US = 2000
BATCHING_MODELS = ("mlp", "cnn")
BATCHING_MODES = {
    "off": {"batching": {"mode": "off"}},
    "fixed": {"batching": {"mode": "fixed"},
              "models": {m: {"max_queue_delay_us": FIXED_DELAY_US} for m in BATCHING_MODELS}},
    "adaptive": {"batching": {"mode": "adaptive"}},
}
# Best of a few short runs: the ceiling is what the model allows when nothing
# else interferes, so the least disturbed run is the one to report.
CEILING_RUNS = 3
CEILING_RUN_S = 0.5


def run_overhead(ctx: SuiteContext) -> SectionResult:
    s = ctx.settings
    with ProcessGroup(ctx.workdir) as procs:
        worker = grpc_address(ctx.start_workers(procs, 1)[0])
        gateway = ctx.start_gateway(procs, [worker], {"batching": {"mode": "adaptive"}}, ["mlp"])
        gw_grpc, gw_http = f"127.0.0.1:{gateway.ready['grpc_port']}", f"127.0.0.1:{gateway.ready['http_port']}"
        paths = {"direct": (worker, "grpc"), "grpc": (gw_grpc, "grpc"), "http": (gw_http, "http")}
        runs: dict[str, list[LevelResult]] = {key: [] for key in paths}
        for round_ in range(s.latency_rounds):
            for key, (url, protocol) in paths.items():
                ctx.progress(f"overhead: round {round_ + 1}/{s.latency_rounds}, {key} ({protocol} {url})")
                runs[key].append(ctx.bench("mlp", url, protocol, window_ms=s.latency_window_ms))

    def stat(key: str, attr: str) -> float:
        return ms(median([getattr(r.latency, attr) for r in runs[key]]))

    rows = []
    for key, label in (("grpc", "gRPC"), ("http", "HTTP (binary)")):
        row: dict[str, object] = {"path": label}
        for pct in ("p50", "p99"):
            direct, through = stat("direct", f"{pct}_us"), stat(key, f"{pct}_us")
            row |= {f"direct_{pct}": direct, f"gateway_{pct}": through, f"added_{pct}": through - direct}
        row["gateway_rps"] = median([r.throughput_rps for r in runs[key]])
        rows.append(row)
    return SectionResult(
        key="overhead",
        title="Gateway overhead at low load (mlp, batch 1, concurrency 1)",
        columns=(
            Column("path", "client -> gateway"),
            Column("direct_p50", "direct p50 ms", ".3f"), Column("gateway_p50", "via gateway p50 ms", ".3f"),
            Column("added_p50", "added p50 ms", "+.3f"),
            Column("direct_p99", "direct p99 ms", ".3f"), Column("gateway_p99", "via gateway p99 ms", ".3f"),
            Column("added_p99", "added p99 ms", "+.3f"),
            Column("gateway_rps", "req/s via gateway", ",.0f"),
        ),
        rows=tuple(rows),
        notes=(
            ("direct = gRPC straight to the worker (workers speak gRPC only), so the HTTP row also includes "
             "HTTP vs gRPC client cost"),
            (f"median of {s.latency_rounds} interleaved round(s) per path, each the last 3 windows of "
             f"{s.latency_window_ms} ms once they agree (at most {s.max_trials})"),
        ),
        details={k: [level_dict(r) for r in v] for k, v in runs.items()},
    )


def run_batching(ctx: SuiteContext) -> SectionResult:
    measured: list[tuple[str, str, LevelResult]] = []
    with ProcessGroup(ctx.workdir) as procs:
        worker = grpc_address(ctx.start_workers(procs, 1)[0])
        for mode, config in BATCHING_MODES.items():
            gateway = ctx.start_gateway(procs, [worker], config, BATCHING_MODELS)
            url = f"127.0.0.1:{gateway.ready['grpc_port']}"
            for model in BATCHING_MODELS:
                ctx.progress(f"batching: {model}, {BATCHING_CLIENTS} clients, batching {mode}")
                measured.append((model, mode, ctx.bench(model, url, "grpc", concurrency=BATCHING_CLIENTS)))
            procs.stop(gateway)
    # The ceilings run after every process has stopped, with the cores to themselves.
    ceilings: dict[tuple[str, int], float] = {}
    rows = []
    off_rate = {model: lv.rows_per_s for model, mode, lv in measured if mode == "off"}
    for model, mode, lv in measured:
        mean_batch = lv.server.avg_batch if lv.server is not None else math.nan
        batch = max(1, round(mean_batch)) if not math.isnan(mean_batch) else 1
        if (model, batch) not in ceilings:
            ctx.progress(f"batching: raw onnxruntime ceiling of {model} at batch {batch}")
            ceilings[model, batch] = raw_rows_per_s(ctx, model, batch)
        raw = ceilings[model, batch]
        rows.append({
            "model": model, "mode": mode if mode != "fixed" else f"fixed {FIXED_DELAY_US} us",
            "rows_per_s": lv.rows_per_s, "vs_off": lv.rows_per_s / off_rate[model] if off_rate.get(model) else math.nan,
            "p50": ms(lv.latency.p50_us), "p99": ms(lv.latency.p99_us), "mean_batch": mean_batch,
            "raw_batch": batch, "raw_rows_per_s": raw, "of_raw": lv.rows_per_s / raw if raw > 0 else math.nan,
            "client_cpu": max(lv.client_cpu, default=math.nan), "stable": lv.stable,
        })  # fmt: skip
    return SectionResult(
        key="batching",
        title=f"Dynamic batching through the gateway ({BATCHING_CLIENTS} concurrent gRPC clients, one ONNX Runtime worker)",
        columns=(
            Column("model", "model"), Column("mode", "batching"),
            Column("rows_per_s", "rows/s", ",.0f"), Column("vs_off", "x off", ".2f"),
            Column("p50", "p50 ms", ".2f"), Column("p99", "p99 ms", ".2f"),
            Column("mean_batch", "mean batch", ".1f"),
            Column("raw_rows_per_s", "raw ORT rows/s at that batch", ",.0f"), Column("of_raw", "of raw", ".0%"),
            Column("client_cpu", "bench client CPU", ".0%"),
        ),
        rows=tuple(rows),
        notes=(
            "mean batch = the gateway's inference_count / execution_count over the measurement",
            ("raw ORT = session.run in one process at that batch (rounded), 1 intra-op thread like the worker's "
             f"instance, best of {CEILING_RUNS} runs with the suite's processes stopped: the model's own ceiling"),
            ("the worker runs one instance per core (its default), so rows/s may pass one session's ceiling; "
             "the compute section sets a model against every core; bench client, gateway and worker share the cores"),
        ),
        details={"levels": [dict(level_dict(lv), model=m, mode=mode) for m, mode, lv in measured],
                 "ceilings": [{"model": m, "batch": b, "rows_per_s": r} for (m, b), r in ceilings.items()]},
    )


_ORT_TYPES = {"tensor(float)": np.float32, "tensor(int64)": np.int64, "tensor(int32)": np.int32}


def raw_rows_per_s(ctx: SuiteContext, model: str, batch: int) -> float:
    """Rows/s of ``session.run`` at ``batch`` rows (best of a few runs), settings as a worker's session."""
    import onnxruntime as ort  # only this measurement needs it

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    path = ctx.settings.model_repository / model / "1" / "model.onnx"
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feeds = {}
    for spec in session.get_inputs():
        dims = [batch] + [d if isinstance(d, int) and d > 0 else 8 for d in spec.shape[1:]]
        dtype = _ORT_TYPES[spec.type]
        feeds[spec.name] = rng.standard_normal(dims).astype(dtype) if dtype == np.float32 else rng.integers(0, 100, dims).astype(dtype)
    for _ in range(5):
        session.run(None, feeds)
    duration = 0.2 if ctx.settings.quick else CEILING_RUN_S
    best = 0.0
    for _ in range(CEILING_RUNS):
        runs, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < duration:
            session.run(None, feeds)
            runs += 1
        best = max(best, runs * batch / elapsed)
    return best


def level_dict(lv: LevelResult) -> dict[str, object]:
    srv = lv.server
    return {
        "requests": lv.requests, "errors": lv.errors, "duration_s": lv.duration_s, "throughput_rps": lv.throughput_rps,
        "rows_per_s": lv.rows_per_s, "p50_ms": ms(lv.latency.p50_us), "p90_ms": ms(lv.latency.p90_us),
        "p99_ms": ms(lv.latency.p99_us), "max_ms": ms(lv.latency.max_us), "mean_ms": ms(lv.latency.mean_us),
        "stable": lv.stable, "windows": lv.windows, "client_cpu": list(lv.client_cpu),
        "server": None if srv is None else {
            "requests": srv.requests, "inferences": srv.inferences, "executions": srv.executions,
            "avg_batch": srv.avg_batch, "queue_us": srv.queue_us, "compute_infer_us": srv.compute_infer_us,
        },
    }  # fmt: skip
