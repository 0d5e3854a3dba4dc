"""``infergate drain WORKER``: drain a worker (or put it back) on each gateway.

A client of the gateways' admin endpoints
(``POST /v2/cluster/workers/{address}/drain|undrain``, see
``gateway.fleet.drain`` for what a drain does): it calls each gateway named
with ``-u`` in turn, since each gateway drains on its own
(``infergate drain WORKER -u URL1 -u URL2``), prints one JSON line per
gateway and exits 1 unless every gateway answered that the worker is drained
(or back in service, with ``--undrain``). It imports nothing of the gateway.
"""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("worker", metavar="WORKER", help="the worker's address, HOST:PORT, as the gateway lists it")
    parser.add_argument("-u", "--url", action="append", default=[], metavar="GATEWAY_HTTP",
                        help="a gateway's HTTP address (repeat for each gateway; default http://127.0.0.1:8000)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds to move models and finish in-flight work "
                        "(default: the gateway's drain_timeout_s)")
    parser.add_argument("--force", action="store_true", help="drain even if some model has no replica elsewhere")
    parser.add_argument("--undrain", action="store_true", help="put a drained worker back into service")
    parser.add_argument("--key-file", default=None, metavar="FILE", help="admin key for a gateway with keys (docs/security.md)")


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
