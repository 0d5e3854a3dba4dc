"""Model parallelism over capped links: ``bench/parallel_bench.py``'s table
(``encoder`` unsplit, TP2, PP2, 2 x TP2) with the workers on loopback and
then each behind its own network link capped at each ``--rates`` value.

The capped rows put every worker in its own network namespace, joined to the
root namespace by a veth link with an ``htb`` cap each way (tests/netsim.py);
the gateway core runs in this process in the root namespace, exactly as in
parallel_bench. Every collective today goes through the gateway (it sends
each rank its inputs and sums or concatenates what the ranks return), so
every shard call crosses one worker's link twice: the rows show what the
split models' traffic costs on a network that has a bandwidth limit.

Needs root, ``ip`` and ``tc`` for the capped rows (left out otherwise). Run:
``python bench/netsim_parallel_bench.py [--rates 1000,10000] [--out bench/results.md]
[--json rows.json]``; ``--out`` replaces this benchmark's section of that file.
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
LABELS = {"encoder": "encoder", "encoder_tp2": "TP2", "encoder_pp2": "PP2", "encoder_hybrid": "2 x TP2"}


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
    lines = [
        SECTION,
        "",
        f"`python bench/netsim_parallel_bench.py`: parallel_bench's rows ({options['workers']} ONNX Runtime workers, "
        f"single-row requests of {options['seq']} tokens; latency = {options['requests']} sequential requests per "
        f"model, throughput = {options['clients']} concurrent loops for {options['duration_s']:g} s) with the workers "
        f"on loopback, then each behind its own capped link; {os.cpu_count()} CPU cores, {date.today().isoformat()}, "
        f"load average {os.getloadavg()[0]:.1f} at the end.",
        "",
        "| link gateway <-> each worker | model | p50 ms | p99 ms | rows/s | mean batch | shard calls/req "
        "| remote ms/req | collective ms/req | KiB moved/req |",
        "|:---|:---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for link, rows in links.items():
        for model, r in rows.items():
            cells = [link, LABELS.get(model, model), f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}",
                     f"{r['rows_per_s']:,.0f}", f"{r['mean_batch']:.1f}"]
            if "shard_calls_per_req" in r:
                cells += [f"{r['shard_calls_per_req']:.0f}", f"{r['remote_ms_per_req']:.2f}",
                          f"{r['collective_ms_per_req']:.2f}", f"{r['kib_moved_per_req']:,.0f}"]
            else:
                cells += ["1", "-", "-", "-"]
            lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "- every collective goes through the gateway: each shard call is one gateway <-> worker round trip over "
        "that worker's link; remote ms = time waiting on workers, collective ms = the rest of the plan (the "
        "gateway decoding, summing, concatenating, encoding), both per request at batch 1; KiB moved = bytes "
        "sent to and received from workers per request",
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
    parser.add_argument("--clients", type=int, default=64, help="concurrent single-row loops for throughput")
    parser.add_argument("--duration-s", type=float, default=5.0)
    parser.add_argument("--out", type=Path, help="write the section into this Markdown file")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    repo = args.model_repository
    if repo is None:
        from models.build import build_repository

        repo = Path(tempfile.mkdtemp(prefix="netsim-parallel-models-")) / "models"
        build_repository(repo)
    options = {"workers": args.workers, "seq": args.seq, "requests": args.requests, "clients": args.clients,
               "duration_s": args.duration_s}
    links = run(repo, [float(r) for r in args.rates.split(",") if r], options)
    text = markdown(links, options)
    print(text)
    if args.out:
        write_section(args.out, text, SECTION)
    if args.json:
        args.json.write_text(json.dumps(links, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
