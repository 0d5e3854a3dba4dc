"""The generation backend on a real ``infergate worker``, over tritonclient's
gRPC stream: ``tiny_lm`` with continuous batching.

Concurrent greedy generations equal, token for token, each run alone, also
when they join a batch already running;
``max_tokens`` and ``stop`` are honoured; seeded sampling repeats itself
alone or batched; a full instance refuses in the contract's words; a
cancelled stream's sequence leaves the batch (the worker's metrics say so).
"""

from __future__ import annotations

import re
import shutil
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import Proc, start_worker, worker_url
from tests.integration.workers.gen_client import GenStream

pytestmark = pytest.mark.timeout(60)

PROMPTS = [
    "Hello", "The quick brown fox", "a", "Once upon a time there was", "1234", "zzz", "What is the answer?",
    "def main():", "lorem ipsum dolor", "Q", "infergate streams tokens", "!!", "The end.", "abc def ghi", "\u00e9t\u00e9",
    "x" * 40,
]


@pytest.fixture(scope="module")
def repo(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``tiny_lm`` and ``tiny_lm_small``, the same model admitting two sequences at once."""
    root = tmp_path_factory.mktemp("gen_repo")
    shutil.copytree(model_repo / "tiny_lm", root / "tiny_lm")
    shutil.copytree(model_repo / "tiny_lm", root / "tiny_lm_small")
    config = (root / "tiny_lm_small" / "config.pbtxt").read_text()
    config = config.replace('name: "tiny_lm"', 'name: "tiny_lm_small"')
    config = re.sub(r'(key: "max_sequences"\s+value \{\s+string_value: )"\d+"', r'\1"2"', config)
    assert 'string_value: "2"' in config
    (root / "tiny_lm_small" / "config.pbtxt").write_text(config)
    return root


@pytest.fixture(scope="module")
def worker(repo: Path) -> Iterator[Proc]:
    proc = start_worker(repo, "--metrics-port", "0")
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def stream(worker: Proc) -> Iterator[GenStream]:
    s = GenStream(worker_url(worker))
    yield s
    s.close()


def metric(worker: Proc, family: str, model: str = "tiny_lm") -> float:
    url = f"http://127.0.0.1:{worker.ready['metrics_port']}/metrics"
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    match = re.search(rf'^{family}{{[^}}]*model="{model}"[^}}]*}} (\S+)$', text, re.M)
    assert match, text
    return float(match.group(1))


def test_concurrent_greedy_equals_each_alone(stream: GenStream) -> None:
    lengths = [8 + (3 * i) % 17 for i in range(len(PROMPTS))]
    alone = [stream.generate("tiny_lm", f"alone-{i}", p, max_tokens=n) for i, (p, n) in enumerate(zip(PROMPTS, lengths))]
    batched = [stream.send("tiny_lm", f"batched-{i}", p, max_tokens=n) for i, (p, n) in enumerate(zip(PROMPTS, lengths))]
    for generation in batched:
        assert generation.done.wait(30)
    for i, (one, many) in enumerate(zip(alone, batched)):
        assert one.error is None and many.error is None
        assert many.tokens == one.tokens, f"prompt {i} differs batched"
        assert (many.finish_reason, many.completion_tokens) == (one.finish_reason, one.completion_tokens)
        assert many.prompt_tokens == len(PROMPTS[i].encode()) + 1  # + BOS
    # Each response carried one token's byte.
    assert all(len(t) == 1 for g in batched for t in g.tokens)


def test_sequences_joining_a_running_batch_decode_as_alone(stream: GenStream) -> None:
    options = {"max_tokens": 64, "parameters": {"ignore_eos": True}}
    alone = [stream.generate("tiny_lm", f"join-alone-{i}", p, **options) for i, p in enumerate(PROMPTS[:4])]  # type: ignore[arg-type]
    first = stream.send("tiny_lm", "join-0", PROMPTS[0], **options)  # type: ignore[arg-type]
    joined = [first]
    for i, prompt in enumerate(PROMPTS[1:4], start=1):
        deadline = time.monotonic() + 10
        while len(first.tokens) < 8 * i:  # the batch is running: the next one joins mid-way
            assert time.monotonic() < deadline and not first.done.is_set()
            time.sleep(0.002)
        assert not first.done.is_set()
        joined.append(stream.send("tiny_lm", f"join-{i}", prompt, **options))  # type: ignore[arg-type]
    for one, late in zip(alone, joined):
        assert late.done.wait(30) and late.error is None
        assert late.tokens == one.tokens


def test_max_tokens_and_stop(stream: GenStream) -> None:
    five = stream.generate("tiny_lm", "five", "Hello", max_tokens=5, parameters={"ignore_eos": True})
    assert (five.finish_reason, five.completion_tokens, len(five.tokens)) == ("length", 5, 5)
    by_parameter = stream.generate("tiny_lm", "by-parameter", "Hello", parameters={"max_tokens": 3, "ignore_eos": True})
    assert (by_parameter.completion_tokens, by_parameter.tokens) == (3, five.tokens[:3])
    long = stream.generate("tiny_lm", "long", "Hello", max_tokens=24, parameters={"ignore_eos": True})
    stop = long.text[6:8]
    stopped = stream.generate("tiny_lm", "stopped", "Hello", max_tokens=24, stop=[stop, b"\x00never\x00"],
                              parameters={"ignore_eos": True})
    assert stopped.finish_reason == "stop"
    assert stopped.text == long.text[:long.text.find(stop)]
    assert stop not in stopped.text


def test_seeded_sampling_is_reproducible(stream: GenStream) -> None:
    options = {"max_tokens": 20, "temperature": 0.8, "top_p": 0.9, "seed": 1234}
    first = stream.generate("tiny_lm", "s1", "Sample", **options)
    others = [stream.send("tiny_lm", f"noise-{i}", p, max_tokens=20, temperature=1.0, seed=i) for i, p in enumerate(PROMPTS[:6])]
    again = stream.generate("tiny_lm", "s2", "Sample", **options)
    for other in others:
        assert other.done.wait(30)
    assert first.tokens == again.tokens and first.finish_reason == again.finish_reason
    greedy = stream.generate("tiny_lm", "g", "Sample", max_tokens=20)
    assert greedy.tokens != first.tokens  # sampling is not greedy decoding


def test_capacity_refusal(worker: Proc) -> None:
    holding = GenStream(worker_url(worker))
    refused = GenStream(worker_url(worker))
    try:
        long = [holding.send("tiny_lm_small", f"hold-{i}", "keep going", max_tokens=400, parameters={"ignore_eos": True})
                for i in range(2)]
        deadline = time.monotonic() + 10
        while not all(g.tokens for g in long):  # both admitted and running
            assert time.monotonic() < deadline
            time.sleep(0.01)
        third = refused.generate("tiny_lm_small", "third", "no room")
        assert not any(g.done.is_set() for g in long)
        assert third.error is not None
        assert "model 'tiny_lm_small' is at capacity (2 sequences); retry later" in third.error
    finally:
        holding.close(cancel=True)
        refused.close()


def test_cancel_frees_the_sequence(worker: Proc) -> None:
    s = GenStream(worker_url(worker))
    generation = s.send("tiny_lm", "cancel-me", "a long story", max_tokens=500, parameters={"ignore_eos": True})
    deadline = time.monotonic() + 10
    while not generation.tokens:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert metric(worker, "infergate_generation_sequences_running") >= 1
    s.close(cancel=True)
    deadline = time.monotonic() + 10
    while metric(worker, "infergate_generation_sequences_running") != 0:  # polling a condition with a deadline
        assert time.monotonic() < deadline, "the cancelled sequence still runs"
        time.sleep(0.05)
    assert metric(worker, "infergate_generation_cache_reserved_bytes") == 0
    assert metric(worker, "infergate_generation_tokens_total") > 0
    assert generation.finish_reason == ""  # ended by the cancel, never by a final response


def test_a_prompt_opening_like_one_served_before_reuses_its_cached_blocks(worker: Proc, stream: GenStream) -> None:
    system = "You are the assistant of a shop that sells only kites; answer in one short line. " * 3  # 246 bytes
    before = {f: metric(worker, f"infergate_generation_prefix_cache_{f}") for f in ("hits_total", "queries_total")}
    first = stream.generate("tiny_lm", "prefix-1", system + "Q: do you sell kites?", max_tokens=12)
    again = stream.generate("tiny_lm", "prefix-2", system + "Q: do you sell kites?", max_tokens=12)
    other = stream.generate("tiny_lm", "prefix-3", system + "Q: and string?", max_tokens=12)
    assert first.error is None and again.tokens == first.tokens  # the cached blocks give the same generation
    assert other.error is None and other.prompt_tokens == 1 + len(system) + len("Q: and string?")
    hits = metric(worker, "infergate_generation_prefix_cache_hits_total") - before["hits_total"]
    queries = metric(worker, "infergate_generation_prefix_cache_queries_total") - before["queries_total"]
    assert queries == first.prompt_tokens * 2 + other.prompt_tokens
    # The second: every whole block but the one its last token is in; the third: the system prompt's whole blocks.
    assert hits == (first.prompt_tokens - 1) // 16 * 16 + (1 + len(system)) // 16 * 16
    assert metric(worker, "infergate_generation_prefix_cache_blocks") >= (first.prompt_tokens - 1) // 16
