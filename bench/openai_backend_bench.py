"""Streams through the gateway to an OpenAI-protocol server against the same server direct.

Builds the tests' tiny random-weight Llama (``tests/fixtures/hf_decoders.py``),
starts one ``transformers serve`` on it and one gateway in front of it
(``--worker openai://...``), then, at each concurrency of ``--concurrency``
(default 1 and 4), sends that many chats at once (``--max-tokens`` each)
to the server direct and through the gateway, alternated for ``--rounds``
rounds. Reports time to first chunk and inter-chunk latency (per request,
from its first to its last chunk over the chunks after the first; the
median over requests; ``transformers serve`` sends no usage, so chunks
stand for tokens on both paths) and the gateway-to-direct ratio.

Run: ``python bench/openai_backend_bench.py [--concurrency 1 4] [--max-tokens 64] [--rounds 3]``
(needs ``transformers[serving]``). The machine may be shared: read the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from loadtest.openai_stream import OpenAIStreamClient, StreamTiming  # noqa: E402
from tests.fixtures.hf_decoders import build_source  # noqa: E402
from tests.fixtures.hf_serve import is_ready, transformers_serve  # noqa: E402
from tests.harness import start  # noqa: E402
from tests.integration.gateway.stream_clients import poll  # noqa: E402


async def _round(url: str, concurrency: int, max_tokens: int) -> list[StreamTiming]:
    client = OpenAIStreamClient(url, "llama", chat=True, timeout_s=120.0)
    try:
        return list(await asyncio.gather(*(client.generate(f"Story {i}: once upon a time", max_tokens)
                                           for i in range(concurrency))))
    finally:
        await client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="openai-backend-bench-"))
    source = build_source(tmp / "source")
    served = transformers_serve(source, tmp / "serve.log")
    gateway = None
    try:
        poll(lambda: is_ready(served), "transformers serve ready", timeout_s=120.0)
        config = tmp / "gateway.yaml"
        config.write_text(json.dumps({"workers": [{"address": f"openai://{served.address}", "models": ["llama"]}]}))
        gateway = start(["gateway", "--config", str(config), "--http-port", "0", "--grpc-port", "0",
                         "--log-level", "WARNING"])
        gateway_url = f"http://127.0.0.1:{gateway.ready['http_port']}"
        poll(lambda: requests.get(f"{gateway_url}/v2/models/llama/ready", timeout=10).status_code == 200, "ready")
        paths = {"direct": f"http://{served.address}/v1", "gateway": f"{gateway_url}/v1"}
        asyncio.run(_round(paths["direct"], 1, 8))  # warm both paths
        asyncio.run(_round(paths["gateway"], 1, 8))
        print(f"| streams | path | TTFT p50 ms | inter-chunk p50 ms | chunks/s | errors |")
        print("|---|---|---|---|---|---|")
        for concurrency in args.concurrency:
            results: dict[str, list[StreamTiming]] = {p: [] for p in paths}
            elapsed: dict[str, float] = {p: 0.0 for p in paths}
            for _ in range(args.rounds):
                for name, url in paths.items():
                    timings = asyncio.run(_round(url, concurrency, args.max_tokens))
                    results[name] += timings
                    elapsed[name] += max(t.total_s for t in timings)
            itl: dict[str, float] = {}
            for name, timings in results.items():
                good = [t for t in timings if t.error is None]
                ttft = statistics.median(t.ttft_s for t in good if t.ttft_s is not None) * 1000
                itl[name] = statistics.median(t.itl_s for t in good if t.itl_s is not None) * 1000
                rate = sum(t.output_tokens for t in good) / elapsed[name]
                print(f"| {concurrency} | {name} | {ttft:.1f} | {itl[name]:.2f} | {rate:.0f} | "
                      f"{len(timings) - len(good)} |")
            print(f"| {concurrency} | gateway / direct inter-chunk | | {itl['gateway'] / itl['direct']:.2f}x | | |")
    finally:
        if gateway is not None:
            gateway.stop()
        served.stop()


if __name__ == "__main__":
    main()
