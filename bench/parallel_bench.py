"""Model parallelism: ``encoder`` unsplit vs TP2 vs PP2 vs hybrid (2 x TP2),
each on peer collectives and, for comparison, on the gateway's star; with
``--large``, ``encoder_large`` unsplit on one worker vs TP2 (peers and
star), TP4 (a ring on peers) and PP2.

One gateway core runs in this process in front of N worker processes
(``infergate worker``, as ``infergate up`` starts them, one intra-op thread
each: one-device servers) with a config that declares the logical models;
with ``--large`` only worker 0 holds the unsplit model, so it is compared
with exactly one server's worth of compute. Requests go straight into the core
(``Gateway.infer``), so every row pays the same gateway path -- validation,
batching, routing or the plan -- and none pays a frontend or a client
library, which would be the same for all rows. Measured per model:

* latency: sequential single-row requests, in interleaved blocks so drift
  in the machine's load hits every model alike (p50 / p99, ms);
* throughput: ``clients`` concurrent single-row loops for ``duration_s``
  (rows/s), with the mean batch the gateway formed;
* for split models, from the registry's counters: shard calls, bytes moved,
  time waiting on workers and the gateway's side of the collectives
  (decode, sum/concatenate, encode between segments) per batch.

Run: ``python bench/parallel_bench.py [--workers 4] [--json out.json]``, or
call :func:`run_parallel_bench` for the rows. On a small machine the workers
share its cores, so read the rows as ratios, not capacities.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from gateway.composition import build_gateway
from gateway.core import Gateway
from gateway.settings import GatewayConfig, WorkerSpec
from gateway.types import InferRequest, Tensor
from gateway.up import LocalWorker

MODELS: dict[str, dict[str, Any]] = {
    "encoder_tp2": {"from": "encoder", "tensor_parallel": 2},
    "encoder_tp2_star": {"from": "encoder", "tensor_parallel": 2, "collectives": "gateway"},
    "encoder_pp2": {"from": "encoder", "pipeline_parallel": 2},
    "encoder_pp2_star": {"from": "encoder", "pipeline_parallel": 2, "collectives": "gateway"},
    "encoder_hybrid": {"from": "encoder", "tensor_parallel": 2, "replicas": 2},
}
LARGE_MODELS: dict[str, dict[str, Any]] = {
    "encoder_large_tp2": {"from": "encoder_large", "tensor_parallel": 2},
    "encoder_large_tp2_star": {"from": "encoder_large", "tensor_parallel": 2, "collectives": "gateway"},
    "encoder_large_tp4": {"from": "encoder_large", "tensor_parallel": 4},
    "encoder_large_pp2": {"from": "encoder_large", "pipeline_parallel": 2},
}
WORKER_ARGS = ["--log-level", "warning", "--intra-op-threads", "1", "--execution-threads", "1"]
ROWS = ["encoder", *MODELS]


def _request(model: str, x: np.ndarray) -> InferRequest:
    return InferRequest(model=model, version="", id="", inputs=[Tensor("TOKENS", "INT64", x.shape, x.tobytes())], outputs=[])


async def _latency(gateway: Gateway, rows: list[str], x: np.ndarray, requests: int, block: int) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {m: [] for m in rows}
    while any(len(s) < requests for s in samples.values()):
        for model in rows:
            for _ in range(min(block, requests - len(samples[model]))):
                t0 = time.perf_counter()
                await gateway.infer(_request(model, x))
                samples[model].append(time.perf_counter() - t0)
    return samples


async def _throughput(gateway: Gateway, model: str, x: np.ndarray, clients: int, duration_s: float) -> float:
    stop_at = time.perf_counter() + duration_s
    rows = 0

    async def loop() -> None:
        nonlocal rows
        while time.perf_counter() < stop_at:
            await gateway.infer(_request(model, x))
            rows += x.shape[0]

    t0 = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(clients)))
    return rows / (time.perf_counter() - t0)


def _delta(after: Any, before: Any) -> dict[str, float]:
    keys = ("batches", "shard_calls", "remote_s", "collective_s", "plan_s", "bytes_sent", "bytes_received", "peer_bytes")
    return {k: getattr(after, k) - getattr(before, k) for k in keys}


async def measure(
    model_repository: Path,
    *,
    large: bool = False,
    workers: int = 4,
    seq: int = 32,
    requests: int = 200,
    block: int = 20,
    clients: int = 64,
    duration_s: float = 5.0,
    addresses: list[str] | None = None,
) -> dict[str, dict[str, float]]:
    """Rows of :func:`run_parallel_bench`; with ``addresses``, on those running workers
    (``workers`` is then ignored) instead of ``workers`` local ones started here."""
    workdir = Path(tempfile.mkdtemp(prefix="parallel-bench-"))
    models, baseline = (LARGE_MODELS, "encoder_large") if large else (MODELS, "encoder")
    names = [baseline, *models]
    # --large: the unsplit model on worker 0 only; the others start empty and get shards pushed.
    extra = [["--model-control-mode", "explicit", *(["--load-model", baseline] if i == 0 or not large else [])]
             for i in range(workers)]
    procs = [] if addresses else [LocalWorker(i, str(model_repository), [*WORKER_ARGS, *extra[i]], workdir)
                                  for i in range(workers)]
    gateway: Gateway | None = None
    try:
        await asyncio.gather(*(w.start() for w in procs))
        targets = addresses or [w.address for w in procs]
        config = GatewayConfig(workers=tuple(WorkerSpec(a) for a in targets), models=models,
                               model_repository=str(model_repository))
        gateway = build_gateway(config)
        await gateway.start()
        x = np.random.default_rng(0).integers(0, 100, size=(1, seq)).astype(np.int64)
        await _latency(gateway, names, x, 3 if large else 20, 20)  # warm up every path (sessions, channels, batchers)

        before = gateway.parallel.stats()
        lat = await _latency(gateway, names, x, requests, block)
        per_request = {m: _delta(s, before[m]) for m, s in gateway.parallel.stats().items()}

        rows: dict[str, dict[str, float]] = {}
        for model in names:
            stats_before = gateway.parallel.stats().get(model)
            executions_before = _executions(gateway, model)
            rate = await _throughput(gateway, model, x, clients, duration_s)
            executions = _executions(gateway, model) - executions_before
            ms = np.array(lat[model]) * 1e3
            row: dict[str, float] = {
                "p50_ms": float(np.percentile(ms, 50)),
                "p99_ms": float(np.percentile(ms, 99)),
                "mean_ms": float(statistics.fmean(ms)),
                "rows_per_s": rate,
                "mean_batch": (rate * duration_s / executions) if executions else float("nan"),
            }
            if model in per_request:
                d = per_request[model]
                n = max(d["batches"], 1)
                row.update({
                    "shard_calls_per_req": d["shard_calls"] / n,
                    "remote_ms_per_req": d["remote_s"] / n * 1e3,
                    "collective_ms_per_req": d["collective_s"] / n * 1e3,
                    "kib_moved_per_req": (d["bytes_sent"] + d["bytes_received"]) / n / 1024,
                    "peer_kib_per_req": d["peer_bytes"] / n / 1024,
                })
                loaded = _delta(gateway.parallel.stats()[model], stats_before)
                m = max(loaded["batches"], 1)
                row["collective_ms_per_batch_loaded"] = loaded["collective_s"] / m * 1e3
            rows[model] = row
        return rows
    finally:
        if gateway is not None:
            await gateway.stop(5.0)
        await asyncio.gather(*(w.stop(10.0) for w in procs), return_exceptions=True)


def _executions(gateway: Gateway, model: str) -> int:
    response = gateway.stats.to_proto(model, "1", [(model, "1")])
    return sum(s.execution_count for s in response.model_stats)


def run_parallel_bench(model_repository: str | Path, **options: Any) -> dict[str, dict[str, float]]:
    """Rows keyed by model (``encoder`` and its splits; with ``large=True``, ``encoder_large`` and its splits).

    Each row: ``p50_ms``, ``p99_ms``, ``mean_ms`` (sequential single-row
    latency), ``rows_per_s`` and ``mean_batch`` (``clients`` concurrent
    single-row loops); split models add ``shard_calls_per_req``,
    ``remote_ms_per_req``, ``collective_ms_per_req``, ``kib_moved_per_req``
    ``peer_kib_per_req`` (from the latency phase, one request per batch) and
    ``collective_ms_per_batch_loaded`` (throughput phase). Options: see
    :func:`measure`. Runs its own event loop: call it from synchronous code.
    """
    return asyncio.run(measure(Path(model_repository), **options))


def format_rows(rows: dict[str, dict[str, float]]) -> str:
    head = ["model", "p50 ms", "p99 ms", "rows/s", "batch", "calls/req", "remote ms", "collective ms", "KiB/req",
            "peer KiB/req"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for model, r in rows.items():
        cells = [model, f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}", f"{r['rows_per_s']:.0f}", f"{r['mean_batch']:.1f}"]
        if "shard_calls_per_req" in r:
            cells += [f"{r['shard_calls_per_req']:.0f}", f"{r['remote_ms_per_req']:.2f}",
                      f"{r['collective_ms_per_req']:.2f}", f"{r['kib_moved_per_req']:.0f}",
                      f"{r['peer_kib_per_req']:.0f}"]
        else:
            cells += ["1", "-", "-", "-", "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-repository", type=Path, help="built example repository (default: build one)")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32, help="tokens per request")
    parser.add_argument("--requests", type=int, default=200, help="latency samples per model")
    parser.add_argument("--block", type=int, default=20,
                        help="latency requests per model before the next model's turn (1: strictly interleaved)")
    parser.add_argument("--clients", type=int, default=64, help="concurrent single-row loops for throughput")
    parser.add_argument("--duration-s", type=float, default=5.0)
    parser.add_argument("--large", action="store_true",
                        help="encoder_large (the repository must hold it: `infergate models build DIR --large`)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    repo = args.model_repository
    if repo is None:
        from models.build import build_repository

        repo = Path(tempfile.mkdtemp(prefix="parallel-bench-models-")) / "models"
        build_repository(repo, large=args.large)
    rows = run_parallel_bench(repo, large=args.large, workers=args.workers, seq=args.seq, requests=args.requests,
                              block=args.block, clients=args.clients, duration_s=args.duration_s)
    print(format_rows(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
