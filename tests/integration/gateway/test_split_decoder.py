"""A split decoder served end to end: ``infergate up --workers 2`` serving the
example decoder ``tiny_lm`` on a worker, and a config declaring it split
TP2 and PP2 (``models.tiny_lm_tp2: {from: tiny_lm, tensor_parallel: 2}``).

Checked: each split model shows ``tiny_lm``'s generation signature; greedy
generations of prompts of many lengths (empty, one byte, multi-byte UTF-8,
~300 bytes) through gRPC streams are, token for token, the unsplit model's;
concurrent generations through the ``openai`` client (continuous batching
at the gateway) equal each run alone; a unary call is refused in Triton's
words; the gateway's generation gauges show the split decoders' running
sequences and cache as worker ``gateway``; a worker killed mid-generation ends no split generation -- the cache
lives in the gateway and the step reruns on the re-placed shards -- and the
tokens are still the unsplit model's (the test that kills runs last).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest
import requests
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.harness import Proc, start
from tests.integration.gateway.stream_clients import WAIT_S, WORKER_GAUGES, figures, poll
from tests.integration.workers.gen_client import GenStream, Generation

pytestmark = pytest.mark.timeout(240)

SPLIT = ("tiny_lm_tp2", "tiny_lm_pp2")
TOKENS_ACROSS_KILL = 300  # long enough that the kill lands mid-generation
PROMPTS = ["", "a", "Hello, world", "été à Noël", "The quick brown fox jumps over the lazy dog. " * 7]


@pytest.fixture(scope="module")
def up(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    root = tmp_path_factory.mktemp("split-decoder")
    shutil.copytree(model_repo / "tiny_lm", root / "models" / "tiny_lm")
    config = root / "gateway.yaml"
    config.write_text("models:\n"
                      "  tiny_lm_tp2: {from: tiny_lm, tensor_parallel: 2}\n"
                      "  tiny_lm_pp2: {from: tiny_lm, pipeline_parallel: 2}\n")
    proc = start(["up", "--workers", "2", "--model-repository", str(root / "models"), "--config", str(config),
                  "--http-port", "0", "--grpc-port", "0"])
    try:
        base = f"http://127.0.0.1:{proc.ready['http_port']}"
        poll(lambda: all(requests.get(f"{base}/v2/models/{m}/ready", timeout=10).status_code == 200
                         for m in ("tiny_lm", *SPLIT)), "models ready", timeout_s=90.0)
        yield proc
    finally:
        proc.stop()


def _grpc(proc: Proc) -> str:
    return f"127.0.0.1:{proc.ready['grpc_port']}"


def _generate(proc: Proc, model: str, prompts: list[str], max_tokens: int = 20) -> list[Generation]:
    stream = GenStream(_grpc(proc))
    try:
        return [stream.generate(model, f"{model}-{i}", p, timeout_s=WAIT_S, max_tokens=max_tokens, temperature=0.0,
                                parameters={"ignore_eos": True}) for i, p in enumerate(prompts)]
    finally:
        stream.close()


def test_split_decoders_show_the_source_generation_signature(up: Proc) -> None:
    base = f"http://127.0.0.1:{up.ready['http_port']}"
    source = requests.get(f"{base}/v2/models/tiny_lm", timeout=10).json()
    for name in SPLIT:
        meta = requests.get(f"{base}/v2/models/{name}", timeout=10).json()
        assert meta["inputs"] == source["inputs"] and meta["outputs"] == source["outputs"], name
        config = requests.get(f"{base}/v2/models/{name}/config", timeout=10).json()
        assert config["model_transaction_policy"]["decoupled"] is True


@pytest.mark.parametrize("model", SPLIT)
def test_greedy_tokens_equal_the_unsplit_model(up: Proc, model: str) -> None:
    want = _generate(up, "tiny_lm", PROMPTS)
    got = _generate(up, model, PROMPTS)
    for prompt, w, g in zip(PROMPTS, want, got):
        assert w.error is None and g.error is None, (prompt[:20], w.error, g.error)
        assert len(w.tokens) == 20
        assert g.tokens == w.tokens, (model, prompt[:20])  # token for token, each response one token
        assert (g.finish_reason, g.prompt_tokens, g.completion_tokens) == (w.finish_reason, w.prompt_tokens, 20)


async def test_concurrent_generations_equal_each_alone_through_openai(up: Proc) -> None:
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{up.ready['http_port']}/v1", api_key="unused",
                                max_retries=0, timeout=WAIT_S)
    prompts = [f"request {i}: " + "x" * (i * 13 % 40) for i in range(8)]

    async def one(prompt: str) -> str:
        answer = await client.completions.create(model="tiny_lm_pp2", prompt=prompt, max_tokens=16, temperature=0)
        return answer.choices[0].text

    try:
        alone = [await one(p) for p in prompts[:3]]
        together = await asyncio.gather(*(one(p) for p in prompts))
        assert together[:3] == alone
        unsplit = [(await client.completions.create(model="tiny_lm", prompt=p, max_tokens=16, temperature=0))
                   .choices[0].text for p in prompts]
        assert together == unsplit
    finally:
        await client.close()


def test_a_unary_call_is_refused_in_tritons_words(up: Proc) -> None:
    client = grpcclient.InferenceServerClient(_grpc(up))
    try:
        text = grpcclient.InferInput("text_input", [1], "BYTES")
        text.set_data_from_numpy(np.array([b"hi"], dtype=np.object_))
        with pytest.raises(InferenceServerException, match="doesn't support models with decoupled transaction policy"):
            client.infer("tiny_lm_tp2", [text])
    finally:
        client.close()


def test_the_split_decoders_figures_show_as_worker_gateway(up: Proc) -> None:
    base = f"http://127.0.0.1:{up.ready['http_port']}"
    stream = GenStream(_grpc(up))
    try:
        holding: list[Generation] = []
        seen: dict[str, float] = {}

        def running() -> bool:
            if all(g.done.is_set() for g in holding):
                holding.extend(stream.send("tiny_lm_tp2", f"hold-{len(holding) + i}", "Once upon a time",
                                           max_tokens=200, parameters={"ignore_eos": True}) for i in range(2))
            seen.update(figures(up, "gateway", "tiny_lm_tp2"))
            return seen.get("sequences_running", 0) > 0 and seen.get("cache_bytes", 0) > 0

        poll(running, "the gateway's own running sequences on its /metrics", timeout_s=60.0)
        assert set(seen) == set(WORKER_GAUGES)
        own = requests.get(f"{base}/v2/cluster", timeout=10).json()["gateway_generation"]
        assert "tiny_lm_tp2" in own
    finally:
        stream.close(cancel=True)
    poll(lambda: figures(up, "gateway", "tiny_lm_tp2") == dict.fromkeys(WORKER_GAUGES, 0.0),
         "the gateway's figures back to 0", timeout_s=60.0)


def test_a_worker_killed_mid_generation_ends_no_split_generation(up: Proc) -> None:
    """Runs last: it kills a worker (``up`` restarts it)."""
    prompts = ["lost worker one", "lost worker two"]
    want = _generate(up, "tiny_lm", prompts, max_tokens=TOKENS_ACROSS_KILL)
    stream = GenStream(_grpc(up))
    try:
        running = [stream.send("tiny_lm_pp2", f"kill-{i}", p, max_tokens=TOKENS_ACROSS_KILL, temperature=0.0,
                               parameters={"ignore_eos": True}) for i, p in enumerate(prompts)]
        poll(lambda: len(running[0].tokens) >= 5, "the first tokens")
        os.kill(up.ready["workers"][0]["pid"], signal.SIGKILL)
        at_kill = len(running[0].tokens)
        for generation in running:
            assert generation.done.wait(WAIT_S * 3), "no final response after the worker was lost"
    finally:
        stream.close()
    for w, g in zip(want, running):
        assert g.error is None, g.error
        assert g.tokens == w.tokens and len(g.tokens) == TOKENS_ACROSS_KILL
    assert at_kill < TOKENS_ACROSS_KILL  # the worker went down mid-generation
