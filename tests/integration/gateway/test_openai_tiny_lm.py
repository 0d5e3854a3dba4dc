"""The ``openai`` client against ``infergate up`` serving the example decoder
``tiny_lm`` and the ``encoder`` (one worker, two gateway processes behind one
HTTP port): a greedy completion is, byte for byte, what the same gateway
streams over KServe gRPC for the same request; usage and ``finish_reason``
come from the model's final response; seeded sampling repeats itself and a
streamed chat joins to the whole one; every gateway process serves ``/v1``;
the bench's timed client (``loadtest.openai_stream``) measures streams.
"""

from __future__ import annotations

import asyncio
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import openai
import pytest
import requests

from loadtest.openai_stream import OpenAIStreamClient, StreamTiming
from tests.harness import Proc, start
from tests.integration.gateway.stream_clients import WAIT_S, poll
from tests.integration.workers.gen_client import GenStream

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def up(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, Path]]:
    repo = tmp_path_factory.mktemp("openai-up")
    for name in ("tiny_lm", "encoder"):
        shutil.copytree(model_repo / name, repo / name)
    proc = start(["up", "--workers", "1", "--gateway-processes", "2", "--model-repository", str(repo),
                  "--http-port", "0", "--grpc-port", "0"])
    try:
        base = f"http://127.0.0.1:{proc.ready['http_port']}"
        poll(lambda: all(requests.get(f"{base}/v2/models/{m}/ready", timeout=10).status_code == 200
                         for m in ("tiny_lm", "encoder")), "models ready", timeout_s=60.0)
        yield proc, repo
    finally:
        proc.stop()


def _client(proc: Proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{proc.ready['http_port']}/v1", api_key="unused", max_retries=0,
                         timeout=WAIT_S)


def test_greedy_completion_is_what_the_gateway_streams_over_grpc(up: tuple[Proc, Path]) -> None:
    proc, _ = up
    prompts = ["Hello", "The quick brown fox", "été"]
    stream = GenStream(f"127.0.0.1:{proc.ready['grpc_port']}")
    try:
        expected = [stream.generate("tiny_lm", f"g{i}", p, max_tokens=12, temperature=0.0)
                    for i, p in enumerate(prompts)]
    finally:
        stream.close()
    answer = _client(proc).completions.create(model="tiny_lm", prompt=prompts, max_tokens=12, temperature=0)
    assert [c.index for c in answer.choices] == [0, 1, 2]
    for choice, want in zip(answer.choices, expected):
        assert want.error is None
        assert choice.text == want.text.decode("utf-8", errors="replace")
        assert choice.finish_reason == want.finish_reason
    assert answer.usage.prompt_tokens == sum(w.prompt_tokens for w in expected) > 0
    assert answer.usage.completion_tokens == sum(w.completion_tokens for w in expected) > 0


def test_seeded_sampling_repeats_and_a_streamed_chat_joins_to_the_whole(up: tuple[Proc, Path]) -> None:
    proc, _ = up
    client = _client(proc)
    messages = [{"role": "user", "content": "Tell me a story"}]

    def sample() -> list[str]:
        answer = client.chat.completions.create(model="tiny_lm", messages=messages, n=2, seed=42, temperature=0.9,
                                                top_p=0.95, max_completion_tokens=16)
        return [c.message.content or "" for c in answer.choices]

    first = sample()
    assert sample() == first

    async def streamed() -> tuple[dict[int, str], list[str], openai.types.CompletionUsage | None]:
        async with openai.AsyncOpenAI(base_url=client.base_url, api_key="unused", max_retries=0) as aclient:
            texts: dict[int, str] = {0: "", 1: ""}
            reasons: list[str] = []
            usage = None
            chunks = await aclient.chat.completions.create(
                model="tiny_lm", messages=messages, n=2, seed=42, temperature=0.9, top_p=0.95,
                max_completion_tokens=16, stream=True, stream_options={"include_usage": True})
            async for chunk in chunks:
                usage = chunk.usage or usage
                for choice in chunk.choices:
                    texts[choice.index] += choice.delta.content or ""
                    if choice.finish_reason:
                        reasons.append(choice.finish_reason)
            return texts, reasons, usage

    texts, reasons, usage = asyncio.run(streamed())
    assert [texts[0], texts[1]] == first
    assert len(reasons) == 2 and set(reasons) <= {"stop", "length"}
    assert usage is not None and usage.prompt_tokens > 0 and 0 < usage.completion_tokens <= 32


def test_every_gateway_process_serves_the_openai_api(up: tuple[Proc, Path]) -> None:
    proc, repo = up
    session = ort.InferenceSession(str(repo / "encoder" / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    (hidden,) = session.run(["HIDDEN"], {"TOKENS": np.array([list(b"infergate")], np.int64)})
    seen: dict[str, list[float]] = {}

    def both() -> bool:
        with requests.Session() as fresh:  # a new connection, which the kernel may hand to either process
            r = fresh.post(f"http://127.0.0.1:{proc.ready['http_port']}/v1/embeddings",
                           json={"model": "encoder", "input": "infergate"}, timeout=WAIT_S)
        assert r.status_code == 200, r.text
        seen[r.headers["X-Infergate-Process"]] = r.json()["data"][0]["embedding"]
        return set(seen) == {"0", "1"}

    poll(both, "both processes serving /v1/embeddings", timeout_s=60.0)
    for vector in seen.values():
        np.testing.assert_allclose(vector, hidden[0].mean(axis=0), rtol=1e-5, atol=1e-5)
    assert sorted(m.id for m in _client(proc).models.list()) == ["encoder", "tiny_lm"]


def test_the_benchs_timed_openai_client_measures_streams(up: tuple[Proc, Path]) -> None:
    proc, _ = up

    async def run() -> list[StreamTiming]:
        timings: list[StreamTiming] = []
        for chat in (False, True):
            client = OpenAIStreamClient(f"http://127.0.0.1:{proc.ready['http_port']}/v1", "tiny_lm", chat=chat)
            try:
                timings += await asyncio.gather(*(client.generate(f"prompt {i}", 8, temperature=0)
                                                  for i in range(4)))
            finally:
                await client.close()
        return timings

    timings = asyncio.run(run())
    assert len(timings) == 8
    assert all(t.error is None and 0 < t.output_tokens <= 8 for t in timings), timings
    assert all(t.ttft_s is not None and 0 < t.ttft_s <= t.total_s for t in timings)
    assert all(t.itl_s is None or t.itl_s >= 0 for t in timings)


def test_a_prompt_longer_than_the_context_is_the_clients_fault(up: tuple[Proc, Path]) -> None:
    """The worker refuses it in-stream; the gateway answers 400 with the worker's words, not 500."""
    proc, _ = up
    client = _client(proc)
    words = "exceeds the context of model 'tiny_lm' (512 tokens)"
    with pytest.raises(openai.BadRequestError, match=re.escape(words)):
        client.completions.create(model="tiny_lm", prompt="y" * 600, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match=re.escape(words)):
        for _ in client.chat.completions.create(model="tiny_lm", messages=[{"role": "user", "content": "z" * 700}],
                                                 max_tokens=4, stream=True):
            pass
    generate = requests.post(f"http://127.0.0.1:{proc.ready['http_port']}/v2/models/tiny_lm/generate",
                             json={"text_input": "w" * 600, "max_tokens": 4}, timeout=WAIT_S)
    assert generate.status_code == 400 and words in generate.json()["error"]
    # The worker was not blamed: it answers the next request at once.
    assert client.completions.create(model="tiny_lm", prompt="ok", max_tokens=3).choices[0].finish_reason == "length"
