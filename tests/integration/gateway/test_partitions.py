"""Partitions under a steady load: simulated-accelerator workers each behind
their own network link (tests/netsim.py), a gateway in the root namespace,
and links cut while every process keeps running.

- A worker cut off mid-batch (alive, unreachable): the batches in flight on
  it are answered elsewhere while it is still cut off, it is marked down,
  and it rejoins once its link returns, with no restart.
- A flapping link (down and up every second or so): the worker goes in and
  out of rotation a bounded number of times and no healthy worker is ever
  ejected (no ejection storm).
- Two gateways, only one of which loses a worker: both keep serving, and
  once the link returns their placements agree again.

Every request carries a unique id: 0 lost, each answered exactly once.
Waits are on conditions; links are flipped on a clock only to make a flap.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import grpc
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from tests.harness import Proc, start, start_together
from tests.integration.steady_load import MODEL, Ledger, SteadyLoad
from tests.netsim import Host, NetSim

pytestmark = pytest.mark.timeout(180)

GATEWAY_CONFIG = """
probe: {interval_s: 0.3, failures_to_down: 2, timeout_s: 1.0}
default_timeout_s: 20
hedge: {hang_min_s: 0.5}
outlier: {base_ejection_s: 1.0, max_ejection_s: 5.0}
shutdown_grace_s: 10
"""
WORKER_ARGS = ("--backend", "sim", "--sim-latency-ms", "20", "--grace-period", "5")


def start_gateway(net: NetSim, workers: list[tuple[Host, Proc]], config: Path, host: Host | None = None) -> Proc:
    """A gateway in front of ``workers``: in the root namespace, or in ``host``'s."""
    args = ["gateway", *(a for h, w in workers for a in ("--worker", f"{h.address}:{w.ready['grpc_port']}")),
            "--http-port", "0", "--grpc-port", "0", "--config", str(config)]
    if host is None:
        return start(args)
    return net.start(host, [*args, "--host", host.address])


def fleet(net: NetSim, repo: Path, count: int, *extra: str) -> list[tuple[Host, Proc]]:
    hosts = [net.add_host(f"w{i}") for i in range(count)]
    workers = start_together([lambda h=h: net.start_worker(h, repo, *WORKER_ARGS, *extra) for h in hosts])
    return list(zip(hosts, workers))


async def served_by(host: Host, worker: Proc) -> int:
    """How many ``mlp`` inferences the worker itself has run (its own statistics)."""
    async with grpc.aio.insecure_channel(f"{host.address}:{worker.ready['grpc_port']}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        stats = await stub.ModelStatistics(service_pb2.ModelStatisticsRequest(name=MODEL), timeout=10)
    return sum(s.inference_stats.success.count for s in stats.model_stats)


async def until_serving(load: SteadyLoad, host: Host, worker: Proc, timeout_s: float = 30.0) -> None:
    """Wait until the gateway sends the worker work (its own count grows under the load)."""
    before = await served_by(host, worker)
    deadline = time.monotonic() + timeout_s
    while await served_by(host, worker) <= before:
        assert time.monotonic() < deadline, f"worker {host.address} never took work"
        await load.until_ok(10)


async def worker_states(gateway: Proc, address: str = "127.0.0.1") -> dict[str, str]:
    """Worker host -> state, as the gateway's ``/v2/cluster/stats`` shows it."""
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://{address}:{gateway.ready['http_port']}/v2/cluster/stats") as r:
            assert r.status == 200
            return {w["address"].rpartition(":")[0]: w["state"] for w in (await r.json())["workers"]}


async def until(condition: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)  # polling a condition


def transitions(gateway: Proc, address: str) -> dict[str, int]:
    """How often the gateway's log says ``address`` was marked down or ejected."""
    log = gateway.log()
    pattern = re.escape(address) + r":\d+"
    return {"down": len(re.findall(rf"worker {pattern} marked DOWN", log)),
            "ejected": len(re.findall(rf"worker {pattern} ejected for", log))}


def check(ledger: Ledger, at_least: int) -> None:
    assert ledger.failures() == [], f"failed requests: {ledger.failures()[:5]}"
    ledger.check_exactly_once()
    assert ledger.ok == len(ledger.sent) >= at_least


async def test_worker_cut_off_mid_batch_rejoins_without_restart(
    netsim: NetSim, model_repo: Path, tmp_path: Path
) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text(GATEWAY_CONFIG)
    workers = fleet(netsim, model_repo, 2)
    gateway = start_gateway(netsim, workers, config)
    (cut_host, cut_worker), _ = workers
    load = await SteadyLoad(gateway.ready["grpc_port"], gateway.ready["http_port"], prefix="cut").start()
    try:
        await load.until_ok(100)
        for h, w in workers:
            await until_serving(load, h, w)
        # Cut while its batches are in flight: each must be answered elsewhere while it is still cut off.
        caught = load.outstanding()
        await asyncio.to_thread(netsim.cut, cut_host)
        await load.until_answered(caught)
        await until(lambda: _state_is(gateway, cut_host, "down"), "the cut-off worker to be marked down")
        await load.until_ok(100)
        assert cut_worker.popen.poll() is None  # alive all along, only unreachable
        await asyncio.to_thread(netsim.restore, cut_host)
        await until(lambda: _state_is(gateway, cut_host, "ready"), "the worker to rejoin")
        await until_serving(load, cut_host, cut_worker)
        await load.until_ok(50)
    finally:
        ledger = await load.stop()
        gateway.stop()
        for _, w in workers:
            w.stop()
    print(f"cut: {len(ledger.sent)} requests, {len(caught)} in flight at the cut, {transitions(gateway, cut_host.address)}")
    check(ledger, 300)


FLAPS = 4
FLAP_HALF_PERIOD_S = 1.5
# Probes bounded well below a cut's length, so each cut is long enough to mark the worker down.
FLAP_CONFIG = GATEWAY_CONFIG.replace("timeout_s: 1.0", "timeout_s: 0.4")


async def test_flapping_link_causes_no_ejection_storm(netsim: NetSim, model_repo: Path, tmp_path: Path) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text(FLAP_CONFIG)
    workers = fleet(netsim, model_repo, 2)
    gateway = start_gateway(netsim, workers, config)
    (flap_host, flap_worker), (steady_host, _) = workers
    load = await SteadyLoad(gateway.ready["grpc_port"], gateway.ready["http_port"], prefix="flap").start()
    try:
        await load.until_ok(100)
        for h, w in workers:
            await until_serving(load, h, w)
        sent_before = len(load.ledger.sent)
        await asyncio.to_thread(flap, netsim, flap_host)
        assert len(load.ledger.sent) > sent_before  # served all through the flapping
        await until(lambda: _state_is(gateway, flap_host, "ready"), "the flapping worker to be back")
        await until_serving(load, flap_host, flap_worker)
        await load.until_ok(50)
    finally:
        ledger = await load.stop()
        gateway.stop()
        for _, w in workers:
            w.stop()
    flapped, steady = transitions(gateway, flap_host.address), transitions(gateway, steady_host.address)
    print(f"flap: {len(ledger.sent)} requests, {FLAPS} cuts; flapping worker {flapped}, steady worker {steady}")
    check(ledger, 300)
    # At most one trip out of rotation per cut, of each kind; the healthy worker never leaves it.
    assert flapped["down"] <= FLAPS and flapped["ejected"] <= FLAPS, flapped
    assert steady == {"down": 0, "ejected": 0}, steady


def flap(net: NetSim, host: Host) -> None:
    """Down and up ``FLAPS`` times: a clock is what makes a link flap (not a readiness wait)."""
    for _ in range(FLAPS):
        net.cut(host)
        time.sleep(FLAP_HALF_PERIOD_S)
        net.restore(host)
        time.sleep(FLAP_HALF_PERIOD_S)


PLACED_CONFIG = GATEWAY_CONFIG + """
placement: {interval_s: 0.5}
models:
  mlp: {replicas: 2}
"""


async def test_two_gateways_one_loses_a_worker(netsim: NetSim, model_repo: Path, tmp_path: Path) -> None:
    """Gateway A (root namespace) keeps a worker that gateway B (its own host) loses; both serve
    throughout, and once the link is back their placements agree and the workers hold just that."""
    config = tmp_path / "gateway.yaml"
    config.write_text(PLACED_CONFIG)
    workers = fleet(netsim, model_repo, 3, "--model-control-mode", "explicit")
    by_address = {_worker_address(h, w): (h, w) for h, w in workers}
    gb_host = netsim.add_host("gb")
    procs = start_together([lambda: start_gateway(netsim, workers, config),
                            lambda: start_gateway(netsim, workers, config, gb_host)])
    gateways = list(zip(procs, ["127.0.0.1", gb_host.address]))
    loads: list[SteadyLoad] = []
    try:
        placed = await until_placed(gateways)
        for i, (g, address) in enumerate(gateways):
            loads.append(await SteadyLoad(g.ready["grpc_port"], g.ready["http_port"], grpc_clients=3, http_clients=1,
                                          host=address, prefix=f"gw{i}").start())
        await asyncio.gather(*(load.until_ok(100) for load in loads))
        lost_host, _ = by_address[placed[0]]
        await asyncio.to_thread(netsim.cut_between, lost_host, gb_host.address)
        (ga, ga_address), (gb, gb_address) = gateways
        await until(lambda: _state_is(gb, lost_host, "down", gb_address), "gateway B to lose the worker")
        await asyncio.gather(*(load.until_ok(200) for load in loads))
        assert await _state_is(ga, lost_host, "ready")  # A still reaches it
        await asyncio.to_thread(netsim.restore_between, lost_host, gb_host.address)
        assert await until_placed(gateways) == placed  # settles back where it was
        await asyncio.gather(*(load.until_ok(100) for load in loads))
    finally:
        ledgers = [await load.stop() for load in loads]
        for g, _ in gateways:
            g.stop()
        for _, w in workers:
            w.stop()
    for (g, _), ledger in zip(gateways, ledgers):
        print(f"gateway {g.pid}: {len(ledger.sent)} requests, codes {dict(ledger.codes())}")
        check(ledger, 300)


async def until_placed(gateways: list[tuple[Proc, str]], timeout_s: float = 60.0) -> list[str]:
    """Wait until every gateway plans the same workers for ``mlp``, sees them all ready, and they
    alone hold it (by their own repository index); returns those workers."""
    agreed: list[str] = []

    async def settled() -> bool:
        nonlocal agreed
        plans = []
        async with aiohttp.ClientSession() as http:
            for g, address in gateways:
                async with http.get(f"http://{address}:{g.ready['http_port']}/v2/cluster/placement") as r:
                    doc = await r.json()
                model = next((m for m in doc["models"] if m["name"] == MODEL), None)
                if model is None or len(model["targets"]) != 2 or sorted(model["targets"]) != model["ready"]:
                    return False
                if any(w["state"] != "ready" for w in doc["workers"]):
                    return False
                plans.append(model["ready"])
        if any(p != plans[0] for p in plans):
            return False
        holders = [w["address"] for w in doc["workers"] if await _holds_mlp(w["address"])]
        agreed = plans[0]
        return sorted(holders) == agreed

    await until(settled, "the gateways' placements to agree", timeout_s)
    return agreed


async def _holds_mlp(address: str) -> bool:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        index = await stub.RepositoryIndex(service_pb2.RepositoryIndexRequest(ready=True), timeout=10)
    return any(m.name == MODEL for m in index.models)


async def _state_is(gateway: Proc, host: Host, state: str, address: str = "127.0.0.1") -> bool:
    return (await worker_states(gateway, address)).get(host.address) == state


def _worker_address(host: Host, worker: Proc) -> str:
    return f"{host.address}:{worker.ready['grpc_port']}"
