"""``tiny_lm``: one decoder step with an explicit KV cache, built deterministically.

Decoding token by token through the cache gives the logits of running the
whole sequence at once; a padded row gives the logits it gets alone; greedy
decoding repeats itself.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from models.decoder import BOS_ID, TINY_LM, build_tiny_lm, tiny_lm_config

LAYERS, HEADS, HEAD_DIM = TINY_LM.layers, TINY_LM.heads, TINY_LM.head_dim
Cache = list[tuple[np.ndarray, np.ndarray]]


@pytest.fixture(scope="module")
def session() -> ort.InferenceSession:
    return ort.InferenceSession(build_tiny_lm().SerializeToString(), providers=["CPUExecutionProvider"])


def _empty(batch: int) -> Cache:
    zeros = np.zeros((batch, HEADS, 0, HEAD_DIM), np.float32)
    return [(zeros, zeros) for _ in range(LAYERS)]


def _step(session: ort.InferenceSession, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray,
          past: Cache) -> tuple[np.ndarray, Cache]:
    feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": positions}
    for layer, (key, value) in enumerate(past):
        feeds[f"past_key_{layer}"], feeds[f"past_value_{layer}"] = key, value
    out = session.run(None, feeds)
    return out[0], [(out[1 + 2 * layer], out[2 + 2 * layer]) for layer in range(LAYERS)]


def _tokens(text: bytes) -> np.ndarray:
    return np.array([[BOS_ID, *text]], dtype=np.int64)


def test_build_is_deterministic_and_small() -> None:
    data = build_tiny_lm().SerializeToString()
    assert data == build_tiny_lm().SerializeToString()
    assert len(data) < 4 * 1024 * 1024


def test_cached_decoding_equals_the_full_sequence(session: ort.InferenceSession) -> None:
    seq = _tokens(b"the quick brown fox")
    n = seq.shape[1]
    full, _ = _step(session, seq, np.ones((1, n), np.int64), np.arange(n)[None], _empty(1))
    logits, past = _step(session, seq[:, :5], np.ones((1, 5), np.int64), np.arange(5)[None], _empty(1))
    steps = [logits[0, -1]]
    for i in range(5, n):
        logits, past = _step(session, seq[:, i:i + 1], np.ones((1, i + 1), np.int64), np.array([[i]]), past)
        steps.append(logits[0, -1])
    assert past[0][0].shape == (1, HEADS, n, HEAD_DIM)
    np.testing.assert_allclose(np.stack(steps), full[0, 4:], atol=1e-4)


def test_padded_rows_give_what_each_gives_alone(session: ort.InferenceSession) -> None:
    short, long = _tokens(b"hi"), _tokens(b"a longer prompt")
    alone = [_step(session, s, np.ones_like(s), np.arange(s.shape[1])[None], _empty(1))[0][0, -1] for s in (short, long)]
    width = long.shape[1]
    ids = np.zeros((2, width), np.int64)
    ids[0, :short.shape[1]], ids[1] = short[0], long[0]
    mask = (ids != 0).astype(np.int64)
    mask[0, short.shape[1]:] = 0
    mask[1] = 1
    logits, past = _step(session, ids, mask, np.tile(np.arange(width), (2, 1)), _empty(2))
    np.testing.assert_allclose(logits[0, short.shape[1] - 1], alone[0], atol=1e-4)
    np.testing.assert_allclose(logits[1, -1], alone[1], atol=1e-4)
    # One decode step on the padded cache: the short row's padding stays invisible.
    token = np.array([[65], [66]], np.int64)
    step_mask = np.concatenate([mask, np.ones((2, 1), np.int64)], axis=1)
    positions = np.array([[short.shape[1]], [width]], np.int64)
    batched, _ = _step(session, token, step_mask, positions, past)
    s = short.shape[1]
    _, short_past = _step(session, short, np.ones_like(short), np.arange(s)[None], _empty(1))
    single, _ = _step(session, token[:1], np.ones((1, s + 1), np.int64), positions[:1], short_past)
    np.testing.assert_allclose(batched[0, 0], single[0, 0], atol=1e-4)


def test_greedy_decoding_is_reproducible(session: ort.InferenceSession) -> None:
    def greedy(prompt: bytes, count: int) -> list[int]:
        seq = _tokens(prompt)
        n = seq.shape[1]
        logits, past = _step(session, seq, np.ones((1, n), np.int64), np.arange(n)[None], _empty(1))
        out: list[int] = []
        for _ in range(count):
            token = int(np.argmax(logits[0, -1]))
            out.append(token)
            logits, past = _step(session, np.array([[token]]), np.ones((1, n + 1), np.int64), np.array([[n]]), past)
            n += 1
        return out

    first = greedy(b"Once upon a time", 12)
    assert first == greedy(b"Once upon a time", 12)
    assert first != greedy(b"Something else", 12)


def test_config_is_the_generation_contract() -> None:
    config = tiny_lm_config()
    assert config.backend == "generate" and config.model_transaction_policy.decoupled
    assert [i.name for i in config.input] == ["text_input", "max_tokens", "temperature", "top_p", "seed", "stop"]
    assert all(i.optional for i in config.input[1:]) and not config.input[0].optional
    assert [o.name for o in config.output] == ["text_output"]
    assert int(config.parameters["max_sequences"].string_value) > 0
    assert int(config.parameters["max_cache_bytes"].string_value) > 0
