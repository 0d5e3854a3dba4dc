"""Gateway -> worker throughput of a large tensor over capped links.

One simulated worker (``--backend sim``, no compute time) serves ``blob``: an
FP32 tensor of any length in, one number out, so nearly every byte goes one
way. The worker sits either on loopback or in its own network namespace
behind a veth link capped at each rate (an ``htb`` qdisc each way; see
tests/netsim.py); the gateway and the client run in the root namespace.
For each link, ``requests`` sequential requests of a ``--mib`` MiB raw
tensor (after one warm-up) are timed end to end:

* via gateway: client -> gateway (loopback) -> worker (the link);
* direct: client -> worker (the link), the same bytes without the gateway.

MB/s = tensor bytes / median request time (MB = 10^6 bytes), set against
the cap. Needs root, ``ip`` and ``tc`` for the capped rows (they are left
out otherwise). Run: ``python bench/netsim_bench.py [--rates 1000,10000]
[--mib 64] [--requests 5] [--out bench/results.md]``; ``--out`` replaces
this benchmark's section of that file (``make bench`` rewrites the file:
run this afterwards).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the simulation lives with the tests

from tests.harness import Proc, start, start_worker  # noqa: E402
from tests.netsim import NetSim, unavailable  # noqa: E402

SECTION = "## Large tensors over capped links"
BLOB_CONFIG = """name: "blob"
backend: "onnxruntime"
max_batch_size: 0
input [{ name: "RAW" data_type: TYPE_FP32 dims: [-1] }]
output [{ name: "OUT" data_type: TYPE_FP32 dims: [1] }]
"""
WORKER_ARGS = ("--backend", "sim", "--sim-latency-ms", "0")


def blob_repository() -> Path:
    repo = Path(tempfile.mkdtemp(prefix="netsim-bench-"))
    (repo / "blob" / "1").mkdir(parents=True)
    (repo / "blob" / "config.pbtxt").write_text(BLOB_CONFIG)
    return repo


def timed(url: str, tensor: np.ndarray, requests: int) -> float:
    """Median seconds of one request of ``tensor`` to ``blob`` at ``url`` (after a warm-up)."""
    client = grpcclient.InferenceServerClient(url)
    try:
        inputs = [grpcclient.InferInput("RAW", list(tensor.shape), "FP32")]
        inputs[0].set_data_from_numpy(tensor)
        samples = []
        for i in range(requests + 1):
            t0 = time.perf_counter()
            result = client.infer("blob", inputs, client_timeout=120)
            if i:
                samples.append(time.perf_counter() - t0)
            assert result.as_numpy("OUT").shape == (1,)
        return statistics.median(samples)
    finally:
        client.close()


def measure(worker_url: str, repo: Path, tensor: np.ndarray, requests: int) -> tuple[float, float]:
    """(via gateway, direct) median seconds for one worker."""
    gateway = start(["gateway", "--worker", worker_url, "--http-port", "0", "--grpc-port", "0"])
    try:
        via = timed(f"127.0.0.1:{gateway.ready['grpc_port']}", tensor, requests)
    finally:
        gateway.stop()
    return via, timed(worker_url, tensor, requests)


def run(rates_mbit: list[float], mib: int, requests: int) -> list[dict[str, object]]:
    repo = blob_repository()
    tensor = np.ones(mib * 2**20 // 4, dtype=np.float32)
    rows: list[dict[str, object]] = []

    def row(link: str, cap_mbit: float | None, seconds: tuple[float, float]) -> None:
        mb = tensor.nbytes / 1e6
        rows.append({"link": link, "cap_mb_s": cap_mbit / 8 if cap_mbit else None,
                     "via_s": seconds[0], "direct_s": seconds[1],
                     "via_mb_s": mb / seconds[0], "direct_mb_s": mb / seconds[1]})
        print(rows[-1], flush=True)

    worker: Proc = start_worker(repo, *WORKER_ARGS)
    try:
        row("loopback", None, measure(f"127.0.0.1:{worker.ready['grpc_port']}", repo, tensor, requests))
    finally:
        worker.stop()
    reason = unavailable()
    if reason is not None:
        print(f"capped links left out: {reason}", file=sys.stderr)
        return rows
    for rate in rates_mbit:
        with NetSim() as net:
            host = net.add_host("w0", rate_mbit=rate)
            worker = net.start_worker(host, repo, *WORKER_ARGS)
            try:
                url = f"{host.address}:{worker.ready['grpc_port']}"
                row(f"veth, {rate / 1000:g} Gbit/s cap", rate, measure(url, repo, tensor, requests))
            finally:
                worker.stop()
    return rows


def markdown(rows: list[dict[str, object]], mib: int, requests: int) -> str:
    load = os.getloadavg()[0]
    lines = [
        SECTION,
        "",
        f"`python bench/netsim_bench.py`: one {mib} MiB FP32 raw tensor per request to a sim worker "
        f"(no compute time, 4-byte answer), median of {requests} sequential requests; {os.cpu_count()} CPU cores, "
        f"{date.today().isoformat()}, load average {load:.1f} at the end.",
        "",
        "| link gateway -> worker | cap MB/s | via gateway ms | via gateway MB/s | of cap | direct ms | direct MB/s | of cap |",
        "|:---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        cap = r["cap_mb_s"]
        share = (lambda v: f"{v / cap:.0%}") if cap else (lambda v: "-")  # noqa: E731
        lines.append(
            f"| {r['link']} | {f'{cap:,.0f}' if cap else '-'} | {r['via_s'] * 1000:,.0f} | {r['via_mb_s']:,.0f} | "
            f"{share(r['via_mb_s'])} | {r['direct_s'] * 1000:,.0f} | {r['direct_mb_s']:,.0f} | {share(r['direct_mb_s'])} |")
    lines += [
        "",
        "- via gateway = client -> gateway over loopback, gateway -> worker over the link; direct = client -> worker "
        "over the same link; MB = 10^6 bytes",
        "- links are veth pairs between network namespaces with an htb rate cap each way (tests/netsim.py): "
        "bandwidth only, no added delay or loss",
        "",
    ]
    return "\n".join(lines)


def write_section(path: Path, text: str, section: str = SECTION) -> None:
    """Replace ``section`` of ``path`` (from its heading up to the next ``## ``) with ``text``, or append it."""
    old = path.read_text() if path.exists() else "# infergate benchmark results\n"
    pattern = re.compile(rf"^{re.escape(section)}.*?(?=^## |\Z)", re.S | re.M)
    new = pattern.sub(lambda _: text, old) if pattern.search(old) else old.rstrip("\n") + "\n\n" + text
    path.write_text(new)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="1000,10000", help="link caps, Mbit/s, comma-separated")
    parser.add_argument("--mib", type=int, default=64, help="tensor size, MiB")
    parser.add_argument("--requests", type=int, default=5, help="timed requests per row")
    parser.add_argument("--out", type=Path, help="write the section into this Markdown file")
    args = parser.parse_args()
    rows = run([float(r) for r in args.rates.split(",") if r], args.mib, args.requests)
    text = markdown(rows, args.mib, args.requests)
    print(text)
    if args.out:
        write_section(args.out, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
