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


def read(holder: object, start: int, stop: int) -> object:
    """A holder's entries for positions ``start``..``stop``: here, naming them."""
    return (holder, start, stop)


def serve(cache: PrefixCache, prompt: Sequence[int], holder: object) -> int:
    """One prompt's life: looked up, prefilled, held while it runs, handed back at its end; the blocks it added."""
    match = cache.match(prompt, read)
    cache.release(match)
    added = cache.hold(prompt, match, holder)
    cache.hand_back(holder, read)
    return added


def test_blocks_are_shared_only_by_prompts_agreeing_on_everything_before_them() -> None:
    cache = PrefixCache(4, 100)
    first = list(range(1, 14))  # 13 tokens: 3 full blocks
    assert serve(cache, first, "first") == 3
    same_opening = [*first[:8], 99, 98, 97, 96, 95]
    assert cache.match(same_opening, read).tokens == 8  # the third block differs
    # The same ids in a later block after a different opening are a different prefix.
    shifted = [0, 0, 0, 0, *first[4:8], 7]
    assert cache.match(shifted, read).tokens == 0
    # At least the last token is computed: a prompt of exactly the cached blocks reuses all but the last.
    assert cache.match(first[:12], read).tokens == 8
    assert cache.match(first[:13], read).tokens == 12
    stats = cache.stats()
    assert (stats.blocks, stats.bytes, stats.held_blocks, stats.queries, stats.hits) == (3, 300, 0, 5, 3)
    assert (stats.queried_tokens, stats.hit_tokens) == (13 + 13 + 9 + 12 + 13, 8 + 8 + 12)


def test_least_recently_used_leaves_go_first_and_blocks_in_use_stay() -> None:
    cache = PrefixCache(2, 10)
    a, b = [1, 2, 3, 4, 5], [7, 8, 9, 10, 11]
    serve(cache, a, "a")  # blocks a0 <- a1
    serve(cache, b, "b")  # blocks b0 <- b1
    cache.release(cache.match(a, read))  # a used again: b is now the oldest
    kept = cache.match(b, read)  # ...but in use
    assert cache.evict(1) == 1  # a's leaf goes (b's blocks are in use), never a parent before its child
    again = cache.match(a, read)
    assert again.tokens == 2
    cache.release(again)
    cache.release(kept)
    assert cache.evict(10) == 3
    assert cache.stats().blocks == 0 and cache.stats().evicted_blocks == 4


def test_a_running_sequence_holds_its_blocks_in_one_place() -> None:
    cache = PrefixCache(2, 10)
    prompt = [1, 2, 3, 4, 5, 6, 7]  # 3 full blocks
    match = cache.match(prompt, read)
    assert cache.hold(prompt, match, "first") == 3
    cache.release(match)
    # Held: cached, but their entries are the holder's (no bytes of the cache's own), and never evicted.
    assert (cache.stats().blocks, cache.stats().held_blocks, cache.bytes) == (3, 3, 0)
    assert cache.evict(3) == 0
    # A prompt opening with them reads them out of the holder's cache, and holds them too while it runs.
    second = [1, 2, 3, 4, 9, 9]
    shared = cache.match(second, read)
    assert shared.entries == (("first", 0, 2), ("first", 2, 4))
    cache.release(shared)
    assert cache.hold(second, shared, "second") == 1  # its own third block
    # The first ends: what only it held is copied out of its cache; what the second holds stays there.
    assert cache.hand_back("first", read) == 1
    assert (cache.stats().blocks, cache.stats().held_blocks, cache.bytes) == (4, 3, 10)
    again = cache.match(prompt, read)
    assert again.entries == (("second", 0, 2), ("second", 2, 4), ("first", 4, 6))  # the copy made at its end
    cache.release(again)
    # A sequence running on a block the cache held a copy of takes it over: the copy is dropped.
    assert cache.hold(prompt, again, "third") == 0
    assert (cache.stats().held_blocks, cache.bytes) == (4, 0)
    assert cache.hand_back("third", read) == 1  # the third block, which only it held
    assert cache.hand_back("second", read) == 3
    assert cache.hand_back("second", read) == 0  # once only
    assert cache.match(prompt, read).entries[0] == ("second", 0, 2)
    assert (cache.stats().blocks, cache.stats().held_blocks, cache.bytes) == (4, 0, 40)


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


class Books(Recorded):
    """The real step, checking before each that the scheduler's reservations and its prefix cache's own
    copies fit within ``limit``."""

    def __init__(self, step: DecoderStep, limit: int) -> None:
        super().__init__(step)
        self.limit = limit
        self.scheduler: Scheduler | None = None
        self.steps = 0

    def __call__(self, rows: Sequence[StepRow]) -> list[tuple[np.ndarray, object]]:
        assert self.scheduler is not None
        stats = self.scheduler.stats()
        assert stats.prefix is not None and stats.reserved_cache_bytes + stats.prefix.bytes <= self.limit
        self.steps += 1
        return super().__call__(rows)


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
        # Its 7 full blocks, held in its own cache while it ran, copied out into the room it left.
        assert s.stats().prefix.blocks == 7 and s.stats().prefix.held_blocks == 0  # type: ignore[union-attr]
        _, _, end = await generate(s, b"another prompt entirely " * 6, max_tokens=40)  # 145 + 40: the blocks go
        assert end.error is None and end.finish_reason in ("stop", "length")
        stats = s.stats().prefix
        assert stats is not None and stats.evicted_blocks == 7  # none fit beside its 185 positions
        assert stats.blocks == 9 and stats.bytes == 9 * 16 * per_token  # its own 9, copied out at its end
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


def test_a_running_prefix_takes_its_room_once(step: DecoderStep) -> None:
    """A sequence running on a cached opening holds its blocks in its own cache: the next prompt with
    that opening reads them out of it, and its reservation needs no room the cache's copy would take."""
    async def main() -> None:
        per_token = 2 * 2 * 4 * 16 * 4
        first, second = SYSTEM + QUESTIONS[0], SYSTEM + QUESTIONS[1]  # 143 and 136 tokens, 7 blocks shared
        cold = make(step, caching=False)
        want = await generate(cold, second, max_tokens=40)
        assert want[2].completion_tokens >= 16  # so it runs on past the first's 12 tokens
        # Room for the two sequences (155 + 176 positions) and 1 block more, not for a copy of the 7 blocks too.
        recorded = Recorded(step)
        s = make(recorded, caching=True, max_cache_bytes=(155 + 176 + 16) * per_token)
        await generate(s, SYSTEM + b"warm up", max_tokens=8)
        assert s.stats().prefix.blocks == 7  # type: ignore[union-attr]
        running, ended = asyncio.Event(), asyncio.Event()
        at_its_end: list[tuple[int, int, int]] = []

        def emit(out: TokenOut) -> None:
            if out.data is not None:
                running.set()
            else:
                prefix = s.stats().prefix
                assert prefix is not None
                at_its_end.append((s.stats().running, prefix.held_blocks, prefix.bytes))
                ended.set()

        s.admit([BOS_ID, *first], SamplingParams(max_tokens=12, ignore_eos=True), emit, threading.Event(),
                lambda t: bytes([t]) if t < 256 else b"")
        await running.wait()
        stats = s.stats().prefix
        assert stats is not None and (stats.blocks, stats.held_blocks, stats.bytes) == (8, 8, 0)  # all in its cache
        assert s.stats().running == 1 and not ended.is_set()  # 11 tokens to go
        got = await generate(s, second, max_tokens=40)  # admitted beside it with no eviction
        await ended.wait()
        assert got[0] == want[0] and got[2].finish_reason == want[2].finish_reason
        np.testing.assert_allclose(got[1], want[1], atol=1e-5)  # read out of the first's cache: the same numbers
        # When the first ended, the second still ran and held the 7 shared blocks (and its own eighth):
        # only the first's own eighth block was copied out.
        assert at_its_end == [(1, 8, 16 * per_token)]
        assert (112, 1 + len(second) - 112) in recorded.rows  # its prefill started after the 7 blocks
        stats = s.stats().prefix
        assert stats is not None and stats.evicted_blocks == 0 and stats.held_blocks == 0
        assert stats.blocks == 8 + 1 and stats.bytes == 9 * 16 * per_token  # copied back out as each ended

    asyncio.run(main())


def test_many_sequences_over_shared_openings_keep_the_books_and_the_tokens(step: DecoderStep) -> None:
    """24 prompts over 3 openings, arriving in waves into a cache too small for them all, some cancelled
    mid-run: every step keeps the reservations and the cache's own copies within max_cache_bytes, each
    finished sequence generates its cold tokens (a cancelled one a prefix of them), and at the end nothing
    is held or reserved."""
    per_token = 2 * 2 * 4 * 16 * 4
    openings = [SYSTEM, b"Rules: reply in French, briefly, and never repeat the question back. " * 2,
                b"Context: the user is debugging a gRPC service that drops calls at startup. " * 2]
    requests = [(openings[i % 3] + b"Q%d: tell me something?" % i, 4 + (i * 5) % 17, i % 5 == 2) for i in range(24)]
    limit = 700 * per_token  # about 4 sequences and a few openings' blocks

    async def main() -> None:
        cold = make(step, caching=False)
        want = {i: (await generate(cold, prompt, max_tokens=n))[0] for i, (prompt, n, _) in enumerate(requests)}
        books = Books(step, limit)
        s = books.scheduler = make(books, caching=True, max_cache_bytes=limit)
        got: dict[int, bytes] = {}

        async def one(i: int) -> None:
            prompt, n, cancel = requests[i]
            chunks: list[bytes] = []
            done, stop = asyncio.Event(), threading.Event()

            def emit(out: TokenOut) -> None:
                if out.data is not None:
                    chunks.append(out.data)
                    if cancel and len(chunks) == 2:
                        stop.set()  # the client goes away after two tokens
                if out.finish_reason is not None or out.error is not None or stop.is_set():
                    done.set()

            for _ in range(2000):
                try:
                    s.admit([BOS_ID, *prompt], SamplingParams(max_tokens=n, logprobs=2), emit, stop,
                            lambda t: bytes([t]) if t < 256 else b"")
                    break
                except Overloaded:  # at capacity: wait for a turn of the loop, as a client's retry would
                    await asyncio.sleep(0)
            else:
                pytest.fail(f"request {i} found no room in 2000 turns: {s.stats()}")
            await done.wait()
            got[i] = b"".join(chunks)

        for wave in range(0, 24, 6):
            await asyncio.gather(*(one(i) for i in range(wave, wave + 6)))
        for _ in range(5):  # the cancelled ones leave at the next step
            await asyncio.sleep(0)
        for i, (_, _, cancel) in enumerate(requests):
            assert want[i].startswith(got[i]) if cancel else got[i] == want[i], i
        stats, prefix = s.stats(), s.stats().prefix
        assert prefix is not None and prefix.hits > 0 and prefix.evicted_blocks > 0  # shared, and squeezed
        assert (stats.running, stats.waiting, stats.reserved_cache_bytes, prefix.held_blocks) == (0, 0, 0, 0)
        assert prefix.bytes == prefix.blocks * 16 * per_token <= limit
        assert books.steps > 24
        s.close()

    asyncio.run(main())


class Unreadable(Recorded):
    """The real step, whose caches cannot be read back out (as if copying a block ran out of memory)."""

    def extract(self, cache: object, start: int, stop: int) -> object:
        raise MemoryError("no room to copy a block")


def test_a_block_that_cannot_be_copied_empties_the_cache_and_the_sequences_go_on(
        step: DecoderStep, caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    async def main() -> None:
        cold = make(step, caching=False)
        want = await generate(cold, SYSTEM + b"second", max_tokens=4)
        s = make(Unreadable(step), caching=True)
        ends: dict[str, TokenOut] = {}
        started = asyncio.Event()

        def first(out: TokenOut) -> None:
            if out.data is not None:
                started.set()
            else:
                ends["first"] = out

        s.admit([BOS_ID, *SYSTEM, *b"first"], SamplingParams(max_tokens=30, ignore_eos=True), first,
                threading.Event(), lambda t: bytes([t]) if t < 256 else b"")
        await started.wait()
        # The same opening: its blocks would be read out of the first's cache, which fails: prefilled whole.
        text, _, end = await generate(s, SYSTEM + b"second", max_tokens=4)
        assert (text, end.finish_reason, end.error) == (want[0], want[2].finish_reason, None)
        for _ in range(1000):  # its 30 tokens: a few turns of the loop each
            if "first" in ends:
                break
            await asyncio.sleep(0)
        assert ends["first"].finish_reason == "length" and ends["first"].completion_tokens == 30
        stats = s.stats()
        assert stats.prefix is not None and (stats.prefix.blocks, stats.prefix.held_blocks) == (0, 0)
        assert (stats.running, stats.reserved_cache_bytes) == (0, 0)
        s.close()

    asyncio.run(main())
    assert "the prefix cache starts over empty" in caplog.text


class Flaky(Recorded):
    """The real step, whose copies out of a cache fail while ``failing`` is set."""

    failing = False

    def extract(self, cache: object, start: int, stop: int) -> object:
        if self.failing:
            raise MemoryError("no room to copy a block")
        return super().extract(cache, start, stop)


def test_a_joiner_beside_one_that_emptied_the_cache_keeps_the_books(step: DecoderStep) -> None:
    """Two prompts join in one step: the first's blocks are the cache's copies, the second's must be read
    out of a running sequence, which fails and empties the cache. The first's blocks are then gone from
    the cache: it holds its prompt afresh, and the cache's bytes never go below what it holds."""
    other = b"Context: the user is debugging a gRPC service that drops calls at startup. " * 2

    async def main() -> None:
        cold = make(step, caching=False)
        want = [await generate(cold, SYSTEM + b"A?", max_tokens=6), await generate(cold, other + b"B?", max_tokens=6)]
        flaky = Flaky(step)
        s = make(flaky, caching=True)
        await generate(s, SYSTEM + b"warm", max_tokens=2)  # SYSTEM's blocks: the cache's own copies
        started = asyncio.Event()

        def long(out: TokenOut) -> None:
            started.set()

        s.admit([BOS_ID, *other, *b"long"], SamplingParams(max_tokens=40, ignore_eos=True), long, threading.Event(),
                bytes)
        await started.wait()  # it holds other's blocks now
        flaky.failing = True
        both = asyncio.gather(generate(s, SYSTEM + b"A?", max_tokens=6), generate(s, other + b"B?", max_tokens=6))
        for _ in range(1000):
            stats = s.stats().prefix
            assert stats is not None and stats.bytes >= 0 and stats.held_blocks <= stats.blocks
            if s.stats().running == 3 and stats.held_blocks > 0:  # both prefilled, holding their prompts
                break
            await asyncio.sleep(0)
        else:
            pytest.fail("the two prompts never ran beside the long one")
        flaky.failing = False
        got = await both
        assert [g[0] for g in got] == [w[0] for w in want]
        for _ in range(1000):
            if s.stats().running == 0:
                break
            await asyncio.sleep(0)
        else:
            pytest.fail("the long sequence never ended")
        stats = s.stats().prefix
        assert stats is not None and stats.held_blocks == 0 and stats.bytes == stats.blocks * 16 * 2 * 2 * 4 * 16 * 4
        assert stats.blocks >= 7 + 7  # both openings cached again, from the sequences that ran after the clear
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
