"""Model parallelism over capped links: ``bench/parallel_bench.py``'s table
(``encoder`` unsplit, TP2 and PP2 on peer collectives and on the gateway's
star, 2 x TP2; with ``--large``, ``encoder_large`` unsplit, TP2 on peers and
on the star, TP4, PP2) with the workers on loopback and then each behind its
own network link capped at each ``--rates`` value.

The capped rows put every worker in its own network namespace, joined to the
root namespace's bridge by a veth link with an ``htb`` cap each way
(tests/netsim.py); the gateway core runs in this process in the root
namespace, exactly as in parallel_bench. On peer collectives the ranks send
their partial sums to each other: a part leaves one worker's link and
enters another's, and the gateway's link carries only the batch and the
answer. On the star every partial crosses a worker's link to the gateway and
the sum comes back the same way. The rows show what each path's traffic
costs on a network that has a bandwidth limit.

Needs root, ``ip`` and ``tc`` for the capped rows (left out otherwise). Run:
``python bench/netsim_parallel_bench.py [--rates 1000,10000] [--large --seq 128]
[--out bench/results.md] [--json rows.json]``; ``--out`` replaces this
benchmark's section of that file (``--large`` has its own section).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import tempfile
from datetime import date
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the simulation lives with the tests

from bench.netsim_bench import write_section  # noqa: E402
from bench.parallel_bench import WORKER_ARGS, measure  # noqa: E402
from tests.netsim import NetSim, unavailable  # noqa: E402

SECTION = "## Model parallelism over capped links"
LARGE_SECTION = "## Large model split over capped links (encoder_large)"
LABELS = {"encoder": "encoder", "encoder_tp2": "TP2 peers", "encoder_tp2_star": "TP2 star", "encoder_pp2": "PP2 peers",
          "encoder_pp2_star": "PP2 star", "encoder_hybrid": "2 x TP2 peers",
          "encoder_large": "encoder_large", "encoder_large_tp2": "TP2 peers", "encoder_large_tp2_star": "TP2 star",
          "encoder_large_tp4": "TP4 peers (ring)", "encoder_large_pp2": "PP2 peers"}


def run(repo: Path, rates_mbit: list[float], options: dict[str, Any]) -> dict[str, dict[str, dict[str, float]]]:
    """Link label -> parallel_bench rows, loopback first."""
    links: dict[str, dict[str, dict[str, float]]] = {}
    links["loopback"] = asyncio.run(measure(repo, **options))
    print(f"loopback: {links['loopback']}", flush=True)
    reason = unavailable()
    if reason is not None:
        print(f"capped links left out: {reason}", file=sys.stderr)
        return links
    for rate in rates_mbit:
        label = f"{rate / 1000:g} Gbit/s"
        with NetSim() as net:
            hosts = [net.add_host(f"w{i}", rate_mbit=rate) for i in range(options["workers"])]
            workers = [net.start_worker(h, repo, *WORKER_ARGS) for h in hosts]
            try:
                addresses = [f"{h.address}:{w.ready['grpc_port']}" for h, w in zip(hosts, workers)]
                links[label] = asyncio.run(measure(repo, addresses=addresses, **options))
            finally:
                for w in workers:
                    w.stop()
        print(f"{label}: {links[label]}", flush=True)
    return links


def markdown(links: dict[str, dict[str, dict[str, float]]], options: dict[str, Any]) -> str:
    large = options.get("large", False)
    lines = [
        LARGE_SECTION if large else SECTION,
        "",
        f"`python bench/netsim_parallel_bench.py --rates {options.get('rates', '')}{' --large' if large else ''}`: "
        "parallel_bench's rows "
        f"({options['workers']} ONNX Runtime workers of one intra-op thread, "
        f"single-row requests of {options['seq']} tokens; latency = {options['requests']} sequential requests per "
        f"model, throughput = {options['clients']} concurrent loops for {options['duration_s']:g} s) with the workers "
        f"on loopback, then each behind its own capped link; {os.cpu_count()} CPU cores, {date.today().isoformat()}, "
        f"load average {os.getloadavg()[0]:.1f} at the end.",
        "",
        "| link of each worker | model | p50 ms | p99 ms | rows/s | mean batch | gateway calls/req "
        "| remote ms/req | collective ms/req | KiB gateway<->workers/req | KiB worker<->worker/req |",
        "|:---|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for link, rows in links.items():
        for model, r in rows.items():
            cells = [link, LABELS.get(model, model), f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}",
                     f"{r['rows_per_s']:,.0f}", f"{r['mean_batch']:.1f}"]
            if "shard_calls_per_req" in r:
                cells += [f"{r['shard_calls_per_req']:.0f}", f"{r['remote_ms_per_req']:.2f}",
                          f"{r['collective_ms_per_req']:.2f}", f"{r['kib_moved_per_req']:,.0f}",
                          f"{r['peer_kib_per_req']:,.0f}"]
            else:
                cells += ["1", "-", "-", "-", "-"]
            lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "- peers: one gateway call per rank (TP) or one per batch (PP); the ranks' partial sums go worker to worker, "
        "each leaving one worker's link and entering another's (KiB worker<->worker = the bytes all ranks sent; "
        "a ring from 3 ranks up). star: one gateway <-> worker round trip per rank per segment over that worker's "
        "link, the gateway summing and concatenating",
        "- remote ms = time waiting on workers, collective ms = the rest of the plan at the gateway, both per "
        "request at batch 1; KiB gateway<->workers = bytes sent to and received from workers per request",
        "- links are veth pairs between network namespaces with an htb rate cap each way (tests/netsim.py): "
        "bandwidth only, no added delay or loss; every worker and the gateway share the machine's cores",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="10000", help="link caps, Mbit/s, comma-separated (default 10000)")
    parser.add_argument("--model-repository", type=Path, help="built example repository (default: build one)")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32, help="tokens per request")
    parser.add_argument("--requests", type=int, default=200, help="latency samples per model")
    parser.add_argument("--block", type=int, default=20, help="latency requests per model per turn (1: interleaved)")
    parser.add_argument("--clients", type=int, default=64, help="concurrent single-row loops for throughput")
    parser.add_argument("--duration-s", type=float, default=5.0)
    parser.add_argument("--large", action="store_true", help="encoder_large and its splits (big activations)")
    parser.add_argument("--out", type=Path, help="write the section into this Markdown file")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    repo = args.model_repository
    if repo is None:
        from models.build import build_repository

        repo = Path(tempfile.mkdtemp(prefix="netsim-parallel-models-")) / "models"
        build_repository(repo, large=args.large)
    options = {"workers": args.workers, "seq": args.seq, "requests": args.requests, "block": args.block,
               "clients": args.clients,
               "duration_s": args.duration_s, "large": args.large}
    shown = {**options, "rates": args.rates}
    links = run(repo, [float(r) for r in args.rates.split(",") if r], options)
    text = markdown(links, shown)
    print(text)
    if args.out:
        write_section(args.out, text, LARGE_SECTION if args.large else SECTION)
    if args.json:
        args.json.write_text(json.dumps(links, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
