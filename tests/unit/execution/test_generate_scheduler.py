"""The generation scheduler on a fake decoder step (no model, no threads, no real time).

The fake's next token depends only on the row's own tokens, as a real
decoder's does, so batched and alone must agree exactly.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence

import numpy as np
import pytest

from execution.backends.generate_scheduler import (
    SamplingParams,
    Scheduler,
    SchedulerLimits,
    StepRow,
    TokenOut,
    choose_token,
)
from protos.errors import InvalidArgument, Overloaded

VOCAB, EOS, BOS = 259, 257, 256


def fake_step(rows: Sequence[StepRow]) -> list[tuple[np.ndarray, object]]:
    results: list[tuple[np.ndarray, object]] = []
    for row in rows:
        seen = [*(row.cache or []), *row.tokens]  # type: ignore[misc]
        assert len(seen) == row.position + len(row.tokens)
        logits = np.sin(np.arange(VOCAB) * (1 + sum(seen) % 97) + len(seen)).astype(np.float32)
        results.append((logits, seen))
    return results


async def direct(call: Callable[[], object]) -> object:
    await asyncio.sleep(0)  # a step is a suspension point, as the executor hop is
    return call()


def scheduler(step: Callable[..., list[tuple[np.ndarray, object]]] = fake_step, **limits: int) -> Scheduler:
    settings = {"max_sequences": 16, "max_cache_bytes": 1 << 20, "cache_bytes_per_token": 8, "max_positions": 64,
                **limits}
    return Scheduler("lm", SchedulerLimits(**settings), step, direct, eos_id=EOS, banned=[BOS])  # type: ignore[arg-type]


class Client:
    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.end: TokenOut | None = None
        self.cancelled = threading.Event()

    def emit(self, out: TokenOut) -> None:
        assert self.end is None, "nothing after the end"
        if out.data is not None:
            self.chunks.append(out.data)
        else:
            self.end = out

    @property
    def text(self) -> bytes:
        return b"".join(self.chunks)


def start(s: Scheduler, prompt: bytes, **params: object) -> Client:
    client = Client()
    s.admit([BOS, *prompt], SamplingParams(**params), client.emit, client.cancelled, lambda t: bytes([t % 256]))  # type: ignore[arg-type]
    return client


async def until_idle(s: Scheduler) -> None:
    for _ in range(10_000):
        stats = s.stats()
        if not stats.running and not stats.waiting:
            return
        await asyncio.sleep(0)
    raise AssertionError("the scheduler never went idle")


async def generate_alone(prompt: bytes, **params: object) -> Client:
    s = scheduler()
    client = start(s, prompt, **params)
    await until_idle(s)
    s.close()
    return client


def run_alone(prompt: bytes, **params: object) -> Client:
    return asyncio.run(generate_alone(prompt, **params))


PROMPTS = [b"a", b"hello", b"the quick brown fox", b"xy", b"1234567890", b"zz top", b"q", b"lorem ipsum"]


def test_batched_greedy_equals_each_alone_and_sequences_join_between_steps() -> None:
    alone = [run_alone(p, max_tokens=10 + i) for i, p in enumerate(PROMPTS)]

    async def main() -> list[Client]:
        s = scheduler()
        clients = [start(s, p, max_tokens=10 + i) for i, p in enumerate(PROMPTS[:4])]
        for _ in range(3):
            await asyncio.sleep(0)  # a few steps run before the others join
        assert s.stats().running == 4
        clients += [start(s, p, max_tokens=10 + i) for i, p in enumerate(PROMPTS[4:], start=4)]
        await until_idle(s)
        assert s.stats().reserved_cache_bytes == 0
        return clients

    batched = asyncio.run(main())
    for one, many in zip(alone, batched):
        assert one.chunks == many.chunks and one.end == many.end
    assert all(c.end is not None and c.end.finish_reason for c in batched)


def test_max_tokens_ends_with_length_and_counts() -> None:
    client = run_alone(b"abc", max_tokens=3)
    assert client.end is not None and len(client.chunks) <= 3
    if client.end.finish_reason == "length":
        assert client.end.completion_tokens == 3 == len(client.chunks)
    assert client.end.prompt_tokens == 4


def test_max_tokens_zero_ends_at_once() -> None:
    client = run_alone(b"abc", max_tokens=0)
    assert client.chunks == [] and client.end == TokenOut(finish_reason="length", prompt_tokens=4, completion_tokens=0)


def test_eos_ends_with_stop() -> None:
    def eos_after_two(rows: Sequence[StepRow]) -> list[tuple[np.ndarray, object]]:
        out = []
        for row, (logits, seen) in zip(rows, fake_step(rows)):
            if row.cache is not None and len(seen) >= 6:  # type: ignore[arg-type]
                logits = np.zeros(VOCAB, np.float32)
                logits[EOS] = 1
            out.append((logits, seen))
        return out

    async def main() -> tuple[Client, Client]:
        s = scheduler(eos_after_two)
        client, ignoring = start(s, b"ab", max_tokens=50), start(s, b"ab", max_tokens=8, ignore_eos=True)
        await until_idle(s)
        return client, ignoring

    client, ignoring = asyncio.run(main())
    assert client.end is not None and client.end.finish_reason == "stop"
    assert client.end.completion_tokens == len(client.chunks) + 1  # EOS counts, sends no bytes
    assert ignoring.end is not None and (ignoring.end.finish_reason, len(ignoring.chunks)) == ("length", 8)


def test_stop_string_is_cut_and_never_sent() -> None:
    full = run_alone(b"hello", max_tokens=12)
    stop = full.text[4:6]
    first = full.text.find(stop)
    client = run_alone(b"hello", max_tokens=12, stop=(stop, b"\xff\xfe\xfd"))
    assert client.end is not None and client.end.finish_reason == "stop"
    assert client.text == full.text[:first]


def test_capacity_refusal_and_cache_bound() -> None:
    async def main() -> None:
        s = scheduler(max_sequences=2)
        start(s, b"a", max_tokens=40)
        start(s, b"b", max_tokens=40)
        with pytest.raises(Overloaded, match=r"model 'lm' is at capacity \(2 sequences\); retry later"):
            start(s, b"c")
        s.close()
        tight = scheduler(max_cache_bytes=8 * 30)
        start(tight, b"a", max_tokens=20)
        with pytest.raises(Overloaded, match="at capacity"):
            start(tight, b"b", max_tokens=20)
        with pytest.raises(InvalidArgument):
            start(tight, b"b", max_tokens=200)  # can never fit
        tight.close()

    asyncio.run(main())


def test_one_at_a_time_keeps_the_rest_waiting() -> None:
    async def main() -> None:
        s = scheduler(max_batch_sequences=1)
        clients = [start(s, p, max_tokens=4) for p in PROMPTS[:3]]
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert (s.stats().running, s.stats().waiting) == (1, 2)
        await until_idle(s)
        assert [c.chunks for c in clients] == [(await generate_alone(p, max_tokens=4)).chunks for p in PROMPTS[:3]]

    asyncio.run(main())


def test_cancelled_sequence_leaves_at_the_next_step() -> None:
    async def main() -> None:
        s = scheduler()
        stay, leave = start(s, b"stay", max_tokens=30), start(s, b"leave", max_tokens=30)
        for _ in range(4):
            await asyncio.sleep(0)
        leave.cancelled.set()
        sent = len(leave.chunks)
        for _ in range(4):
            await asyncio.sleep(0)
        assert s.stats().running == 1 and leave.end is None and len(leave.chunks) <= sent + 1
        await until_idle(s)
        assert stay.end is not None and stay.chunks == (await generate_alone(b"stay", max_tokens=30)).chunks

    asyncio.run(main())


def test_failed_step_ends_its_sequences_with_an_error() -> None:
    def broken(rows: Sequence[StepRow]) -> list[tuple[np.ndarray, object]]:
        raise RuntimeError("boom")

    async def main() -> Client:
        s = scheduler(broken)
        client = start(s, b"x")
        await until_idle(s)
        return client

    client = asyncio.run(main())
    assert client.end is not None and client.end.error is not None


def test_seeded_sampling_is_reproducible_alone_or_batched() -> None:
    params = {"max_tokens": 10, "temperature": 0.9, "top_p": 0.8, "seed": 42}
    alone = run_alone(b"sample me", **params)

    async def main() -> Client:
        s = scheduler()
        others = [start(s, p, max_tokens=10, temperature=1.0, seed=i) for i, p in enumerate(PROMPTS)]
        mine = start(s, b"sample me", **params)
        await until_idle(s)
        assert all(o.end is not None for o in others)
        return mine

    assert asyncio.run(main()).chunks == alone.chunks
    assert run_alone(b"sample me", **{**params, "seed": 43}).chunks != alone.chunks


def test_choose_token_greedy_and_nucleus() -> None:
    logits = np.array([0.0, 5.0, 4.9, -3.0])
    rng = np.random.default_rng(0)
    assert choose_token(logits, SamplingParams(), rng) == 1
    draws = {choose_token(logits, SamplingParams(temperature=1.0, top_p=0.5), rng) for _ in range(50)}
    assert draws == {1, 2} or draws <= {1, 2}
    assert 3 not in {choose_token(logits, SamplingParams(temperature=1.0, top_p=0.99), rng) for _ in range(200)}
