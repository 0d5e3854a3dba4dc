"""Continuous batching against one sequence at a time, on one worker.

Starts one worker serving the example ``tiny_lm`` twice: as built
(``tiny_lm``: every running sequence in each decoder step) and as
``tiny_lm_serial`` (the same model with ``max_batch_sequences: 1``: the
others wait, so sequences run one at a time). Sends ``--sequences``
greedy generations at once (different prompts, ``--max-tokens`` each) over
one tritonclient gRPC stream, alternating the two for ``--rounds`` rounds,
and reports output tokens/s, time to first token and inter-token latency.

Run: ``python bench/generate_bench.py [--sequences 16] [--max-tokens 64] [--rounds 3]``
(after ``infergate models build``). The machine may be shared: read the
ratio of the two rows, not absolute values.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.harness import start_worker, worker_url  # noqa: E402
from tests.integration.workers.gen_client import GenStream  # noqa: E402

MODELS_DIR = Path(__file__).resolve().parent.parent / "models"


def _repository(root: Path) -> None:
    shutil.copytree(MODELS_DIR / "tiny_lm", root / "tiny_lm")
    shutil.copytree(MODELS_DIR / "tiny_lm", root / "tiny_lm_serial")
    config = (root / "tiny_lm_serial" / "config.pbtxt").read_text().replace('name: "tiny_lm"', 'name: "tiny_lm_serial"')
    config += 'parameters {\n  key: "max_batch_sequences"\n  value {\n    string_value: "1"\n  }\n}\n'
    (root / "tiny_lm_serial" / "config.pbtxt").write_text(config)


def _round(url: str, model: str, sequences: int, max_tokens: int, tag: str) -> dict[str, float]:
    stream = GenStream(url)
    try:
        start = time.monotonic()
        runs = [stream.send(model, f"{tag}-{i}", f"prompt {i}: " + "abcdefgh"[: i % 8], max_tokens=max_tokens)
                for i in range(sequences)]
        for run in runs:
            assert run.done.wait(600), "no final response"
            assert run.error is None, run.error
        wall = time.monotonic() - start
    finally:
        stream.close()
    tokens = sum(r.completion_tokens for r in runs)
    ttft = [r.token_times[0] - start for r in runs if r.token_times]
    gaps = [b - a for r in runs for a, b in zip(r.token_times, r.token_times[1:])]
    return {"tokens_per_s": tokens / wall, "tokens": tokens, "wall_s": wall,
            "ttft_p50_ms": 1000 * statistics.median(ttft), "itl_p50_ms": 1000 * statistics.median(gaps)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not (MODELS_DIR / "tiny_lm" / "1" / "model.onnx").is_file():
        print("build the example models first: infergate models build", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _repository(root)
        worker = start_worker(root)
        try:
            url = worker_url(worker)
            for model in ("tiny_lm", "tiny_lm_serial"):  # warm both sessions
                _round(url, model, 2, 4, f"warm-{model}")
            results: dict[str, list[dict[str, float]]] = {"tiny_lm": [], "tiny_lm_serial": []}
            for n in range(args.rounds):
                for model in results:
                    results[model].append(_round(url, model, args.sequences, args.max_tokens, f"{model}-{n}"))
        finally:
            worker.stop()
    print(f"{args.sequences} concurrent sequences x {args.max_tokens} tokens, {args.rounds} rounds (median)")
    print("| scheduling | output tokens/s | time to first token p50 | inter-token latency p50 |")
    print("|---|---:|---:|---:|")
    medians = {}
    for model, label in (("tiny_lm", "continuous batching"), ("tiny_lm_serial", "one sequence at a time")):
        rows = results[model]
        medians[model] = statistics.median(r["tokens_per_s"] for r in rows)
        print(f"| {label} | {medians[model]:.0f} | {statistics.median(r['ttft_p50_ms'] for r in rows):.1f} ms | "
              f"{statistics.median(r['itl_p50_ms'] for r in rows):.2f} ms |")
    print(f"ratio: {medians['tiny_lm'] / medians['tiny_lm_serial']:.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
