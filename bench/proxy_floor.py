"""What two gRPC hops cost in Python: the gateway against a bare grpc.aio proxy.

Starts one worker serving the example ``mlp``, the gateway in front of it
(adaptive batching, its defaults), a bare ``grpc.aio`` proxy in front of it,
and ``loadtest.echo_server`` (one hop, a prebuilt reply). The proxy is the
least a Python gRPC gateway can do per request: it forwards each call's
request bytes to the worker and the worker's reply bytes back, never parsing
either, one worker call per request (no batching, no validation, no routing);
a ``ModelStreamInfer`` call is relayed the same way, message by message
(``bench/openai_bench.py --proxy-floor`` measures generation through it).
Each of the four is driven in turn by ``infergate bench`` with single-row
gRPC requests at 1 and 64 clients, interleaved for ``--rounds`` rounds; the
report gives the median req/s, p50 and each server process's CPU per request
(from /proc over the level).

So at one client "proxy - worker" is what two hops add in latency with no
gateway logic at all, and "proxy CPU / echo CPU" what a second hop costs.

Run: ``python bench/proxy_floor.py [--rounds 3] [--clients 1,64]``; with
``--serve-proxy HOST:PORT`` it is the proxy process itself (the script
starts it so). The machine is shared: read ratios within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from loadtest.suite_context import SuiteContext, SuiteSettings, grpc_address  # noqa: E402
from loadtest.suite_procs import ProcessGroup, cpu_seconds  # noqa: E402
from serverkit import process  # noqa: E402
from serverkit.grpc_server import BURST_OPTIONS  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SERVICE = "inference.GRPCInferenceService"
# What `infergate bench` calls; each is forwarded as bytes.
METHODS = ("ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelConfig",
           "ModelStatistics", "ModelInfer")  # fmt: skip
MODEL = "mlp"


# ---- the proxy process ----------------------------------------------------------------


def _forward(channel: grpc.aio.Channel, method: str):  # type: ignore[no-untyped-def]
    call = channel.unary_unary(f"/{SERVICE}/{method}")  # no (de)serializers: bytes in, bytes out

    async def handler(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return await call(request, timeout=context.time_remaining())

    return handler


def _relay_stream(channel: grpc.aio.Channel):  # type: ignore[no-untyped-def]
    """``ModelStreamInfer`` relayed: one upstream call per call, messages forwarded as bytes both ways."""
    open_call = channel.stream_stream(f"/{SERVICE}/ModelStreamInfer")  # bytes in, bytes out

    async def handler(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        call = open_call(timeout=context.time_remaining())

        async def pump() -> None:
            async for request in requests:
                await call.write(request)
            await call.done_writing()

        sending = asyncio.get_running_loop().create_task(pump())
        try:
            async for response in call:
                yield response
        finally:
            sending.cancel()
            call.cancel()

    return handler


async def serve_proxy(upstream: str, ready_file: Path | None) -> int:
    channel = grpc.aio.insecure_channel(upstream)
    handlers = {m: grpc.unary_unary_rpc_method_handler(_forward(channel, m)) for m in METHODS}
    handlers["ModelStreamInfer"] = grpc.stream_stream_rpc_method_handler(_relay_stream(channel))
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0), *BURST_OPTIONS])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    process.write_ready_file(ready_file, {"grpc_port": port, "pid": os.getpid()})
    await stop.wait()
    await server.stop(None)
    await channel.close()
    if ready_file is not None:
        ready_file.unlink(missing_ok=True)
    return 0


# ---- the measurement ------------------------------------------------------------------


def measure(rounds: int, clients: list[int]) -> dict[tuple[str, int], list[tuple[float, float, float]]]:
    settings = SuiteSettings.for_run(ROOT / "models", False)
    results: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="proxy-floor-") as workdir:
        ctx = SuiteContext(settings, Path(workdir))
        with ProcessGroup(Path(workdir)) as procs:
            worker = ctx.start_workers(procs, 1)[0]
            upstream = grpc_address(worker)
            targets = {
                "worker": worker,
                "proxy": procs.start("proxy", ["--serve-proxy", upstream], module="bench.proxy_floor"),
                "gateway": ctx.start_gateway(procs, [upstream], {"batching": {"mode": "adaptive"}}, [MODEL]),
                "echo": procs.start("echo", ["--like", upstream, "--model", MODEL], module="loadtest.echo_server"),
            }
            for r in range(rounds):
                for n in clients:
                    for name, service in targets.items():
                        before, t0 = cpu_seconds(service.pid), time.monotonic()
                        level = ctx.bench(MODEL, grpc_address(service), "grpc", concurrency=n)
                        after, t1 = cpu_seconds(service.pid), time.monotonic()
                        cpu_us = (after - before) / (t1 - t0) / level.throughput_rps * 1e6  # type: ignore[operator]
                        results.setdefault((name, n), []).append((level.throughput_rps, level.latency.p50_us / 1e3, cpu_us))
                        print(f"round {r + 1}, {n} client(s), {name}: {level.throughput_rps:,.0f} req/s, "
                              f"p50 {level.latency.p50_us / 1e3:.2f} ms, {cpu_us:,.0f} us CPU/req", file=sys.stderr)
    return results


def report(results: dict[tuple[str, int], list[tuple[float, float, float]]], clients: list[int]) -> str:
    lines = ["| clients | server | req/s | p50 ms | added p50 ms | CPU us/req | CPU / echo |",
             "|---:|:---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for n in clients:
        med = {name: tuple(statistics.median(v[i] for v in runs) for i in range(3))
               for (name, c), runs in results.items() if c == n}  # fmt: skip
        for name in ("worker", "echo", "proxy", "gateway"):
            rps, p50, cpu = med[name]
            added = "" if name in ("worker", "echo") else f"{p50 - med['worker'][1]:+.2f}"
            lines.append(f"| {n} | {name} | {rps:,.0f} | {p50:.2f} | {added} | {cpu:,.0f} | {cpu / med['echo'][2]:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", default="1,64")
    parser.add_argument("--serve-proxy", metavar="HOST:PORT", help="run as the proxy in front of this server")
    parser.add_argument("--ready-file", type=Path)
    args = parser.parse_args(argv)
    if args.serve_proxy:
        process.set_switch_interval()
        process.install_event_loop_policy()
        return asyncio.run(serve_proxy(args.serve_proxy, args.ready_file))
    clients = [int(c) for c in args.clients.split(",")]
    print(report(measure(args.rounds, clients), clients))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
