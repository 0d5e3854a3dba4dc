"""How long a worker takes to rejoin after its link was cut, by cut length.

One simulated worker (``--backend sim``) sits in its own network namespace
behind a veth link (tests/netsim.py); a gateway in the root namespace
probes it (``--probe-interval`` / ``--probe-timeout``) while a light load of
``mlp`` requests runs through it. The link is cut for each ``--cuts`` length
(seconds; the worker stays alive, unreachable), then restored, and the time
from the restore to

* ``ready``: the gateway lists the worker READY again (``/v2/cluster/stats``,
  polled every 50 ms), and
* ``served``: a request through the gateway succeeds again

is reported. A connection that was idle through the cut is unaffected; one
with unanswered calls in it waits for TCP's retransmission timer, which
backs off to minutes, unless gRPC keepalive closes it and the channel
reconnects. Needs root, ``ip`` and ``tc``. Run:
``python bench/netsim_rejoin.py [--cuts 5,30,60]``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the simulation lives with the tests

from tests.harness import start  # noqa: E402
from tests.integration.steady_load import SteadyLoad  # noqa: E402
from tests.netsim import NetSim, unavailable  # noqa: E402


async def state(http_port: int, address: str) -> str:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{http_port}/v2/cluster/stats") as r:
            doc = await r.json()
    return next(w["state"] for w in doc["workers"] if w["address"] == address)


async def poll(condition, timeout_s: float) -> float | None:  # type: ignore[no-untyped-def]
    """Seconds until ``condition()`` holds (polled every 50 ms), None past ``timeout_s``."""
    t0 = time.monotonic()
    while not await condition():
        if time.monotonic() - t0 > timeout_s:
            return None
        await asyncio.sleep(0.05)
    return time.monotonic() - t0


async def measure(
    cuts: list[float], interval_s: float, timeout_s: float, wait_s: float, request_timeout_s: float
) -> list[dict[str, object]]:
    from models.build import build_repository

    repo = Path(tempfile.mkdtemp(prefix="netsim-rejoin-")) / "models"
    build_repository(repo)
    config = repo.parent / "gateway.yaml"
    config.write_text(f"probe: {{interval_s: {interval_s}, timeout_s: {timeout_s}, failures_to_down: 2}}\n"
                      f"hedge: {{hang_min_s: 0.5}}\ndefault_timeout_s: {request_timeout_s}\n")
    rows: list[dict[str, object]] = []
    with NetSim() as net:
        host = net.add_host("w0")
        # A second host on the bridge keeps it up while w0 is cut: with no port left up the
        # bridge itself goes down and the gateway's sends fail locally, which no real cut does.
        net.add_host("bystander")
        worker = net.start_worker(host, repo, "--backend", "sim", "--sim-latency-ms", "5")
        address = f"{host.address}:{worker.ready['grpc_port']}"
        gateway = start(["gateway", "--worker", address, "--http-port", "0", "--grpc-port", "0", "--config", str(config)])
        http_port = gateway.ready["http_port"]
        load = await SteadyLoad(gateway.ready["grpc_port"], http_port, grpc_clients=2, http_clients=0,
                                timeout_s=request_timeout_s, prefix="rejoin").start()
        try:
            await load.until_ok(20)
            for cut_s in cuts:
                net.cut(host)
                down = await poll(lambda: _is(http_port, address, "down"), cut_s + 30)
                await asyncio.sleep(max(0.0, cut_s - (down or 0.0)))  # the cut's length is the point here
                before = load.ledger.ok
                net.restore(host)
                ready, grew = await asyncio.gather(poll(lambda: _is(http_port, address, "ready"), wait_s),
                                                   poll(lambda: _ok_grew(load, before), wait_s))
                rows.append({"cut_s": cut_s, "down_after_s": down, "ready_after_s": ready, "served_after_s": grew})
                print(rows[-1], flush=True)
                if grew is None:
                    print("\n".join(gateway.log().splitlines()[-40:]), file=sys.stderr)
        finally:
            await load.stop()
            gateway.stop()
            worker.stop()
    return rows


async def _is(http_port: int, address: str, wanted: str) -> bool:
    return await state(http_port, address) == wanted


async def _ok_grew(load: SteadyLoad, before: int) -> bool:
    return load.ledger.ok > before


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cuts", default="5,30,60", help="cut lengths, seconds, comma-separated")
    parser.add_argument("--probe-interval", type=float, default=2.0, help="the gateway's probe.interval_s")
    parser.add_argument("--probe-timeout", type=float, default=5.0, help="the gateway's probe.timeout_s")
    parser.add_argument("--request-timeout", type=float, default=5.0,
                        help="each request's deadline (the load's clients and the gateway's default), seconds")
    parser.add_argument("--wait", type=float, default=180.0, help="give up on a rejoin after this long, seconds")
    args = parser.parse_args()
    reason = unavailable()
    if reason is not None:
        print(f"needs network namespaces: {reason}", file=sys.stderr)
        return 2
    rows = asyncio.run(measure([float(c) for c in args.cuts.split(",") if c], args.probe_interval,
                               args.probe_timeout, args.wait, args.request_timeout))
    print("| cut s | marked down after s | ready again after s | serving again after s |")
    print("|---:|---:|---:|---:|")
    for r in rows:
        cells = [r["cut_s"], r["down_after_s"], r["ready_after_s"], r["served_after_s"]]
        print("| " + " | ".join("never" if c is None else f"{c:.1f}" for c in cells) + " |")  # type: ignore[str-format]
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
