"""Draining a worker so it can stop with no request failing: the gateway's
procedure, its HTTP endpoints, and ``infergate drain``.

The procedure (:func:`drain_worker`), in this order:

1. placement stops using the worker (no new replicas there) and adopts the
   models it serves that placement did not manage, keeping their replica
   counts;
2. each of those models gets a READY replica elsewhere (the placement
   controller loads them); until then the worker keeps serving them;
3. the worker turns DRAINING: the router sends it no new batch;
4. the batches already sent there finish (its in-flight count drops to 0),
   and the stateful sequences pinned there end (``gateway.routing.sequences``):
   a sequence's state lives on its worker, so it is never moved; a drain
   that times out first answers ``state: draining`` with ``open_sequences``,
   and the worker keeps serving them until they end.

Then the worker can be stopped; a registered worker deregisters as it stops.
If some model cannot be placed elsewhere within the timeout, the drain is
undone and answered 409 with those models, unless ``force`` is given.
A logical model's shards are moved by the parallel registry, not here.

HTTP (admin, under ``/v2/cluster/``):
``POST /v2/cluster/workers/{address}/drain[?timeout_s=S&force=true]``,
``POST /v2/cluster/workers/{address}/undrain`` and
``GET /v2/cluster/placement`` (the placement controller's view).

Each gateway drains on its own: with several gateways, drain on each
(``infergate drain WORKER -u URL1 -u URL2``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from gateway.fleet.placement import is_shard
from gateway.frontends.http_api import error_response

if TYPE_CHECKING:
    from gateway.core import Gateway

log = logging.getLogger(__name__)

INFLIGHT_POLL_S = 0.05


async def drain_worker(gateway: Gateway, address: str, *, timeout_s: float, force: bool = False) -> tuple[int, dict[str, Any]]:
    """Drain ``address``; (HTTP status, result document)."""
    cluster, placement = gateway.cluster, gateway.fleet.placement
    worker = cluster.worker(address)
    if worker is None:
        return 404, {"error": f"no worker {address}"}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    placement.exclude(address)
    models = sorted(n for n in worker.models if not is_shard(worker, n))
    for name in models:
        if not placement.manages(name):
            hosts = sum(1 for w in cluster.workers() if w.is_up and name in w.models)
            placement.adopt(name, hosts)
    log.info("draining worker %s: moving %d model(s) first: %s", address, len(models), ", ".join(models) or "-")

    def stranded() -> list[str]:
        return [n for n in models
                if not any(w is not worker and w.address not in placement.excluded for w in cluster.healthy(n))]

    left = stranded()
    while left and loop.time() < deadline:
        await placement.wait_round(deadline - loop.time())
        left = stranded()
    if left and not force:
        placement.include(address)
        log.warning("drain of %s undone: no other worker serves %s", address, ", ".join(left))
        return 409, {"error": f"models {', '.join(left)} have no replica on another worker; drain again with "
                              "force=true to drain anyway", "address": address, "stranded": left}
    if cluster.worker(address) is worker and not worker.draining:
        cluster.set_draining(address, True)
    # Polling a condition (the router's in-flight count, the sequences pinned
    # there), bounded by the deadline. Open sequences are never moved: their
    # state lives on this worker, which keeps serving them while DRAINING.
    def open_sequences() -> int:
        return gateway.sequences.open_on(address)

    while (worker.inflight > 0 or open_sequences() > 0) and loop.time() < deadline:
        await asyncio.sleep(INFLIGHT_POLL_S)
    sequences = open_sequences()
    state = "drained" if worker.inflight == 0 and sequences == 0 else "draining"
    log.info("worker %s %s (%d batch(es) still in flight, %d open sequence(s))", address, state, worker.inflight,
             sequences)
    return 200, {"address": address, "state": state, "moved": [n for n in models if n not in left],
                 "stranded": left, "inflight": worker.inflight, "open_sequences": sequences}


def undrain_worker(gateway: Gateway, address: str) -> tuple[int, dict[str, Any]]:
    worker = gateway.cluster.worker(address)
    if worker is None:
        return 404, {"error": f"no worker {address}"}
    gateway.fleet.placement.include(address)
    if worker.draining:
        gateway.cluster.set_draining(address, False)
    return 200, {"address": address, "state": worker.state.name.lower()}


def add_drain_routes(app: web.Application, gateway: Gateway) -> None:
    """Mount the drain, undrain and placement endpoints (before the app is set up)."""

    def answer(status: int, body: dict[str, Any]) -> web.Response:
        if status >= 400:
            return error_response(status, str(body.get("error", "")))
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    async def drain(request: web.Request) -> web.Response:
        try:
            timeout_s = float(request.query.get("timeout_s", gateway.config.placement.drain_timeout_s))
        except ValueError:
            return error_response(400, "timeout_s must be a number of seconds")
        force = request.query.get("force", "").lower() in ("1", "true", "yes")
        status, body = await drain_worker(gateway, request.match_info["address"], timeout_s=timeout_s, force=force)
        if status == 409:
            return web.Response(status=409, body=orjson.dumps(body), content_type="application/json")
        return answer(status, body)

    async def undrain(request: web.Request) -> web.Response:
        return answer(*undrain_worker(gateway, request.match_info["address"]))

    async def placement(_request: web.Request) -> web.Response:
        return web.Response(body=orjson.dumps(gateway.fleet.placement.view()), content_type="application/json",
                            headers={"Cache-Control": "no-store"})

    app.router.add_post("/v2/cluster/workers/{address}/drain", drain)
    app.router.add_post("/v2/cluster/workers/{address}/undrain", undrain)
    app.router.add_get("/v2/cluster/placement", placement)


# ---- infergate drain -------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("worker", metavar="WORKER", help="the worker's address, HOST:PORT, as the gateway lists it")
    parser.add_argument("-u", "--url", action="append", default=[], metavar="GATEWAY_HTTP",
                        help="a gateway's HTTP address (repeat for each gateway; default http://127.0.0.1:8000)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds to move models and finish in-flight work "
                        "(default: the gateway's drain_timeout_s)")
    parser.add_argument("--force", action="store_true", help="drain even if some model has no replica elsewhere")
    parser.add_argument("--undrain", action="store_true", help="put a drained worker back into service")
    parser.add_argument("--key-file", default=None, metavar="FILE", help="admin key for a gateway with keys (README: Security)")


def _call(url: str, worker: str, args: argparse.Namespace, key: str | None) -> tuple[int, dict[str, Any]]:
    base = url if "://" in url else f"http://{url}"
    action = "undrain" if args.undrain else "drain"
    query = {k: v for k, v in (("timeout_s", args.timeout), ("force", "true" if args.force else None)) if v is not None}
    target = f"{base.rstrip('/')}/v2/cluster/workers/{urllib.parse.quote(worker, safe='')}/{action}"
    if query:
        target += "?" + urllib.parse.urlencode(query)
    request = urllib.request.Request(target, data=b"", method="POST")
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    # The gateway answers once the drain is done: wait at least as long as it may take.
    timeout = (args.timeout or 600.0) + 30.0
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read() or b"{}")
        except ValueError:
            return e.code, {"error": e.reason}
    except (urllib.error.URLError, OSError) as e:
        return 0, {"error": f"cannot reach {base}: {getattr(e, 'reason', e)}"}


def run(args: argparse.Namespace) -> int:
    key = Path(args.key_file).read_text().strip() if args.key_file else None
    failed = False
    for url in args.url or ["http://127.0.0.1:8000"]:
        status, body = _call(url, args.worker, args, key)
        print(json.dumps({"gateway": url, "status": status, **body}), flush=True)
        failed |= status != 200 or (not args.undrain and body.get("state") != "drained")
    return 1 if failed else 0
