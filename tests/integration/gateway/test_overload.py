"""Overload and deadlines with real processes: one simulated worker runs
``mlp`` at about 50 requests/s (two batches in flight, 40 ms each, unbatched).

Overload: closed-loop clients offer far more than that for a bounded time
while the gateway's resident memory is sampled from /proc. Asserted: the
memory stays under a stated bound; every request is answered exactly once,
served or refused with UNAVAILABLE / 503 and a Retry-After hint (never a
timeout, never another error); refusals come back much faster than served
requests; high-priority clients are never refused (the priority reserve and
the priority queue shed the lowest first); afterwards the gateway serves
normally again.

Deadlines: requests still queued at their deadline (gRPC deadline, HTTP
``X-Request-Timeout-Ms``) are answered DEADLINE_EXCEEDED / 504 and never
reach the worker; a model's own queue policy answers as Triton does.

Timings are printed, not asserted, except as ratios between two kinds of answer.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from tests.harness import Proc, start, start_worker, worker_url
from tests.integration.steady_load import Ledger, SteadyLoad

pytestmark = pytest.mark.timeout(240)

# The gateway's resident memory may grow by at most this much over its idle
# size while overloaded (it serves nothing larger than a few KB per request).
RSS_GROWTH_BOUND_MB = 64.0
OVERLOAD_REQUESTS = 6000
GATEWAY_CONFIG = """
default_timeout_s: 30
batching: {max_inflight_per_replica: 2}
admission: {max_inflight_requests: 32, priority_reserve_percent: 10}
models:
  mlp: {mode: "off", priority_levels: 2, default_priority_level: 2}
  simple: {mode: "off", default_timeout_us: 100000, timeout_action: REJECT}
"""


@pytest.fixture(scope="module")
def processes(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, Proc]]:
    """(gateway, worker)."""
    config = tmp_path_factory.mktemp("overload") / "gateway.yaml"
    config.write_text(GATEWAY_CONFIG)
    worker = start_worker(model_repo, "--backend", "sim", "--sim-latency-ms", "40")
    proc = None
    try:
        proc = start(["gateway", "--worker", worker_url(worker), "--http-port", "0", "--grpc-port", "0",
                      "--config", str(config)])
        yield proc, worker
    finally:
        if proc is not None:
            proc.stop()
        worker.stop()


@pytest.fixture(scope="module")
def gateway(processes: tuple[Proc, Proc]) -> Proc:
    return processes[0]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc status")


async def sample_rss(pid: int, samples: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        samples.append(rss_mb(pid))
        try:
            await asyncio.wait_for(stop.wait(), 0.1)
        except asyncio.TimeoutError:
            pass


def latencies(ledger: Ledger, ok: bool) -> list[float]:
    return [o.latency_s for o in ledger.outcomes.values() if o.ok is ok]


async def test_overload_is_refused_fast_with_bounded_memory_and_recovers(gateway: Proc) -> None:
    ports = gateway.ready["grpc_port"], gateway.ready["http_port"]
    warm = await SteadyLoad(*ports, grpc_clients=2, http_clients=1, prefix="warm").start()
    await warm.until_ok(60)
    assert not (await warm.stop()).failures()
    idle_mb = rss_mb(gateway.pid)

    samples: list[float] = []
    stop_sampling = asyncio.Event()
    sampler = asyncio.create_task(sample_rss(gateway.pid, samples, stop_sampling))
    low = await SteadyLoad(*ports, grpc_clients=48, http_clients=16, timeout_s=20, prefix="low").start()
    high = await SteadyLoad(*ports, grpc_clients=2, http_clients=0, timeout_s=20, prefix="high", priority=1).start()
    started = time.monotonic()
    try:
        while len(low.ledger.outcomes) < OVERLOAD_REQUESTS:
            await low.until_ok(1, timeout_s=60)
    finally:
        low_ledger = await low.stop()
        high_ledger = await high.stop()
        elapsed = time.monotonic() - started
        stop_sampling.set()
        await sampler
    peak_mb = max(samples)

    served, refused = latencies(low_ledger, True), latencies(low_ledger, False)
    print(f"overload: {len(low_ledger.sent) + len(high_ledger.sent)} requests in {elapsed:.1f}s "
          f"({(len(low_ledger.sent) + len(high_ledger.sent)) / elapsed:.0f}/s offered), "
          f"{low_ledger.ok + high_ledger.ok} served, {len(refused)} refused; "
          f"median refusal {statistics.median(refused) * 1e3:.1f} ms, median served "
          f"{statistics.median(served) * 1e3:.1f} ms, high priority {high_ledger.ok} served "
          f"(median {statistics.median(latencies(high_ledger, True)) * 1e3:.1f} ms); "
          f"gateway RSS idle {idle_mb:.0f} MB, peak {peak_mb:.0f} MB")

    # Memory: bounded, whatever was offered.
    assert peak_mb - idle_mb < RSS_GROWTH_BOUND_MB, (idle_mb, peak_mb)
    for ledger in (low_ledger, high_ledger):
        ledger.check_exactly_once()
    # Refused at the door with a hint, never timed out in a queue; nothing else went wrong.
    assert set(low_ledger.codes()) <= {"OK", "UNAVAILABLE", "HTTP 503"}, low_ledger.codes()
    assert refused and served
    assert all(o.retry_after is not None and int(o.retry_after) >= 1 for o in low_ledger.failures())
    # Refusals do not wait for the device; served requests do.
    assert statistics.median(refused) < statistics.median(served) / 2
    # The lowest priority is shed first: high-priority clients were all served.
    assert high_ledger.failures() == [] and high_ledger.ok > 0

    # Recovery: at an ordinary load, everything is served again.
    after = await SteadyLoad(*ports, grpc_clients=2, http_clients=1, prefix="after").start()
    await after.until_ok(60)
    after_ledger = await after.stop()
    assert after_ledger.failures() == []
    after_ledger.check_exactly_once()
    assert rss_mb(gateway.pid) - idle_mb < RSS_GROWTH_BOUND_MB


async def executed(worker: Proc, model: str) -> int:
    """Inferences the worker itself has run for ``model``."""
    async with grpc.aio.insecure_channel(worker_url(worker)) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        stats = await stub.ModelStatistics(service_pb2.ModelStatisticsRequest(name=model), timeout=10)
    return sum(s.inference_stats.success.count for s in stats.model_stats)


async def test_expired_requests_are_answered_and_never_run(processes: tuple[Proc, Proc]) -> None:
    """A burst the worker needs ~0.8 s for, with deadlines of 0.3 s: the requests still
    queued at their deadline get DEADLINE_EXCEEDED / 504 (gRPC deadline, HTTP
    X-Request-Timeout-Ms) and the worker never runs them. A model whose own queue
    policy times out first answers as Triton does: UNAVAILABLE "Request timeout expired"."""
    gateway, worker = processes
    before = await executed(worker, "mlp")
    row = np.zeros((1, 64), np.float32)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.ready['grpc_port']}") as channel, \
            aiohttp.ClientSession() as http:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)

        async def over_grpc(i: int) -> str:
            pb = service_pb2.ModelInferRequest(model_name="mlp", id=f"g{i}")
            pb.inputs.add(name="INPUT", datatype="FP32", shape=[1, 64])
            pb.raw_input_contents.append(row.tobytes())
            try:
                return "OK" if (await stub.ModelInfer(pb, timeout=0.3)).id == f"g{i}" else "WRONG ID"
            except grpc.aio.AioRpcError as e:
                return e.code().name

        async def over_http(i: int, model: str = "mlp") -> str:
            name, shape = ("INPUT", [1, 64]) if model == "mlp" else ("INPUT0", [1, 16])
            inputs = [{"name": n, "datatype": "FP32" if model == "mlp" else "INT32", "shape": shape,
                       "data": [0] * shape[1]} for n in ([name] if model == "mlp" else ["INPUT0", "INPUT1"])]
            headers = {"X-Request-Timeout-Ms": "300"} if model == "mlp" else {}
            async with http.post(f"http://127.0.0.1:{gateway.ready['http_port']}/v2/models/{model}/infer",
                                 json={"id": f"h{i}", "inputs": inputs}, headers=headers) as r:
                body = await r.json()
                return "OK" if r.status == 200 and body["id"] == f"h{i}" else f"HTTP {r.status}: {body.get('error')}"

        answers = await asyncio.gather(*(over_grpc(i) for i in range(10)), *(over_http(i) for i in range(10)))
        queue_policy = await asyncio.gather(*(over_http(100 + i, "simple") for i in range(20)))
    ran = await executed(worker, "mlp") - before
    print(f"deadlines: mlp answers {sorted(set(answers))}, ran {ran} of {len(answers)}; "
          f"simple (queue policy) {sorted(set(queue_policy))}")
    assert all(a in ("OK", "DEADLINE_EXCEEDED") or a.startswith("HTTP 504: ") for a in answers), answers
    assert "DEADLINE_EXCEEDED" in answers and any(a.startswith("HTTP 504: ") for a in answers)
    # What expired while queued never reached the worker.
    assert ran < len(answers)
    assert ran >= answers.count("OK")
    assert set(queue_policy) <= {"OK", "HTTP 503: Request timeout expired"}, queue_policy
    assert "HTTP 503: Request timeout expired" in queue_policy
