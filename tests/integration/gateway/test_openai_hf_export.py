"""A Hugging Face decoder as users export it, served with no ``config.pbtxt``:
``optimum-cli export onnx --task text-generation-with-past`` of a tiny Llama
(grouped-query attention), copied into ``REPO/llama/1/``, behind
``infergate serve``, driven by the ``openai`` client and checked against
``transformers`` running the same weights in torch:

- greedy completions of 16 prompts of different lengths, all at once (one
  running batch), streamed and not, are token for token what ``generate``
  makes, and the streamed chunks join to ``tokenizer.decode`` of its ids;
- a chat is the model's own template as ``apply_chat_template(...,
  add_generation_prompt=True)`` renders it;
- ``logprobs`` / ``top_logprobs`` are ``generate``'s log-softmax scores
  (within 1e-4), token by token;
- stop tokens (a list) and ``max_new_tokens`` come from
  ``generation_config.json``; a ``config.pbtxt`` beside an export may set
  the scheduler's parameters and nothing else;
- (slow) a GPT-2 export the same way: greedy streams equal ``generate``.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
import requests

from tests.harness import Proc, start
from tests.integration.gateway.stream_clients import WAIT_S, poll

pytestmark = pytest.mark.timeout(180)

PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog.",
    "Héllo wörld ✓",
    "Once upon a time there was a little gateway that",
    "A",
    "tokens and text: 日本語, and then a few more words to make this prompt the longest of them all",
    "Streams",
    "What is the capital of France?",
    "def main():\n    return 42",
    "1, 2, 3, 4, 5, 6, 7,",
    "The gateway batches requests and",
    "naïve café",
    "A much longer prompt: the quick brown fox jumps over the lazy dog, again and again, until the dog",
    "Why?",
    "The gateway batches",
    "ok ok ok ok ok ok ok ok ok ok ok ok ok ok ok ok ok ok ok ok ok ok ok ok ok ok ok ok ok",
]
MAX_TOKENS = 24
CHAT = [
    {"role": "system", "content": "You are a tiny model."},
    {"role": "user", "content": "Hello there!"},
    {"role": "assistant", "content": "  Hi, what can I do?  "},
    {"role": "user", "content": "Tell me about 日本語."},
]
STOPS_MAX_NEW = 6  # llama_stops' generation_config.json: max_new_tokens


@dataclass(frozen=True, slots=True)
class Greedy:
    ids: list[int]  # generated, a final eos included
    logprobs: Any  # torch [len(ids), vocab]: log-softmax of each step's logits
    finish_reason: str


class Reference:
    """The same checkpoint in transformers."""

    def __init__(self, source: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(source).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(source)
        self.eos = {self.model.generation_config.eos_token_id}

    def greedy(self, ids: list[int], max_new_tokens: int, eos: set[int] | None = None) -> Greedy:
        torch = self.torch
        stop = sorted(eos or self.eos)
        with torch.no_grad():
            out = self.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                      max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stop,
                                      pad_token_id=stop[0], output_logits=True, return_dict_in_generate=True)
        new = out.sequences[0, len(ids):].tolist()
        logprobs = torch.log_softmax(torch.stack(out.logits)[:, 0].double(), dim=-1)
        return Greedy(new, logprobs, "stop" if new and new[-1] in stop else "length")

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def prompt_ids(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt)["input_ids"])


@pytest.fixture(scope="module")
def reference(hf_llama_source: Path) -> Reference:
    return Reference(hf_llama_source)


@dataclass(frozen=True, slots=True)
class StopCase:
    prompt: str  # greedy reaches the extra stop token within STOPS_MAX_NEW
    expected: list[int]  # its tokens before it
    long_prompt: str  # greedy does not: runs to max_new_tokens


def _stop_case(reference: Reference) -> tuple[StopCase, int]:
    """An extra stop token that ends one prompt's greedy text early and not another's."""
    runs = {p: reference.greedy(reference.prompt_ids(p), STOPS_MAX_NEW).ids for p in PROMPTS}
    for prompt, ids in runs.items():
        for at in range(1, STOPS_MAX_NEW - 1):
            token = ids[at]
            if token in ids[:at] or token in reference.eos:
                continue
            others = [p for p, other in runs.items() if token not in other and not set(other) & reference.eos]
            if others:
                return StopCase(prompt, ids[:at], others[0]), token
    raise AssertionError("no token of the greedy texts works as an extra stop token")


@pytest.fixture(scope="module")
def served(hf_llama_export: Path, reference: Reference,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, StopCase]]:  # fmt: skip
    repo = tmp_path_factory.mktemp("hf-repo")
    shutil.copytree(hf_llama_export, repo / "llama" / "1")
    # The same export with its own generation defaults: a second stop token, a short max_new_tokens.
    case, token = _stop_case(reference)
    shutil.copytree(hf_llama_export, repo / "llama_stops" / "1")
    generation = repo / "llama_stops" / "1" / "generation_config.json"
    doc = json.loads(generation.read_text())
    doc.update(eos_token_id=[doc["eos_token_id"], token], max_new_tokens=STOPS_MAX_NEW)
    generation.write_text(json.dumps(doc))
    # A config.pbtxt beside an export may set the scheduler's parameters; the rest still comes from the files.
    (repo / "llama_stops" / "config.pbtxt").write_text('parameters { key: "max_sequences" value { string_value: "8" } }\n')
    assert not (repo / "llama" / "config.pbtxt").exists()
    proc = start(["serve", "--model-repository", str(repo), "--http-port", "0", "--grpc-port", "0"])
    try:
        base = f"http://127.0.0.1:{proc.ready['http_port']}"
        poll(lambda: all(requests.get(f"{base}/v2/models/{m}/ready", timeout=10).status_code == 200
                         for m in ("llama", "llama_stops")), "models ready", timeout_s=60.0)
        yield proc, case
    finally:
        proc.stop()


def _client(proc: Proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{proc.ready['http_port']}/v1", api_key="unused",
                         max_retries=0, timeout=WAIT_S * 3)


def _token_bytes(reference: Reference, token: int) -> bytes:
    """A byte-level token's own bytes (GPT-2's printable stand-ins reversed)."""
    from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    return bytes(byte_of[c] for c in reference.tokenizer.convert_ids_to_tokens(token))


def test_the_export_is_served_with_no_config_as_a_decoupled_generation_model(
        served: tuple[Proc, StopCase]) -> None:  # fmt: skip
    proc, _ = served
    base = f"http://127.0.0.1:{proc.ready['http_port']}"
    config = requests.get(f"{base}/v2/models/llama/config", timeout=10).json()
    assert config["backend"] == "generate"
    assert config["model_transaction_policy"]["decoupled"] is True
    assert {"text_input", "messages"} <= {i["name"] for i in config["input"]}
    assert config["parameters"]["max_positions"]["string_value"] == "512"  # config.json's max_position_embeddings
    assert config["parameters"]["max_sequences"]["string_value"] == "32"  # stated: a gateway bounds streams by it
    stops = requests.get(f"{base}/v2/models/llama_stops/config", timeout=10).json()
    assert (stops["backend"], stops["parameters"]["max_sequences"]["string_value"]) == ("generate", "8")
    assert [m.id for m in _client(proc).models.list().data if m.id.startswith("llama")] == ["llama", "llama_stops"]


def test_concurrent_greedy_completions_are_transformers_generate_token_for_token(
        served: tuple[Proc, StopCase], reference: Reference) -> None:  # fmt: skip
    proc, _ = served
    client = _client(proc)
    expected = {p: reference.greedy(reference.prompt_ids(p), MAX_TOKENS) for p in PROMPTS}
    assert len({len(reference.prompt_ids(p)) for p in PROMPTS}) == len(PROMPTS)  # all lengths differ

    def whole(prompt: str) -> tuple[str, str | None, int, int]:
        answer = client.completions.create(model="llama", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        choice = answer.choices[0]
        return choice.text, choice.finish_reason, answer.usage.prompt_tokens, answer.usage.completion_tokens

    def streamed(prompt: str) -> tuple[list[str], str | None]:
        chunks, reason = [], None
        for chunk in client.completions.create(model="llama", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                               stream=True):
            for choice in chunk.choices:
                chunks.append(choice.text)
                reason = choice.finish_reason or reason
        return chunks, reason

    # Every prompt twice (streamed and not) at once: one running batch of sequences that join and leave.
    with ThreadPoolExecutor(2 * len(PROMPTS)) as pool:
        wholes = [pool.submit(whole, p) for p in PROMPTS]
        streams = [pool.submit(streamed, p) for p in PROMPTS]
        results = [(w.result(), s.result()) for w, s in zip(wholes, streams)]
    for prompt, ((text, reason, prompt_tokens, completion_tokens), (chunks, stream_reason)) in zip(PROMPTS, results):
        want = expected[prompt]
        assert text == reference.text(want.ids), prompt
        assert reason == stream_reason == want.finish_reason, prompt
        assert prompt_tokens == len(reference.prompt_ids(prompt))
        assert completion_tokens == len(want.ids)
        assert "".join(chunks) == text, prompt  # the incremental decode joins to the whole decode
        assert len([c for c in chunks if c]) > 1



def test_a_chat_is_rendered_by_the_models_own_template(served: tuple[Proc, StopCase], reference: Reference) -> None:
    proc, _ = served
    client = _client(proc)
    ids = list(reference.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True))
    want = reference.greedy(ids, MAX_TOKENS)
    answer = client.chat.completions.create(model="llama", messages=CHAT, max_completion_tokens=MAX_TOKENS,
                                            temperature=0)
    assert answer.usage.prompt_tokens == len(ids)
    assert answer.choices[0].message.content == reference.text(want.ids)
    assert answer.choices[0].finish_reason == want.finish_reason
    chunks = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="llama", messages=CHAT, max_completion_tokens=MAX_TOKENS, temperature=0, stream=True) if c.choices]
    assert "".join(chunks) == answer.choices[0].message.content


def test_logprobs_and_top_logprobs_are_transformers_scores(served: tuple[Proc, StopCase],
                                                           reference: Reference) -> None:  # fmt: skip
    proc, _ = served
    client = _client(proc)
    top, worst = 5, 0.0
    for prompt in PROMPTS[:3]:
        want = reference.greedy(reference.prompt_ids(prompt), 8)
        steps = [t for t in want.ids if t not in reference.eos]
        chat = client.chat.completions.create(model="llama", messages=[{"role": "user", "content": prompt}],
                                              max_completion_tokens=8, temperature=0, logprobs=True,
                                              top_logprobs=top)
        chat_ids = list(reference.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                                add_generation_prompt=True))
        chat_want = reference.greedy(chat_ids, 8)
        content = chat.choices[0].logprobs.content
        assert len(content) == len([t for t in chat_want.ids if t not in reference.eos])
        for step, entry in enumerate(content):
            scores = chat_want.logprobs[step]
            token = chat_want.ids[step]
            assert bytes(entry.bytes) == _token_bytes(reference, token)
            worst = max(worst, abs(entry.logprob - float(scores[token])))
            best = scores.topk(top)
            assert [bytes(t.bytes) for t in entry.top_logprobs] == [_token_bytes(reference, int(i))
                                                                    for i in best.indices]
            for alt, value in zip(entry.top_logprobs, best.values):
                worst = max(worst, abs(alt.logprob - float(value)))
        completion = client.completions.create(model="llama", prompt=prompt, max_tokens=8, temperature=0,
                                               logprobs=top)
        lp = completion.choices[0].logprobs
        assert len(lp.token_logprobs) == len(steps)
        for step, (token, value) in enumerate(zip(steps, lp.token_logprobs)):
            worst = max(worst, abs(value - float(want.logprobs[step][token])))
            assert len(lp.top_logprobs[step]) <= top
            assert max(lp.top_logprobs[step].values()) == pytest.approx(float(want.logprobs[step].max()), abs=1e-4)
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)

    assert worst < 1e-4


def test_stop_tokens_and_defaults_come_from_generation_config(served: tuple[Proc, StopCase],
                                                              reference: Reference) -> None:  # fmt: skip
    proc, case = served
    client = _client(proc)
    stopped = client.completions.create(model="llama_stops", prompt=case.prompt, temperature=0)
    assert stopped.choices[0].text == reference.text(case.expected)
    assert stopped.choices[0].finish_reason == "stop"
    long = client.completions.create(model="llama_stops", prompt=case.long_prompt)  # no max_tokens, no temperature
    want = reference.greedy(reference.prompt_ids(case.long_prompt), STOPS_MAX_NEW)
    assert long.choices[0].text == reference.text(want.ids)
    assert (long.choices[0].finish_reason, long.usage.completion_tokens) == ("length", STOPS_MAX_NEW)


@pytest.mark.slow
def test_a_gpt2_export_is_served_token_for_token_too(tmp_path: Path) -> None:
    """The GPT-2 family: multi-head attention, learned positions, no BOS, its end token free to come."""
    pytest.importorskip("optimum.exporters.onnx")
    from tests.fixtures.hf_decoders import build_gpt2_source, export

    source = build_gpt2_source(tmp_path / "gpt2-source")
    export(source, tmp_path / "repo" / "gpt2" / "1")
    reference = Reference(source)
    expected = {p: reference.greedy(reference.prompt_ids(p), MAX_TOKENS) for p in PROMPTS}
    proc = start(["serve", "--model-repository", str(tmp_path / "repo"), "--http-port", "0", "--grpc-port", "0"])
    try:
        base = f"http://127.0.0.1:{proc.ready['http_port']}"
        poll(lambda: requests.get(f"{base}/v2/models/gpt2/ready", timeout=10).status_code == 200, "model ready",
             timeout_s=60.0)
        client = _client(proc)

        def streamed(prompt: str) -> tuple[str, str | None]:
            text, reason = "", None
            for chunk in client.completions.create(model="gpt2", prompt=prompt, max_tokens=MAX_TOKENS,
                                                   temperature=0, stream=True):
                for choice in chunk.choices:
                    text += choice.text
                    reason = choice.finish_reason or reason
            return text, reason

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            results = list(pool.map(streamed, PROMPTS))
    finally:
        proc.stop()
    for prompt, (text, reason) in zip(PROMPTS, results):
        assert (text, reason) == (reference.text(expected[prompt].ids), expected[prompt].finish_reason), prompt
