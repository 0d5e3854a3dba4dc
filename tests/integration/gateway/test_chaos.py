"""Chaos under a steady load, with real processes: a gateway in front of two
simulated-accelerator workers serving ``mlp`` (two replicas) while workers
are killed (SIGKILL), hung (SIGSTOP), slowed down (restarted with a higher
``--sim-latency-ms``) and restarted on their ports. Asserted: zero failed
requests, every request answered exactly once (each echoes its own unique
id), and each worker back in rotation after its restart. Then every worker
disappears at once (fast 503s, the gateway lives on and recovers), and last
SIGTERM drains the gateway (health NOT_SERVING, in-flight requests finish).

Outcomes are asserted, never timings; waits are on conditions (requests
answered, a worker's own statistics growing).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from tests.harness import Proc, start, start_together, start_worker, worker_url
from tests.integration.steady_load import MODEL, SteadyLoad

pytestmark = pytest.mark.timeout(300)

NORMAL_LATENCY_MS = "2"
SLOW_LATENCY_MS = "250"
DRAIN_LATENCY_MS = "1500"
GATEWAY_CONFIG = """
probe: {interval_s: 0.5, failures_to_down: 2}
default_timeout_s: 30
outlier: {base_ejection_s: 1.0, max_ejection_s: 10.0}
hedge: {hang_min_s: 0.5}
shutdown_grace_s: 20
models:
  simple: {mode: "off"}
"""


@dataclass
class Cluster:
    repo: Path
    workers: list[Proc]
    gateway: Proc

    def worker_args(self, latency_ms: str) -> list[str]:
        return ["--backend", "sim", "--sim-latency-ms", latency_ms, "--grace-period", "5"]

    def restart(self, index: int, latency_ms: str = NORMAL_LATENCY_MS) -> None:
        """Start worker ``index`` again on its old port (the old process must be gone)."""
        port = self.workers[index].ready["grpc_port"]
        self.workers[index] = start_worker(self.repo, *self.worker_args(latency_ms), "--port", str(port))
        assert self.workers[index].ready["grpc_port"] == port

    def restart_all(self, latency_ms: str = NORMAL_LATENCY_MS) -> None:
        """Stop every worker still running (a clean exit), then start them all again on their old
        ports, side by side."""
        for w in self.workers:
            if w.popen.poll() is None:
                w.stop()
        old = [w.ready["grpc_port"] for w in self.workers]
        args = self.worker_args(latency_ms)
        self.workers[:] = start_together([lambda p=p: start_worker(self.repo, *args, "--port", str(p)) for p in old])
        assert [w.ready["grpc_port"] for w in self.workers] == old


@pytest.fixture(scope="module")
def cluster(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    config = tmp_path_factory.mktemp("chaos") / "gateway.yaml"
    config.write_text(GATEWAY_CONFIG)
    args = ["--backend", "sim", "--sim-latency-ms", NORMAL_LATENCY_MS, "--grace-period", "5"]
    workers = start_together([lambda: start_worker(model_repo, *args)] * 2)
    gateway = start(["gateway", *(a for w in workers for a in ("--worker", worker_url(w))),
                     "--http-port", "0", "--grpc-port", "0", "--config", str(config)])
    c = Cluster(model_repo, workers, gateway)
    try:
        yield c
    finally:
        for w in c.workers:
            if w.popen.poll() is None:
                os.kill(w.pid, signal.SIGCONT)
        c.gateway.stop()
        for w in c.workers:
            w.stop()


async def served_by(worker: Proc) -> int:
    """How many ``mlp`` inferences the worker itself has run (its own statistics)."""
    async with grpc.aio.insecure_channel(worker_url(worker)) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        stats = await stub.ModelStatistics(service_pb2.ModelStatisticsRequest(name=MODEL), timeout=10)
    return sum(s.inference_stats.success.count for s in stats.model_stats)


async def until_serving(load: SteadyLoad, worker: Proc, timeout_s: float = 60.0) -> None:
    """Wait until the gateway sends ``worker`` work again (its own count grows under the load)."""
    before = await served_by(worker)
    deadline = time.monotonic() + timeout_s
    while await served_by(worker) <= before:
        assert time.monotonic() < deadline, f"worker {worker_url(worker)} never rejoined"
        await load.until_ok(20)


async def test_faults_under_steady_load_lose_no_request(cluster: Cluster) -> None:
    load = await SteadyLoad(cluster.gateway.ready["grpc_port"], cluster.gateway.ready["http_port"],
                            grpc_clients=6, http_clients=2, prefix="chaos").start()
    faults: list[str] = []
    try:
        await load.until_ok(200)
        for w in cluster.workers:
            await until_serving(load, w)  # both replicas take work

        # 1. SIGKILL: in-flight batches on it fail over; it restarts on its port and rejoins.
        cluster.workers[0].kill(signal.SIGKILL)
        faults.append("SIGKILL")
        await load.until_ok(200)
        await asyncio.to_thread(cluster.restart, 0)
        await until_serving(load, cluster.workers[0])

        # 2. SIGSTOP: the worker accepts and never answers; found by time, not errors.
        # Every request in flight when it stopped, and the next hundred, is answered
        # while it is still stopped: none waits for it.
        os.kill(cluster.workers[1].pid, signal.SIGSTOP)
        faults.append("SIGSTOP")
        caught = load.outstanding()
        first_after = len(load.ledger.sent)
        await load.until_ok(400)
        caught |= set(load.ledger.sent[first_after:first_after + 100])
        await load.until_answered(caught)
        os.kill(cluster.workers[1].pid, signal.SIGCONT)
        await until_serving(load, cluster.workers[1])

        # 3. Slow: restarted with a much higher simulated latency, then back to normal.
        await asyncio.to_thread(cluster.workers[0].stop)
        await asyncio.to_thread(cluster.restart, 0, SLOW_LATENCY_MS)
        faults.append("slow worker")
        await until_serving(load, cluster.workers[0])
        await load.until_ok(600)
        await asyncio.to_thread(cluster.workers[0].stop)
        await asyncio.to_thread(cluster.restart, 0)
        faults.append("restart")
        await until_serving(load, cluster.workers[0])
        await load.until_ok(200)
    finally:
        ledger = await load.stop()
    async with aiohttp.ClientSession() as http:
        retried = sum(w["retries"] for w in await _routing(http, cluster.gateway))
    print(f"chaos: {len(ledger.sent)} requests, {ledger.ok} ok, faults: {', '.join(faults)}, "
          f"batches retried after a worker failed: {retried}, codes {dict(ledger.codes())}")
    assert ledger.failures() == [], f"failed requests: {ledger.failures()[:5]}"
    ledger.check_exactly_once()
    assert ledger.ok == len(ledger.sent) >= 1500


async def test_every_worker_gone_then_back(cluster: Cluster) -> None:
    for w in cluster.workers:
        w.kill(signal.SIGKILL)
    load = await SteadyLoad(cluster.gateway.ready["grpc_port"], cluster.gateway.ready["http_port"],
                            grpc_clients=2, http_clients=1, timeout_s=10, prefix="gone").start()
    try:
        # With no replica left, requests fail at once with UNAVAILABLE / 503, never hang to their deadline.
        while len(load.ledger.outcomes) < 100:
            await asyncio.sleep(0.05)
        codes = set(load.ledger.codes())
        assert codes <= {"UNAVAILABLE", "HTTP 503", "OK"}, codes
        assert {"UNAVAILABLE", "HTTP 503"} <= codes
        assert cluster.gateway.popen.poll() is None
        await asyncio.to_thread(cluster.restart_all)
        for w in cluster.workers:
            await until_serving(load, w)
        await load.until_ok(100)
    finally:
        ledger = await load.stop()
    ledger.check_exactly_once()
    late = [o for o in ledger.failures() if o.latency_s > 5]
    assert not late, f"failures that waited instead of failing fast: {late[:3]}"


async def test_sigterm_drains_in_flight_requests(cluster: Cluster) -> None:
    """Runs last: it stops the gateway. Slow workers keep requests in flight while it drains.

    ``simple`` runs unbatched here (``mode: off``), so four requests are four
    batches and the gateway's routing counters say when all four are on workers.
    """
    await asyncio.to_thread(cluster.restart_all, DRAIN_LATENCY_MS)
    gateway = cluster.gateway
    async with aiohttp.ClientSession() as http:
        while {w["state"] for w in await _routing(http, gateway)} != {"ready"}:
            await asyncio.sleep(0.05)  # polling a condition: both restarted workers back in rotation
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.ready['grpc_port']}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        watch = health.Watch(health_pb2.HealthCheckRequest(service=""))
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        # A first round through the restarted workers: a call that meets the old
        # process's connection is retried (answered, but late), which would keep
        # the four calls below from all being in flight at once.
        warm = await asyncio.gather(*(_infer_simple(stub, f"warm-{i}") for i in range(4)))
        assert warm == [f"warm-{i}" for i in range(4)]
        calls = [asyncio.create_task(_infer_simple(stub, f"drain-{i}")) for i in range(4)]
        async with aiohttp.ClientSession() as http:
            while sum(w["inflight"] for w in await _routing(http, gateway)) < len(calls):
                assert not any(c.done() for c in calls), [c.result() for c in calls if c.done()]
                await asyncio.sleep(0.05)
        gateway.popen.send_signal(signal.SIGTERM)
        # Health turns NOT_SERVING first thing, while the requests are still running.
        update = await watch.read()
        assert update.status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert not any(c.done() for c in calls)
        later = await _infer_simple(stub, "after-sigterm")
        answers = await asyncio.gather(*calls)
    # A clean exit, well within the grace period (health watchers do not hold it open).
    assert await asyncio.to_thread(gateway.popen.wait, 15) == 0
    # Every request in flight when the signal came finished, successfully; a new one was refused.
    assert answers == [f"drain-{i}" for i in range(4)]
    # Refused, never served: rejected by the core (UNAVAILABLE), or held by gRPC
    # while the listener closed and cancelled at the end (CANCELLED).
    assert later in ("UNAVAILABLE", "CANCELLED")


async def _infer_simple(stub: service_pb2_grpc.GRPCInferenceServiceStub, request_id: str) -> str:
    """The echoed id of a ``simple`` inference, or the gRPC status name it failed with."""
    pb = service_pb2.ModelInferRequest(model_name="simple", id=request_id)
    for name in ("INPUT0", "INPUT1"):
        pb.inputs.add(name=name, datatype="INT32", shape=[1, 16])
        pb.raw_input_contents.append(bytes(64))
    try:
        return (await stub.ModelInfer(pb, timeout=30)).id
    except grpc.aio.AioRpcError as e:
        return e.code().name


async def _routing(http: aiohttp.ClientSession, gateway: Proc) -> list[dict[str, Any]]:
    async with http.get(f"http://127.0.0.1:{gateway.ready['http_port']}/v2/cluster/stats") as r:
        assert r.status == 200
        return list((await r.json())["workers"])
