"""The official ``openai`` client, unchanged, against a real worker and gateway
(real processes, API keys on): completions and chat, sync and async,
streaming and not, ``n``, ``stop``, ``max_tokens``, usage, seeded sampling
reproducible, embeddings equal to ONNX Runtime's encoder output mean-pooled,
a key required, per-key model lists and rate limits, an unknown model; and
a streaming client that leaves freeing the model's instance on the worker.

The generative model is the stand-in ``reverse_lm`` (tests/fixtures/generative:
the prompt's characters reversed, one UTF-8 byte per token, shuffled by the
seed when sampling), served by the worker's Python backend.
"""

from __future__ import annotations

import asyncio
import base64
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import openai
import pytest
import requests

from tests.fixtures.generative import write_reverse_lm
from tests.harness import Proc, start, start_worker, worker_url
from tests.integration.gateway.stream_clients import metric, poll

pytestmark = pytest.mark.timeout(120)

KEY = "openai-test-key-0123456789"
NARROW = "openai-narrow-key-0123456789"
SLOW = "openai-slow-key-0123456789"
PROMPT = "naïve café 😀"  # multi-byte characters: each arrives split over tokens


@dataclass
class Cluster:
    worker: Proc
    gateway: Proc
    repo: Path

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.gateway.ready['http_port']}/v1"

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base, api_key=key, max_retries=0, timeout=30)

    def async_client(self, key: str = KEY) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base, api_key=key, max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def cluster(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("openai")
    repo = root / "models"
    shutil.copytree(model_repo / "encoder", repo / "encoder")
    write_reverse_lm(repo)
    keys = root / "api-keys"
    keys.write_text(f"{KEY} name=full\n{NARROW} encoder name=narrow\n{SLOW} * rate=1/h burst=1 name=slow\n")
    worker = start_worker(repo, "--metrics-port", "0")
    try:
        gateway = start(["gateway", "--worker", worker_url(worker), "--http-port", "0", "--grpc-port", "0",
                         "--api-key-file", str(keys)])
        try:
            base = f"http://127.0.0.1:{gateway.ready['http_port']}"
            poll(lambda: all(requests.get(f"{base}/v2/models/{m}/ready", headers={"Authorization": f"Bearer {KEY}"},
                                          timeout=10).status_code == 200 for m in ("encoder", "reverse_lm")),
                 "models ready through the gateway")
            yield Cluster(worker, gateway, repo)
        finally:
            gateway.stop()
    finally:
        worker.stop()


def _reversed(prompt: str) -> str:
    return prompt[::-1]


def test_models_need_a_key_and_list_what_the_key_may_use(cluster: Cluster) -> None:
    assert sorted(m.id for m in cluster.client().models.list()) == ["encoder", "reverse_lm"]
    assert [m.id for m in cluster.client(NARROW).models.list()] == ["encoder"]
    assert cluster.client().models.retrieve("reverse_lm").id == "reverse_lm"
    with pytest.raises(openai.NotFoundError):
        cluster.client(NARROW).models.retrieve("reverse_lm")
    with pytest.raises(openai.AuthenticationError) as info:
        cluster.client("wrong-key-0123456789-abcdef").completions.create(model="reverse_lm", prompt="x")
    assert info.value.status_code == 401 and info.value.body["message"] == "missing or invalid API key"
    # The client will not send a request without a key; a plain one without the header:
    bare = requests.post(f"{cluster.base}/chat/completions", json={"model": "reverse_lm", "messages": []}, timeout=30)
    assert bare.status_code == 401 and bare.headers["WWW-Authenticate"] == 'Bearer realm="infergate"'
    assert bare.json() == {"error": {"message": "missing or invalid API key", "type": "authentication_error",
                                     "param": None, "code": "invalid_api_key"}}
    with pytest.raises(openai.PermissionDeniedError, match="may not use model 'reverse_lm'"):
        cluster.client(NARROW).chat.completions.create(model="reverse_lm", messages=[{"role": "user", "content": "x"}])


def test_a_key_over_its_rate_limit_is_refused_with_429(cluster: Cluster) -> None:
    client = cluster.client(SLOW)
    client.embeddings.create(model="encoder", input="one")
    with pytest.raises(openai.RateLimitError, match="over its quota") as info:
        client.completions.create(model="reverse_lm", prompt="two")
    assert info.value.status_code == 429 and int(info.value.response.headers["Retry-After"]) > 0


def test_unknown_model_is_not_found(cluster: Cluster) -> None:
    with pytest.raises(openai.NotFoundError, match="unknown model: 'gpt-4o'") as info:
        cluster.client().chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="not a text generation model"):
        cluster.client().completions.create(model="encoder", prompt="x")


def test_completion_with_max_tokens_stop_and_usage(cluster: Cluster) -> None:
    client = cluster.client()
    whole = client.completions.create(model="reverse_lm", prompt=PROMPT, max_tokens=64)
    assert whole.object == "text_completion" and whole.model == "reverse_lm"
    assert whole.choices[0].text == _reversed(PROMPT) and whole.choices[0].finish_reason == "stop"
    size = len(PROMPT.encode())
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (size + 1, size)
    short = client.completions.create(model="reverse_lm", prompt="abcdef", max_tokens=3)
    assert short.choices[0].text == "fed" and short.choices[0].finish_reason == "length"
    assert short.usage.completion_tokens == 3 and short.usage.total_tokens == 3 + 7
    stopped = client.completions.create(model="reverse_lm", prompt="hello world", stop=["w o", "xyz"])
    assert stopped.choices[0].text == "dlro" and stopped.choices[0].finish_reason == "stop"


def test_streamed_chat_joins_to_the_whole_answer_with_usage_last(cluster: Cluster) -> None:
    client = cluster.client()
    messages = [{"role": "system", "content": "rev"}, {"role": "user", "content": PROMPT}]
    whole = client.chat.completions.create(model="reverse_lm", messages=messages, max_completion_tokens=200)
    prompt = f"<|system|>\nrev\n<|user|>\n{PROMPT}\n<|assistant|>\n"
    assert whole.choices[0].message.content == _reversed(prompt) and whole.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model="reverse_lm", messages=messages, max_completion_tokens=200,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert "\ufffd" not in text and any(c.choices and c.choices[0].delta.content == "😀" for c in chunks)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_n_choices_and_seeded_sampling_reproducible(cluster: Cluster) -> None:
    client = cluster.client()
    prompt = "abcdefghijklmnop"

    def sample(seed: int) -> list[str]:
        answer = client.completions.create(model="reverse_lm", prompt=prompt, n=2, seed=seed, temperature=1.0,
                                           max_tokens=16)
        assert [c.index for c in answer.choices] == [0, 1] and answer.usage.completion_tokens == 32
        return [c.text for c in answer.choices]

    first = sample(11)
    assert sample(11) == first  # the same seed: the same choices
    assert first[0] != first[1]  # choice i samples with seed + i
    assert sample(12)[0] == first[1]
    assert all(sorted(text) == sorted(prompt) for text in first)
    greedy = client.completions.create(model="reverse_lm", prompt=prompt, n=2, temperature=0)
    assert [c.text for c in greedy.choices] == [_reversed(prompt)] * 2


def test_async_client_streaming_and_not(cluster: Cluster) -> None:
    async def run() -> tuple[dict[int, str], str]:
        async with cluster.async_client() as client:
            texts: dict[int, str] = {0: "", 1: ""}
            stream = await client.completions.create(model="reverse_lm", prompt=PROMPT, n=2, max_tokens=64,
                                                     stream=True)
            async for chunk in stream:
                for choice in chunk.choices:
                    texts[choice.index] += choice.text
            chat = await client.chat.completions.create(model="reverse_lm", max_tokens=3,
                                                        messages=[{"role": "user", "content": "xyz"}])
            return texts, chat.choices[0].message.content or ""

    texts, chat = asyncio.run(run())
    assert texts == {0: _reversed(PROMPT), 1: _reversed(PROMPT)}
    assert chat == "\n>|"


def _ort_pooled(cluster: Cluster, text: str) -> np.ndarray:
    session = ort.InferenceSession(str(cluster.repo / "encoder" / "1" / "model.onnx"),
                                   providers=["CPUExecutionProvider"])
    tokens = np.array([list(text.encode())], dtype=np.int64)
    (hidden,) = session.run(["HIDDEN"], {"TOKENS": tokens})
    return hidden[0].mean(axis=0)


def test_embeddings_are_the_encoders_hidden_states_mean_pooled(cluster: Cluster) -> None:
    inputs = ["hello world", "naïve", "a"]
    answer = cluster.client().embeddings.create(model="encoder", input=inputs)
    assert [d.index for d in answer.data] == [0, 1, 2] and answer.model == "encoder"
    assert answer.usage.prompt_tokens == sum(len(t.encode()) for t in inputs)
    for text, item in zip(inputs, answer.data):
        np.testing.assert_allclose(item.embedding, _ort_pooled(cluster, text), rtol=1e-5, atol=1e-5)
    raw = requests.post(f"{cluster.base}/embeddings", json={"model": "encoder", "input": "naïve",
                                                            "encoding_format": "base64"},
                        headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()
    vector = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), "<f4")
    np.testing.assert_allclose(vector, _ort_pooled(cluster, "naïve"), rtol=1e-5, atol=1e-5)


def test_embeddings_past_the_encoders_limits_are_refused_naming_them(cluster: Cluster) -> None:
    def post(body: dict[str, object]) -> requests.Response:
        return requests.post(f"{cluster.base}/embeddings", json={"model": "encoder", **body},
                             headers={"Authorization": f"Bearer {KEY}"}, timeout=30)

    long = post({"input": "x" * 129})  # the example encoder has 128 positions (its config says so)
    assert long.status_code == 400, long.text
    assert "129 tokens; model 'encoder' takes at most 128 (its max_position_embeddings)" in long.json()["error"]["message"]
    unknown = post({"input": [[1, 2, 5000]]})
    assert unknown.status_code == 400, unknown.text
    assert "vocabulary of 1000 tokens (ids 0 to 999)" in unknown.json()["error"]["message"]
    negative = post({"input": [[1, -2]]})
    assert negative.status_code == 400 and "negative token id" in negative.json()["error"]["message"]
    cut = post({"input": "x" * 300, "truncate_prompt_tokens": -1})  # cut to the model's limit when asked
    assert cut.status_code == 200, cut.text
    assert cut.json()["usage"]["prompt_tokens"] == 128
    assert post({"input": "x" * 128}).status_code == 200


def test_a_streaming_client_that_leaves_frees_the_models_instance(cluster: Cluster) -> None:
    pending = f"127.0.0.1:{cluster.worker.ready['metrics_port']}"
    stream = cluster.client().completions.create(model="reverse_lm", prompt="sleep:" + "x" * 200, max_tokens=200,
                                                 stream=True)
    label = 'model="reverse_lm"'
    first = next(iter(stream))
    assert first.choices[0].text == "x"
    assert metric(pending, "nv_inference_pending_request_count", label) == 1
    stream.close()  # the connection goes: the gateway cancels the stream, the worker the model's request
    poll(lambda: metric(pending, "nv_inference_pending_request_count", label) == 0,
         "the worker's reverse_lm request released", 5.0)
