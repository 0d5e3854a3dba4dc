"""The worker's prefix cache: whole blocks of prompts served before, reused by
the next prompt that opens with them.

The cache's own rules (chained keys, the last token always computed, least
recently used leaves out first, blocks in use kept) on plain entries, then
the scheduler with the real ``tiny_lm`` decoder step: a prompt that shares
blocks with one served before prefills only the rest and generates exactly
what it does with no cache, and cached blocks give way to the sequences the
model's ``max_cache_bytes`` must hold.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence

import numpy as np
import onnxruntime as ort
import pytest
from tritonclient.grpc import model_config_pb2 as mc

from execution.backends.generate import DecoderStep, prefix_cache
from execution.backends.generate_scheduler import SamplingParams, Scheduler, SchedulerLimits, StepRow, TokenOut
from execution.backends.prefix_cache import PrefixCache
from models.decoder import BOS_ID, EOS_ID, PAD_ID, build_tiny_lm
from protos.errors import InvalidArgument, Overloaded


def entries(start: int, stop: int) -> object:
    return (start, stop)


def always(_size: int) -> bool:
    return True


def test_blocks_are_shared_only_by_prompts_agreeing_on_everything_before_them() -> None:
    cache = PrefixCache(4, 100)
    first = list(range(1, 14))  # 13 tokens: 3 full blocks
    assert cache.store(first, cache.match(first), entries, always) == 3
    same_opening = [*first[:8], 99, 98, 97, 96, 95]
    assert cache.match(same_opening).tokens == 8  # the third block differs
    # The same ids in a later block after a different opening are a different prefix.
    shifted = [0, 0, 0, 0, *first[4:8], 7]
    assert cache.match(shifted).tokens == 0
    # At least the last token is computed: a prompt of exactly the cached blocks reuses all but the last.
    assert cache.match(first[:12]).tokens == 8
    assert cache.match(first[:13]).tokens == 12
    stats = cache.stats()
    assert (stats.blocks, stats.bytes, stats.queries, stats.hits) == (3, 300, 5, 3)
    assert (stats.queried_tokens, stats.hit_tokens) == (13 + 13 + 9 + 12 + 13, 8 + 8 + 12)


def test_least_recently_used_leaves_go_first_and_blocks_in_use_stay() -> None:
    cache = PrefixCache(2, 10)
    a, b = [1, 2, 3, 4, 5], [7, 8, 9, 10, 11]
    cache.store(a, cache.match(a), entries, always)  # blocks a0 <- a1
    cache.store(b, cache.match(b), entries, always)  # blocks b0 <- b1
    cache.release(cache.match(a))  # a used again: b is now the oldest
    held = cache.match(b)  # ...but in use
    assert cache.evict(1) == 1  # a's leaf goes (b's blocks are held), never a parent before its child
    again = cache.match(a)
    assert again.tokens == 2
    cache.release(again)
    cache.release(held)
    assert cache.evict(10) == 3
    assert cache.stats().blocks == 0 and cache.stats().evicted_blocks == 4


def test_storing_stops_where_no_room_is_left() -> None:
    cache = PrefixCache(2, 10)
    prompt = list(range(9))
    assert cache.store(prompt, cache.match(prompt), entries, lambda size: cache.bytes + size <= 20) == 2
    assert cache.match(prompt).tokens == 4


# ---- the scheduler over the real tiny_lm step --------------------------------------------


@pytest.fixture(scope="module")
def step() -> DecoderStep:
    session = ort.InferenceSession(build_tiny_lm().SerializeToString(), providers=["CPUExecutionProvider"])
    return DecoderStep.onnx(session, "tiny_lm", PAD_ID)


class Recorded:
    """The real step, noting how many new tokens each row it ran had (and what extract copies)."""

    def __init__(self, step: DecoderStep) -> None:
        self._step = step
        self.rows: list[tuple[int, int]] = []  # (position, new tokens)

    def __call__(self, rows: Sequence[StepRow]) -> list[tuple[np.ndarray, object]]:
        self.rows.extend((r.position, len(r.tokens)) for r in rows)
        return self._step(rows)

    def extract(self, cache: object, start: int, stop: int) -> object:
        return self._step.extract(cache, start, stop)


async def direct(call: Callable[[], object]) -> object:
    await asyncio.sleep(0)
    return call()


SYSTEM = b"System: you are a terse assistant who answers in one line. " * 2  # 118 bytes: BOS + it = 7 blocks + 7


def make(step: Callable[..., object], caching: bool, *, max_cache_bytes: int = 64 << 20,
         block: int = 16) -> Scheduler:  # fmt: skip
    per_token = 2 * 2 * 4 * 16 * 4  # tiny_lm: 2 layers x key, value x 4 heads x 16 x float32
    limits = SchedulerLimits(8, max_cache_bytes, per_token, 512)
    return Scheduler("tiny_lm", limits, step, direct, eos_id=EOS_ID, banned=[BOS_ID, PAD_ID],  # type: ignore[arg-type]
                     prefix=PrefixCache(block, block * per_token) if caching else None)


async def generate(s: Scheduler, prompt: bytes, max_tokens: int = 12) -> tuple[bytes, list[float], TokenOut]:
    chunks: list[bytes] = []
    logprobs: list[float] = []
    ended: list[TokenOut] = []
    done = asyncio.Event()

    def emit(out: TokenOut) -> None:
        if out.data is not None:
            chunks.append(out.data)
            logprobs.append(out.logprobs.logprob if out.logprobs else float("nan"))
        else:
            ended.append(out)
            done.set()

    s.admit([BOS_ID, *prompt], SamplingParams(max_tokens=max_tokens, logprobs=2), emit, threading.Event(),
            lambda t: bytes([t]) if t < 256 else b"")
    await done.wait()  # the scheduler's own loop runs the steps
    return b"".join(chunks), logprobs, ended[0]


QUESTIONS = [b"Q: what is two plus two?", b"Q: name a colour.", b"Q: what is two plus two?", b"Q: why?"]


def test_a_shared_opening_prefills_only_the_rest_and_generates_the_same(step: DecoderStep) -> None:
    async def main() -> None:
        cold = make(step, caching=False)
        expected = [await generate(cold, SYSTEM + q) for q in QUESTIONS]
        recorded = Recorded(step)
        warm = make(recorded, caching=True)
        got = [await generate(warm, SYSTEM + q) for q in QUESTIONS]
        for (text, logprobs, end), (want_text, want_logprobs, want_end) in zip(got, expected):
            assert text == want_text and end.finish_reason == want_end.finish_reason
            assert end.prompt_tokens == want_end.prompt_tokens  # the prompt's count, cached or not
            np.testing.assert_allclose(logprobs, want_logprobs, atol=1e-5)
        prefills = [(position, new) for position, new in recorded.rows if new > 1 or position == 0]
        lengths = [1 + len(SYSTEM) + len(q) for q in QUESTIONS]
        assert prefills[0] == (0, lengths[0])  # cold
        assert prefills[1] == (112, lengths[1] - 112)  # the system prompt's 7 whole blocks (BOS + 111 bytes)
        assert prefills[2] == (128, lengths[2] - 128)  # the same prompt again: all its 8 whole blocks
        assert prefills[3] == (112, lengths[3] - 112)
        stats = warm.stats().prefix
        assert stats is not None and stats.queries == 4 and stats.hits == 3
        assert stats.hit_tokens == 112 + 128 + 112 and stats.queried_tokens == sum(lengths)
        assert stats.blocks == 8 + 1  # the first prompt's 8, the second's own eighth; the others added none
        assert warm.stats().prefix.bytes == stats.blocks * 16 * 2 * 2 * 4 * 16 * 4  # type: ignore[union-attr]

    asyncio.run(main())


def test_batched_joiners_use_the_cache_too(step: DecoderStep) -> None:
    async def main() -> None:
        warm = make(step, caching=True)
        await generate(warm, SYSTEM + b"warm up")
        cold = make(step, caching=False)
        together = [asyncio.ensure_future(generate(warm, SYSTEM + q)) for q in QUESTIONS]
        alone = [await generate(cold, SYSTEM + q) for q in QUESTIONS]
        assert [t[0] for t in await asyncio.gather(*together)] == [a[0] for a in alone]
        assert warm.stats().prefix.hits == 4  # type: ignore[union-attr]

    asyncio.run(main())


def test_cached_blocks_give_way_to_sequences(step: DecoderStep) -> None:
    async def main() -> None:
        per_token = 2 * 2 * 4 * 16 * 4
        # Room for one sequence of 200 positions: what the blocks of the first prompt take must go for the second.
        s = make(step, caching=True, max_cache_bytes=200 * per_token)
        await generate(s, SYSTEM + b"first", max_tokens=8)  # 124 + 8 positions reserved while it ran
        assert s.stats().prefix.blocks == 4  # type: ignore[union-attr]  # what fit beside them: (200 - 132) // 16
        _, _, end = await generate(s, b"another prompt entirely " * 6, max_tokens=40)  # 145 + 40: the blocks go
        assert end.error is None and end.finish_reason in ("stop", "length")
        stats = s.stats().prefix
        assert stats is not None and stats.evicted_blocks == 4 and stats.blocks == 0  # none fit beside its 185
        assert s.stats().reserved_cache_bytes == 0
        # Nothing cached can make room for a sequence that never fits: refused as before.
        with pytest.raises(InvalidArgument, match="need more cache"):
            s.admit([BOS_ID, 1], SamplingParams(max_tokens=300), lambda out: None, threading.Event(), bytes)
        # Only the admitted sequences' reservations refuse one.
        s.admit([BOS_ID, 1], SamplingParams(max_tokens=150), lambda out: None, threading.Event(), bytes)
        with pytest.raises(Overloaded, match="at capacity"):
            s.admit([BOS_ID, 2], SamplingParams(max_tokens=100), lambda out: None, threading.Event(), bytes)
        s.close()

    asyncio.run(main())


def config(**parameters: str) -> mc.ModelConfig:
    cfg = mc.ModelConfig(name="lm")
    for key, value in parameters.items():
        cfg.parameters[key].string_value = value
    return cfg


def test_the_config_turns_it_off_or_sizes_its_blocks() -> None:
    assert prefix_cache(config(), 64).block_tokens == 16  # type: ignore[union-attr]
    assert prefix_cache(config(enable_prefix_caching="false"), 64) is None
    sized = prefix_cache(config(enable_prefix_caching="true", prefix_block_tokens="32"), 64)
    assert sized is not None and (sized.block_tokens, sized.block_bytes) == (32, 32 * 64)
    with pytest.raises(InvalidArgument, match="enable_prefix_caching must be true or false"):
        prefix_cache(config(enable_prefix_caching="sometimes"), 64)
    with pytest.raises(InvalidArgument, match="prefix_block_tokens must be at least 1"):
        prefix_cache(config(prefix_block_tokens="0"), 64)
