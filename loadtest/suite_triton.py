"""The suite's ``triton`` section: ``bench/triton_compare.py`` in the suite's
table, so ``make bench`` reports the gateway in front of a real Triton server.

The script starts the Triton server bundled with ``nvidia-pytriton`` (the
Python-backend ``mlp``, its dynamic batcher on), an infergate worker, a
gateway in front of Triton with the relay lane (``relay: auto``), one with
``relay: off``, one in front of the worker, ``infergate serve`` and a bare
``grpc.aio`` server answering a prebuilt reply (the floor of a Python
server's work per request) and a bare ``grpc.aio`` proxy in front of the
same Triton (the floor of any Python hop in front of it), and measures each
at 1, 16 and 64 closed-loop gRPC clients with the CPU milliseconds per
request of the process the client talks to. Rows add two ratios: req/s over
Triton directly at the same level (the issue's targets: >= 0.5x at 1 and 16
clients, >= 0.55x at 64), and CPU per request over the bare server's
(targets: <= 1.3x on the relay lane, <= 2x on the full path). Two more read
each row against the bare proxy: its rate over the proxy's, and its CPU over
the proxy's, so a target a Python hop cannot reach on the machine shows as
one. Where no real Triton runs (not Linux x86_64, no ``nvidia-pytriton``)
the section fails saying so and the others run.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from loadtest.suite_context import SuiteContext
from loadtest.suite_procs import SuiteError
from loadtest.suite_report import Column, SectionResult

LEVELS = (1, 16, 64)
DIRECT = "triton direct"
FLOOR = "bare grpc.aio echo, no model"
PROXY = "bare grpc.aio proxy -> triton"


def triton_rows(results: Mapping[str, Mapping[int, Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """One row per target and level: its rate over Triton directly and over the bare proxy's, its CPU over
    the bare server's and over the bare proxy's."""

    def ratio(mine: float | None, target: str, clients: int, key: str) -> float | None:
        theirs = results.get(target, {}).get(clients, {}).get(key)
        return mine / theirs if mine and theirs else None

    rows = []
    for target, levels in results.items():
        for clients, r in sorted(levels.items()):
            rps, cpu = r["throughput_rps"], r.get("cpu_ms_per_request")
            rows.append({"target": target, "clients": clients, "rps": rps, "p99_ms": r["p99_ms"], "cpu_ms": cpu,
                         "vs_triton": ratio(rps, DIRECT, clients, "throughput_rps"),
                         "cpu_vs_floor": ratio(cpu, FLOOR, clients, "cpu_ms_per_request"),
                         "vs_proxy": ratio(rps, PROXY, clients, "throughput_rps"),
                         "cpu_vs_proxy": ratio(cpu, PROXY, clients, "cpu_ms_per_request"),
                         "errors": r["errors"]})
    return rows


def run_triton(ctx: SuiteContext) -> SectionResult:
    try:
        from bench import triton_compare
    except ImportError as exc:  # the repository's bench scripts, run from its root
        raise SuiteError(f"bench/triton_compare.py is not importable here: {exc}") from None
    window = 800 if ctx.settings.quick else 2000
    args = triton_compare.parse_args(["--concurrency", *map(str, LEVELS), "--measurement-ms", str(window),
                                      "--max-trials", "2" if ctx.settings.quick else "3"])
    try:
        results = triton_compare.measure(args, lambda line: ctx.progress(f"triton: {line}"))
    except RuntimeError as exc:
        raise SuiteError(str(exc)) from None
    return SectionResult(
        key="triton",
        title="In front of a real Triton server: the relay lane, the full path, and the floor of a Python server",
        columns=(
            Column("target", "target"), Column("clients", "clients"), Column("rps", "req/s", ",.0f"),
            Column("p99_ms", "p99 ms", ".1f"), Column("cpu_ms", "CPU ms/request", ".3f"),
            Column("vs_triton", "req/s vs Triton direct", ".2f"), Column("cpu_vs_floor", "CPU vs bare server", ".2f"),
            Column("vs_proxy", "req/s vs bare proxy", ".2f"), Column("cpu_vs_proxy", "CPU vs bare proxy", ".2f"),
            Column("errors", "errors"),
        ),
        rows=tuple(triton_rows(results)),
        notes=(
            "closed loop, gRPC, single-row mlp; Triton 2.51 as bundled with nvidia-pytriton (Python backend, its "
            f"dynamic batcher), {args.executors} single-threaded ONNX Runtime executors per server",
            "CPU ms/request: the CPU time of the process the client talks to over the level (Triton with its "
            "backend stubs when direct), over wall time and rate",
            "targets: gateway -> Triton >= 0.5x Triton directly at 1 and 16 clients, >= 0.55x at 64; CPU per "
            "request <= 1.3x the bare server's on the relay lane, <= 2x on the full path",
            "bare proxy: a grpc.aio server forwarding each call's bytes to the same Triton and the reply's bytes "
            "back, unparsed: the floor of a Python hop in front of Triton on this machine",
            "the clients share the machine's cores with every server: read ratios within one run",
        ),
        details={"results": {t: {str(c): r for c, r in levels.items()} for t, levels in results.items()}},
    )
