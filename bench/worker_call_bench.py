"""The gateway -> worker call: one unary ``ModelInfer`` per batch against one
long-lived bidirectional ``ModelStreamInfer`` stream per worker connection.

Starts one worker serving the example ``mlp`` and, in this process (on
uvloop when present, as the gateway), sends single-row batches with
``--inflight`` calls outstanding, first as unary calls, then as messages on
one stream (responses matched to requests by id), alternating for
``--rounds`` rounds. Reports calls/s and this process's CPU per call (what
the gateway would spend), plus the worker's, from /proc.

Run: ``python bench/worker_call_bench.py [--calls 4000] [--inflight 1,16]``.
The machine is shared: read the ratio of the two rows, not absolute values.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import grpc
import numpy as np
from tritonclient.grpc import service_pb2, service_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from loadtest.suite_procs import cpu_seconds  # noqa: E402
from tests.harness import start_worker, worker_url  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def request(i: int) -> service_pb2.ModelInferRequest:
    pb = service_pb2.ModelInferRequest(model_name="mlp", id=str(i))
    pb.inputs.add(name="INPUT", datatype="FP32", shape=[1, 64])
    pb.raw_input_contents.append(np.ones((1, 64), np.float32).tobytes())
    return pb


async def unary(stub: service_pb2_grpc.GRPCInferenceServiceStub, calls: int, inflight: int) -> None:
    pb = request(0)
    left = calls

    async def lane() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await stub.ModelInfer(pb, timeout=30)

    await asyncio.gather(*(lane() for _ in range(inflight)))


async def streamed(stub: service_pb2_grpc.GRPCInferenceServiceStub, calls: int, inflight: int) -> None:
    loop = asyncio.get_running_loop()
    call = stub.ModelStreamInfer()
    waiting: dict[str, asyncio.Future[service_pb2.ModelInferResponse]] = {}
    pbs = [request(i) for i in range(inflight)]

    async def read() -> None:
        async for answer in call:
            waiting.pop(answer.infer_response.id).set_result(answer.infer_response)

    reader = loop.create_task(read())
    left = calls
    # grpc.aio allows one write in flight per call: concurrent senders take turns.
    writing = asyncio.Lock()

    async def lane(pb: service_pb2.ModelInferRequest) -> None:
        nonlocal left
        while left > 0:
            left -= 1
            future = waiting[pb.id] = loop.create_future()
            async with writing:
                await call.write(pb)
            await future

    await asyncio.gather(*(lane(pb) for pb in pbs))
    await call.done_writing()
    await reader


async def measure(address: str, worker_pid: int, calls: int, inflight: int, rounds: int) -> dict[str, list[tuple[float, float, float]]]:
    channel = grpc.aio.insecure_channel(address)
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    await stub.ModelInfer(request(0), timeout=30)  # connect and warm the model
    found: dict[str, list[tuple[float, float, float]]] = {"unary": [], "stream": []}
    for _ in range(rounds):
        for name, run in (("unary", unary), ("stream", streamed)):
            cpu0, wcpu0, t0 = time.process_time(), cpu_seconds(worker_pid) or 0.0, time.perf_counter()
            await run(stub, calls, inflight)
            cpu1, wcpu1, t1 = time.process_time(), cpu_seconds(worker_pid) or 0.0, time.perf_counter()
            found[name].append((calls / (t1 - t0), (cpu1 - cpu0) / calls * 1e6, (wcpu1 - wcpu0) / calls * 1e6))
    await channel.close()
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=4000)
    parser.add_argument("--inflight", default="1,16")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    worker = start_worker(ROOT / "models", "--intra-op-threads", "1", "--log-level", "warning")
    try:
        print(f"{'in flight':>9} {'call':<7} {'calls/s':>9} {'caller CPU us/call':>19} {'worker CPU us/call':>19}")
        for inflight in (int(v) for v in args.inflight.split(",")):
            found = asyncio.run(measure(worker_url(worker), worker.pid, args.calls, inflight, args.rounds))
            for name, runs in found.items():
                rate, cpu, wcpu = (statistics.median(r[k] for r in runs) for k in range(3))
                print(f"{inflight:>9} {name:<7} {rate:>9,.0f} {cpu:>19.0f} {wcpu:>19.0f}")
    finally:
        worker.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
