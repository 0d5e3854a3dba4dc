"""``DecoderStep`` on the real ``tiny_lm`` graph: rows that join, leave and
keep decoding together get, step by step, the logits each gets alone.

The step feeds a batch's own output arrays back while the same rows decode
together, and gathers each row's real columns when the rows change; both
paths are driven here (joins of different prompt lengths, a row leaving
from the middle, two batches merged) and checked against a sequence decoded
by itself, one row per step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnxruntime as ort
import pytest

from execution.backends.generate import DecoderStep, RowCache
from execution.backends.generate_scheduler import StepRow
from models.decoder import BOS_ID, PAD_ID, build_tiny_lm


@pytest.fixture(scope="module")
def step() -> DecoderStep:
    session = ort.InferenceSession(build_tiny_lm().SerializeToString(), providers=["CPUExecutionProvider"])
    return DecoderStep.onnx(session, "tiny_lm", PAD_ID)


class Seq:
    """One sequence: its prompt, then greedy tokens; its cache and its logits at each step."""

    def __init__(self, prompt: bytes) -> None:
        self.tokens = [BOS_ID, *prompt]
        self.position = 0
        self.cache: object | None = None
        self.logits: list[np.ndarray] = []

    def row(self) -> StepRow:
        new = self.tokens[self.position:]
        return StepRow(new, self.position, self.cache)

    def took(self, logits: np.ndarray, cache: object) -> None:
        self.position = len(self.tokens)
        self.cache = cache
        self.logits.append(np.array(logits))
        self.tokens.append(int(logits[:256].argmax()))


def run(step: DecoderStep, seqs: Sequence[Seq]) -> None:
    for seq, (logits, cache) in zip(seqs, step([s.row() for s in seqs])):
        seq.took(logits, cache)


def alone(step: DecoderStep, prompt: bytes, steps: int) -> list[np.ndarray]:
    seq = Seq(prompt)
    for _ in range(steps):
        run(step, [seq])
    return seq.logits


def test_joins_leaves_and_merges_match_each_sequence_alone(step: DecoderStep) -> None:
    a, b, c, d = Seq(b"The quick brown fox"), Seq(b"hi"), Seq(b"a much longer prompt than the others, by far"), Seq(b"x")
    run(step, [a, b])  # prefill of two, padded
    for _ in range(3):
        run(step, [a, b])  # the same rows: the last arrays fed back
    assert a.cache.step is b.cache.step  # type: ignore[union-attr]
    run(step, [c])  # a joiner's prefill beside the running batch
    run(step, [a, b])
    for _ in range(4):
        run(step, [a, b, c])  # two batches merged, then fed back
    run(step, [d])
    for _ in range(2):
        run(step, [a, c, d])  # b left from the middle; d joined
    for _ in range(3):
        run(step, [d, c])  # another order
    for seq, prompt in ((a, b"The quick brown fox"), (b, b"hi"), (c, b"a much longer prompt than the others, by far"),
                        (d, b"x")):
        reference = alone(step, prompt, len(seq.logits))
        assert len(reference) == len(seq.logits) >= 6
        for got, want in zip(seq.logits, reference):
            np.testing.assert_allclose(got, want, rtol=0, atol=2e-4)
            assert got[:256].argmax() == want[:256].argmax()


def test_feeding_back_makes_no_copy_and_gathering_drops_padding(step: DecoderStep) -> None:
    short, long = Seq(b"ab"), Seq(b"abcdefghijkl")
    run(step, [short, long])
    first = short.cache
    assert isinstance(first, RowCache)
    run(step, [short, long])
    fed = short.cache
    assert isinstance(fed, RowCache)
    # One column more, the short row's prefill padding still masked inside it.
    assert fed.step.mask.shape == (2, first.step.mask.shape[1] + 1)
    assert int(fed.step.mask[0].sum()) == short.position
    cached, past = short.position, long.position
    run(step, [long, short])  # a new order: gathered, each row's cached columns first, then its new one
    gathered = short.cache
    assert isinstance(gathered, RowCache) and gathered.index == 1
    assert gathered.step.mask.shape == (2, past + 1)
    assert np.flatnonzero(gathered.step.mask[1]).tolist() == [*range(cached), past]
    assert gathered.step.mask[0].all()


def test_a_cache_from_elsewhere_is_refused(step: DecoderStep) -> None:
    with pytest.raises(TypeError, match="RowCache"):
        step([StepRow([65], 3, [1, 2, 3])])
