"""A partition during tensor-parallel batches: ``encoder`` split in two ranks
(tensor_parallel 2) with two copies of each (replicas 2), on four ONNX
Runtime workers each behind its own network link (tests/netsim.py), and a
gateway in the root namespace under a steady load of exact-answer requests.

The gateway's link to the worker of one rank is cut mid-load (the worker
stays alive, unreachable): the shard calls in flight on it are answered by
the other copy of that rank within their deadlines, the worker is marked
down, and once the link returns the rank's copy is whole again (the worker
rejoins, or its slot was re-placed) and both copies of every rank serve.
Every request carries a unique id and must come back exactly once with the
unsplit model's numbers: 0 lost, 0 wrong.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import aiohttp
import grpc
import numpy as np
import onnxruntime as ort
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from tests.harness import Proc, start, start_together
from tests.integration.gateway.test_partitions import GATEWAY_CONFIG, check, until, worker_states
from tests.integration.steady_load import SteadyLoad, Workload
from tests.netsim import Host, NetSim

pytestmark = pytest.mark.timeout(120)

LOGICAL = "encoder_hybrid"
# The gateway-driven collectives: every rank's shard call goes through the
# gateway, so a cut rank's calls hang and hang detection must act (asserted
# below from the log). Peer collectives move that traffic between workers.
CONFIG = GATEWAY_CONFIG + f"""
models:
  {LOGICAL}: {{from: encoder, tensor_parallel: 2, replicas: 2, collectives: gateway}}
"""
SEQ = 8


def workload(model_repo: Path) -> Workload:
    tokens = np.arange(SEQ, dtype=np.int64) * 7 % 100
    session = ort.InferenceSession(str(model_repo / "encoder" / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    (hidden,) = session.run(["HIDDEN"], {"TOKENS": tokens[np.newaxis]})
    return Workload(LOGICAL, "TOKENS", "INT64", tokens, (SEQ, hidden.shape[-1]), expected_row=hidden[0])


async def rank_copies(gateway: Proc) -> dict[str, list[str]]:
    """Shard -> the READY workers the gateway routes it to (``/v2/cluster``)."""
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{gateway.ready['http_port']}/v2/cluster") as r:
            doc = await r.json()
    return {m["name"]: m["replicas"] for m in doc["models"] if m["name"].startswith(f"{LOGICAL}.")}


async def shard_counts(address: str) -> dict[str, int]:
    """Shard -> inferences the worker at ``address`` has run of it (its own statistics)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        stats = await stub.ModelStatistics(service_pb2.ModelStatisticsRequest(), timeout=10)
    counts: dict[str, int] = {}
    for s in stats.model_stats:
        if s.name.startswith(f"{LOGICAL}."):
            counts[s.name] = counts.get(s.name, 0) + s.inference_stats.success.count
    return counts


def rank_of(shard: str) -> str:
    """``encoder_hybrid.tp2.r0.s1`` -> ``r0``."""
    return shard.split(".")[2]


async def until_every_copy_serves(gateway: Proc, load: SteadyLoad) -> dict[str, list[str]]:
    """Wait until every shard has two READY copies and each worker holding a copy of a rank
    runs that rank's shards under the load (a rank's last segments may have nothing to call)."""
    copies: dict[str, list[str]] = {}

    async def whole() -> bool:
        nonlocal copies
        copies = await rank_copies(gateway)
        return len(copies) >= 2 and all(len(workers) == 2 for workers in copies.values())

    await until(whole, f"two ready copies of every shard of {LOGICAL}")
    holders = sorted({w for workers in copies.values() for w in workers})
    before = {w: await shard_counts(w) for w in holders}

    def ran(counts: dict[str, int], rank: str) -> int:
        return sum(n for s, n in counts.items() if rank_of(s) == rank)

    async def all_grew() -> bool:
        await load.until_ok(5)
        now = {w: await shard_counts(w) for w in holders}
        return all(ran(now[w], rank_of(s)) > ran(before[w], rank_of(s)) for s, ws in copies.items() for w in ws)

    await until(all_grew, "every copy of every shard to take work")
    return copies


async def test_cut_gateway_link_of_a_rank_mid_load(netsim: NetSim, model_repo: Path, tmp_path: Path) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text(CONFIG)
    hosts = [netsim.add_host(f"w{i}") for i in range(4)]
    started = start_together([lambda h=h: netsim.start_worker(h, model_repo, "--model-control-mode", "explicit",
                                                              "--grace-period", "5") for h in hosts])
    workers = list(zip(hosts, started))
    by_address = {f"{h.address}:{w.ready['grpc_port']}": (h, w) for h, w in workers}
    gateway = start(["gateway", *(a for address in by_address for a in ("--worker", address)),
                     "--model-repository", str(model_repo), "--http-port", "0", "--grpc-port", "0",
                     "--config", str(config)])
    load = await SteadyLoad(gateway.ready["grpc_port"], gateway.ready["http_port"], grpc_clients=4, http_clients=2,
                            prefix="tp", workload=workload(model_repo)).start()
    try:
        await load.until_ok(50)
        copies = await until_every_copy_serves(gateway, load)
        victim_address = copies[f"{LOGICAL}.tp2.r0.s0"][0]
        victim_host, victim = by_address[victim_address]
        # Cut while shard calls are in flight on it: each batch must be answered by the rank's other copy.
        caught = load.outstanding()
        await asyncio.to_thread(netsim.cut, victim_host)
        await load.until_answered(caught)
        await until(lambda: _state_is(gateway, victim_host, "down"), "the cut-off worker to be marked down")
        await load.until_ok(100)
        assert victim.popen.poll() is None  # alive all along, only unreachable
        await asyncio.to_thread(netsim.restore, victim_host)
        await until(lambda: _state_is(gateway, victim_host, "ready"), "the worker to rejoin")
        after = await until_every_copy_serves(gateway, load)
        await load.until_ok(50)
    finally:
        ledger = await load.stop()
        gateway.stop()
        for _, w in workers:
            w.stop()
    moved = sorted(s for s, ws in after.items() if sorted(ws) != sorted(copies[s]))
    print(f"tp cut: {len(ledger.sent)} requests, {len(caught)} in flight at the cut; shards re-placed: {moved or 'none'}")
    check(ledger, 200)
    # The cut caught shard calls on the victim: the router gave up waiting on them and retried them.
    assert re.search(rf"worker {re.escape(victim_address)} ejected for .*no answer after", gateway.log())


async def _state_is(gateway: Proc, host: Host, state: str) -> bool:
    return (await worker_states(gateway)).get(host.address) == state
