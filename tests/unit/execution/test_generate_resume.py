"""A generation continued from the tokens a lost run sent (``resume``), on the scheduler's fake step.

For every point a run can be cut at (after each of its responses), the run
resumed from the ids those responses named sends exactly the rest of the
uninterrupted run's responses: no byte twice, none missing, the same usage
at the end. Also with a text that holds partial characters, with stop
strings across the cut, with seeded sampling, and for a run whose final
response alone was lost.
"""

from __future__ import annotations

import asyncio
import codecs
import threading
from collections.abc import Callable, Sequence

import numpy as np
import pytest

from execution.backends.generate import resume_ids
from execution.backends.generate_scheduler import SamplingParams, Scheduler, StepRow, TokenOut
from protos.errors import InvalidArgument
from protos.generation_tokens import RESUME_TOKEN_IDS, ids_text, join_texts
from tests.unit.execution.test_generate_scheduler import BOS, EOS, VOCAB, scheduler, until_idle


class Utf8Text:
    """A tokenizer-like text: each token one byte, held while it leaves a character incomplete."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token: int) -> bytes:
        return self._decoder.decode(bytes([token % 256])).encode("utf-8")

    def flush(self) -> bytes:
        return self._decoder.decode(b"", final=True).encode("utf-8")


class Recorder:
    def __init__(self) -> None:
        self.outs: list[TokenOut] = []
        self.cancelled = threading.Event()

    def emit(self, out: TokenOut) -> None:
        assert not self.outs or self.outs[-1].data is not None, "nothing after the end"
        self.outs.append(out)

    @property
    def chunks(self) -> list[TokenOut]:
        return [o for o in self.outs if o.data is not None]

    @property
    def end(self) -> TokenOut:
        assert self.outs and self.outs[-1].data is None
        return self.outs[-1]


def run(prompt: bytes, params: SamplingParams, resume: Sequence[int] = (), *, utf8: bool = False) -> Recorder:
    async def main() -> Recorder:
        s: Scheduler = scheduler()
        recorder = Recorder()
        text = Utf8Text() if utf8 else (lambda t: bytes([t % 256]))
        s.admit([BOS, *prompt], params, recorder.emit, recorder.cancelled, text, resume)  # type: ignore[arg-type]
        await until_idle(s)
        s.close()
        return recorder

    return asyncio.run(main())


def check_every_cut(prompt: bytes, params: SamplingParams, *, utf8: bool = False) -> Recorder:
    full = run(prompt, params, utf8=utf8)
    chunks = full.chunks
    assert len(chunks) >= 4, "a run long enough to cut"
    for cut in range(1, len(chunks) + 1):
        sent = [t for o in chunks[:cut] for t in o.token_ids]
        rest = run(prompt, params, sent, utf8=utf8)
        assert rest.chunks == chunks[cut:], f"cut after {cut} responses"
        assert rest.end == full.end, f"cut after {cut} responses"
    return full


def test_a_resumed_greedy_run_sends_exactly_the_rest_of_the_uninterrupted_one() -> None:
    full = check_every_cut(b"hello", SamplingParams(max_tokens=20, ignore_eos=True))
    assert [len(o.token_ids) for o in full.chunks] == [1] * len(full.chunks)
    assert full.end.completion_tokens == 20 and full.end.prompt_tokens == 6


def test_a_text_holding_partial_characters_resumes_with_its_held_bytes() -> None:
    full = check_every_cut(b"\xc3", SamplingParams(max_tokens=24, ignore_eos=True), utf8=True)
    # Some tokens completed no character alone: they are named with the response that sends their text.
    assert any(len(o.token_ids) > 1 for o in full.chunks)
    assert sum(len(o.token_ids) for o in full.chunks) <= full.end.completion_tokens


def test_stop_strings_across_the_cut_end_the_resumed_run_where_the_uninterrupted_one_ends() -> None:
    whole = run(b"hello", SamplingParams(max_tokens=20, ignore_eos=True))
    text = b"".join(o.data or b"" for o in whole.chunks)
    stop = text[9:12]  # ends the run a third of the way in, spanning several responses
    full = check_every_cut(b"hello", SamplingParams(max_tokens=20, ignore_eos=True, stop=(stop,)))
    assert full.end.finish_reason == "stop" and b"".join(o.data or b"" for o in full.chunks) == text[:text.find(stop)]


def test_seeded_sampling_resumes_on_the_same_draws() -> None:
    check_every_cut(b"seed", SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True))


def test_a_run_whose_final_response_alone_was_lost_ends_at_once() -> None:
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    full = run(b"abc", params)
    sent = [t for o in full.chunks for t in o.token_ids]
    again = run(b"abc", params, sent)
    assert again.outs == [full.end]


def test_resume_token_ids_are_read_as_json_or_a_list_and_checked() -> None:
    assert resume_ids({}, 256) == [] and resume_ids({RESUME_TOKEN_IDS: ""}, 256) == []
    assert resume_ids({RESUME_TOKEN_IDS: "[1, 2, 255]"}, 256) == [1, 2, 255]
    assert resume_ids({RESUME_TOKEN_IDS: [3, 4]}, 256) == [3, 4]
    assert resume_ids({RESUME_TOKEN_IDS: ids_text([5, 6])}, 256) == [5, 6]
    assert resume_ids({RESUME_TOKEN_IDS: join_texts([ids_text([5]), "[]", ids_text([6, 7])])}, 256) == [5, 6, 7]
    assert resume_ids({RESUME_TOKEN_IDS: "[257]"}, 256, (257,)) == [257]
    for bad in ("[1,", "{}", "[1.5]", "[true]", 7):
        with pytest.raises(InvalidArgument, match=RESUME_TOKEN_IDS):
            resume_ids({RESUME_TOKEN_IDS: bad}, 256)
    with pytest.raises(InvalidArgument, match="outside the vocabulary"):
        resume_ids({RESUME_TOKEN_IDS: "[256]"}, 256)


def ends_after(n: int) -> Callable[[Sequence[StepRow]], list[tuple[np.ndarray, object]]]:
    """A step choosing "A" n - 1 times after a two-token prompt, then a character's first byte, then EOS."""

    def step(rows: Sequence[StepRow]) -> list[tuple[np.ndarray, object]]:
        results: list[tuple[np.ndarray, object]] = []
        for row in rows:
            seen = [*(row.cache or []), *row.tokens]  # type: ignore[misc]
            generated = len(seen) - 2
            logits = np.zeros(VOCAB, dtype=np.float32)
            logits[ord("A") if generated < n - 1 else 0xE0 if generated == n - 1 else EOS] = 1.0
            results.append((logits, seen))
        return results

    return step


def test_a_run_ended_by_its_model_resumes_as_ended_when_its_last_response_named_the_end_token() -> None:
    # A text holding a partial character when the model ends: the rest goes out named by the end token.
    async def main() -> tuple[Recorder, Recorder]:
        outs: list[Recorder] = []
        for resume in ((), None):
            s: Scheduler = scheduler(step=ends_after(3))
            recorder = Recorder()
            sent = [t for o in outs[0].chunks for t in o.token_ids] if resume is None else []
            s.admit([BOS, 0xC3], SamplingParams(max_tokens=10), recorder.emit, recorder.cancelled, Utf8Text(), sent)
            await until_idle(s)
            s.close()
            outs.append(recorder)
        return outs[0], outs[1]

    full, again = asyncio.run(main())
    assert full.end.finish_reason == "stop" and full.chunks[-1].token_ids[-1] == EOS
    assert again.outs == [full.end]
