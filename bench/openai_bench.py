"""Generation through the gateway against the worker direct: gRPC streams and the OpenAI API.

Starts one worker serving the example ``tiny_lm`` and one gateway in front
of it, then, at each concurrency of ``--concurrency`` (default 1 and 16),
sends that many greedy generations at once (``--max-tokens`` each, run to the
end with ``ignore_eos``) along three paths, alternated for ``--rounds``
rounds: KServe gRPC ``ModelStreamInfer`` to the worker direct, the same to
the gateway, and the gateway's OpenAI API (``/v1/completions`` streamed,
timed by ``loadtest.openai_stream``). Reports output tokens/s, time to first
token and inter-token latency (per request, from its first to its last token
over the tokens after the first; the median over requests), and the
gateway-to-direct ratio of inter-token latency, the issue's 1.2x bound.

Run: ``python bench/openai_bench.py [--concurrency 1 16] [--max-tokens 64] [--rounds 3]``
(after ``infergate models build``). The machine may be shared: read the
ratios, not absolute values.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from loadtest.openai_stream import OpenAIStreamClient  # noqa: E402
from protos.triton_words import is_final  # noqa: E402
from tests.harness import start, start_worker, worker_url  # noqa: E402
from tests.integration.workers.gen_client import generation_request  # noqa: E402

MODELS_DIR = Path(__file__).resolve().parent.parent / "models"
PATHS = ("worker gRPC", "gateway gRPC", "gateway OpenAI SSE")


def _prompt(i: int) -> str:
    return f"prompt {i}: {'abcdefgh'[: i % 8]}"


def _itl(times: list[float], tokens: int) -> float | None:
    return (times[-1] - times[0]) / (tokens - 1) if len(times) > 1 and tokens > 1 else None


async def _grpc_one(stub: service_pb2_grpc.GRPCInferenceServiceStub, request: service_pb2.ModelInferRequest,
                    sent: float) -> tuple[float, float | None, int]:
    """(time to first token, inter-token latency, tokens) of one generation on its own stream."""
    times: list[float] = []
    call = stub.ModelStreamInfer(iter([request]))
    try:
        async for reply in call:
            if reply.error_message:
                raise RuntimeError(reply.error_message)
            response = reply.infer_response
            if response.raw_output_contents:
                times.append(time.perf_counter())
            if is_final(response):
                tokens = int(response.parameters["completion_tokens"].int64_param) or len(times)
                return times[0] - sent, _itl(times, tokens), tokens
    finally:
        call.cancel()
    raise RuntimeError("the stream ended without a final response")


async def _grpc_round(url: str, concurrency: int, max_tokens: int, tag: str) -> dict[str, float]:
    async with grpc.aio.insecure_channel(url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        requests = [generation_request(f"{tag}-{i}", _prompt(i), max_tokens) for i in range(concurrency)]
        start_s = time.perf_counter()
        results = await asyncio.gather(*(_grpc_one(stub, r, start_s) for r in requests))
        wall = time.perf_counter() - start_s
    return _summary(results, wall)


async def _openai_round(base: str, concurrency: int, max_tokens: int) -> dict[str, float]:
    client = OpenAIStreamClient(base, "tiny_lm")
    try:
        start_s = time.perf_counter()
        timings = await asyncio.gather(*(client.generate(_prompt(i), max_tokens, temperature=0, ignore_eos=True)
                                         for i in range(concurrency)))
        wall = time.perf_counter() - start_s
    finally:
        await client.close()
    errors = [t.error for t in timings if t.error]
    if errors:
        raise RuntimeError(f"OpenAI API: {errors[0]}")
    return _summary([(t.ttft_s or 0.0, t.itl_s, t.output_tokens) for t in timings], wall)


def _summary(results: list[tuple[float, float | None, int]], wall_s: float) -> dict[str, float]:
    itls = [itl for _, itl, _ in results if itl is not None]
    return {"tokens_per_s": sum(tokens for _, _, tokens in results) / wall_s,
            "ttft_ms": 1000 * statistics.median(ttft for ttft, _, _ in results),
            "itl_ms": 1000 * statistics.median(itls) if itls else 0.0}


def _round(path: str, urls: dict[str, str], concurrency: int, max_tokens: int, tag: str) -> dict[str, float]:
    """One round of ``path``; ``urls`` maps each path to the address it sends to."""
    if "OpenAI" in path:
        return asyncio.run(_openai_round(f"http://{urls[path]}/v1", concurrency, max_tokens))
    return asyncio.run(_grpc_round(urls[path], concurrency, max_tokens, tag))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--per-request-calls", action="store_true",
                        help="also a second gateway with worker_streams: per_request (a call per streamed request)")
    parser.add_argument("--proxy-floor", action="store_true",
                        help="also a bare grpc.aio proxy relaying the worker's stream (bench/proxy_floor.py): "
                             "the least any Python gRPC hop adds")
    args = parser.parse_args()
    if not (MODELS_DIR / "tiny_lm" / "1" / "model.onnx").is_file():
        print("build the example models first: infergate models build", file=sys.stderr)
        return 1
    results: dict[tuple[int, str], list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(MODELS_DIR / "tiny_lm", Path(tmp) / "tiny_lm")
        worker = start_worker(tmp)
        gateways = []
        try:
            paths = list(PATHS)
            gateways.append(start(["gateway", "--worker", worker_url(worker), "--http-port", "0", "--grpc-port", "0"]))
            urls = {"worker gRPC": worker_url(worker),
                    "gateway gRPC": f"127.0.0.1:{gateways[0].ready['grpc_port']}",
                    "gateway OpenAI SSE": f"127.0.0.1:{gateways[0].ready['http_port']}"}
            if args.per_request_calls:
                config = Path(tmp) / "per_request.yaml"
                config.write_text("worker_streams: per_request\n")
                gateways.append(start(["gateway", "--worker", worker_url(worker), "--http-port", "0",
                                       "--grpc-port", "0", "--config", str(config)]))
                urls["gateway gRPC, call per request"] = f"127.0.0.1:{gateways[1].ready['grpc_port']}"
                urls["gateway OpenAI SSE, call per request"] = f"127.0.0.1:{gateways[1].ready['http_port']}"
                paths += ["gateway gRPC, call per request", "gateway OpenAI SSE, call per request"]
            if args.proxy_floor:
                proxy = start(["--serve-proxy", worker_url(worker)], module="bench.proxy_floor")
                gateways.append(proxy)
                urls["bare gRPC proxy"] = f"127.0.0.1:{proxy.ready['grpc_port']}"
                paths.append("bare gRPC proxy")
            for concurrency in args.concurrency:
                for path in paths:  # warm every path at the shapes measured
                    _round(path, urls, concurrency, args.max_tokens, f"warm-{concurrency}")
                for n in range(args.rounds):
                    for path in paths:
                        results.setdefault((concurrency, path), []).append(
                            _round(path, urls, concurrency, args.max_tokens, f"{concurrency}-{n}"))
        finally:
            for gateway in gateways:
                gateway.stop()
            worker.stop()
    print(f"tiny_lm, {args.max_tokens} tokens a generation, {args.rounds} rounds (median)")
    print("| streams | path | output tokens/s | time to first token p50 | inter-token latency p50 | ITL vs direct |")
    print("|---:|---|---:|---:|---:|---:|")
    for concurrency in args.concurrency:
        direct = statistics.median(r["itl_ms"] for r in results[(concurrency, PATHS[0])])
        for path in paths:
            rows = results[(concurrency, path)]
            itl = statistics.median(r["itl_ms"] for r in rows)
            print(f"| {concurrency} | {path} | {statistics.median(r['tokens_per_s'] for r in rows):.0f} | "
                  f"{statistics.median(r['ttft_ms'] for r in rows):.1f} ms | {itl:.2f} ms | "
                  f"{itl / direct if direct else 0:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
