"""Continuous batching against one sequence at a time, on one worker.

Starts one worker serving the example ``tiny_lm`` twice: as built
(``tiny_lm``: every running sequence in each decoder step) and as
``tiny_lm_serial`` (the same model with ``max_batch_sequences: 1``: the
others wait, so sequences run one at a time). Sends ``--sequences``
greedy generations at once (different prompts, ``--max-tokens`` each), each
on its own gRPC ``ModelStreamInfer`` stream as separate clients would send
them (a bare ``grpc.aio`` client, so the client's own CPU weighs little), alternating the two for ``--rounds`` rounds,
and reports output tokens/s, time to first token and inter-token latency.

With ``--in-process`` it also runs both in this process with no gRPC (the
worker's model and stream path, each response encoded and dropped), which
shows what one response per token over gRPC costs.

Run: ``python bench/generate_bench.py [--sequences 16] [--max-tokens 64] [--rounds 3] [--in-process]``
(after ``infergate models build``). The machine may be shared: read the
ratio of the two rows, not absolute values.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

import grpc
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2, service_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from execution.backends.base import BackendOptions, Placement  # noqa: E402
from execution.backends.generate import create_backend  # noqa: E402
from execution.model import LoadedModel  # noqa: E402
from loadtest.suite_procs import cpu_seconds  # noqa: E402
from protos.triton_words import is_final  # noqa: E402
from tests.harness import start_worker, worker_url  # noqa: E402
from execution.decoupled import serve_decoupled  # noqa: E402

MODELS_DIR = Path(__file__).resolve().parent.parent / "models"


def _repository(root: Path) -> None:
    shutil.copytree(MODELS_DIR / "tiny_lm", root / "tiny_lm")
    shutil.copytree(MODELS_DIR / "tiny_lm", root / "tiny_lm_serial")
    config = (root / "tiny_lm_serial" / "config.pbtxt").read_text().replace('name: "tiny_lm"', 'name: "tiny_lm_serial"')
    config += 'parameters {\n  key: "max_batch_sequences"\n  value {\n    string_value: "1"\n  }\n}\n'
    (root / "tiny_lm_serial" / "config.pbtxt").write_text(config)


def _request(model: str, request_id: str, prompt: bytes, max_tokens: int) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    request.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    request.inputs.add(name="max_tokens", datatype="INT32", shape=[1])
    request.parameters["ignore_eos"].bool_param = True  # every generation runs to max_tokens
    request.raw_input_contents.extend([struct.pack("<I", len(prompt)) + prompt, struct.pack("<i", max_tokens)])
    return request


async def _one(stub: service_pb2_grpc.GRPCInferenceServiceStub, request: service_pb2.ModelInferRequest,
               arrivals: list[float]) -> int:
    """One generation on its own stream (as each client of a server has); its completion tokens."""
    call = stub.ModelStreamInfer(iter([request]))
    try:
        async for reply in call:
            if reply.error_message:
                raise RuntimeError(reply.error_message)
            response = reply.infer_response
            if response.raw_output_contents:
                arrivals.append(time.monotonic())
            if is_final(response):
                return int(response.parameters["completion_tokens"].int64_param)
    finally:
        call.cancel()
    raise RuntimeError("the stream ended without a final response")


async def _round(url: str, model: str, sequences: int, max_tokens: int, tag: str) -> dict[str, float]:
    """``sequences`` generations at once, one stream each on one channel; tokens/s and latencies."""
    arrivals: list[list[float]] = [[] for _ in range(sequences)]
    async with grpc.aio.insecure_channel(url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        requests = [_request(model, f"{tag}-{i}", f"prompt {i}: {'abcdefgh'[: i % 8]}".encode(), max_tokens)
                    for i in range(sequences)]
        start = time.monotonic()
        completion = await asyncio.gather(*(_one(stub, r, times) for r, times in zip(requests, arrivals)))
        wall = time.monotonic() - start
    ttft = [times[0] - start for times in arrivals if times]
    gaps = [b - a for times in arrivals for a, b in zip(times, times[1:])]
    return {"tokens_per_s": sum(completion) / wall, "wall_s": wall,
            "ttft_p50_ms": 1000 * statistics.median(ttft), "itl_p50_ms": 1000 * statistics.median(gaps)}


async def _in_process(root: Path, model: str, sequences: int, max_tokens: int) -> dict[str, float]:
    """The same generations with no gRPC: the worker's model and stream path, each response encoded and dropped."""
    config = text_format.Parse((root / model / "config.pbtxt").read_text(), mc.ModelConfig())
    instance = create_backend(BackendOptions()).load(root / model, root / model / "1", config, Placement("cpu"))
    loaded = LoadedModel(config, 1, [instance], max_queue_size=sequences)
    sent = 0

    async def write(_: service_pb2.ModelStreamInferResponse) -> None:
        nonlocal sent
        sent += 1

    try:
        requests = [_request(model, f"{model}-{i}", f"prompt {i}: {'abcdefgh'[: i % 8]}".encode(), max_tokens)
                    for i in range(sequences)]
        await asyncio.gather(*(serve_decoupled(loaded, r, write) for r in requests))  # warm
        sent, cpu, start = 0, time.process_time(), time.monotonic()
        await asyncio.gather(*(serve_decoupled(loaded, r, write) for r in requests))
        wall, cpu = time.monotonic() - start, time.process_time() - cpu
    finally:
        loaded.close()
    tokens = sent - sequences  # less the final responses
    return {"tokens_per_s": tokens / wall, "tokens_per_cpu_s": tokens / cpu}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker-args", default="", help="extra worker arguments, e.g. '--intra-op-threads 1'")
    parser.add_argument("--in-process", action="store_true",
                        help="also run the model in this process with no gRPC (what the stream path costs)")
    args = parser.parse_args()
    if not (MODELS_DIR / "tiny_lm" / "1" / "model.onnx").is_file():
        print("build the example models first: infergate models build", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _repository(root)
        worker = start_worker(root, *args.worker_args.split())
        try:
            url = worker_url(worker)
            for model in ("tiny_lm", "tiny_lm_serial"):  # warm both sessions at the batch shapes measured
                asyncio.run(_round(url, model, args.sequences, args.max_tokens, f"warm-{model}"))
            results: dict[str, list[dict[str, float]]] = {"tiny_lm": [], "tiny_lm_serial": []}
            for n in range(args.rounds):
                for model in results:
                    cpu_before = cpu_seconds(worker.pid) or 0.0
                    result = asyncio.run(_round(url, model, args.sequences, args.max_tokens, f"{model}-{n}"))
                    cpu = (cpu_seconds(worker.pid) or 0.0) - cpu_before
                    result["tokens_per_cpu_s"] = result["tokens_per_s"] * result["wall_s"] / cpu if cpu > 0 else 0.0
                    results[model].append(result)
        finally:
            worker.stop()
        in_process = {}
        if args.in_process:
            for model in ("tiny_lm", "tiny_lm_serial"):
                rounds = [asyncio.run(_in_process(root, model, args.sequences, args.max_tokens)) for _ in range(args.rounds)]
                in_process[model] = statistics.median(r["tokens_per_s"] for r in rounds)
    print(f"{args.sequences} concurrent sequences x {args.max_tokens} tokens, {args.rounds} rounds (median)")
    print("| scheduling | output tokens/s | tokens per worker CPU-second | time to first token p50 | inter-token latency p50 |")
    print("|---|---:|---:|---:|---:|")
    medians, per_cpu = {}, {}
    for model, label in (("tiny_lm", "continuous batching"), ("tiny_lm_serial", "one sequence at a time")):
        rows = results[model]
        medians[model] = statistics.median(r["tokens_per_s"] for r in rows)
        per_cpu[model] = statistics.median(r["tokens_per_cpu_s"] for r in rows)
        print(f"| {label} | {medians[model]:.0f} | {per_cpu[model]:.0f} | "
              f"{statistics.median(r['ttft_p50_ms'] for r in rows):.1f} ms | {statistics.median(r['itl_p50_ms'] for r in rows):.2f} ms |")
    ratios = [b["tokens_per_s"] / s["tokens_per_s"] for b, s in zip(results["tiny_lm"], results["tiny_lm_serial"])]
    print(f"tokens/s ratio: {medians['tiny_lm'] / medians['tiny_lm_serial']:.1f}x (per round: "
          f"{', '.join(f'{r:.1f}' for r in ratios)}); per worker CPU-second: {per_cpu['tiny_lm'] / per_cpu['tiny_lm_serial']:.1f}x")
    if in_process:
        print(f"in process, no gRPC: {in_process['tiny_lm']:.0f} vs {in_process['tiny_lm_serial']:.0f} tokens/s, "
              f"{in_process['tiny_lm'] / in_process['tiny_lm_serial']:.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
