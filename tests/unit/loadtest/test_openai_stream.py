"""The timed OpenAI client's pure parts: one body line -> its event, and the
timing of a request from its chunks' arrival times (genai-perf's definitions)."""

from __future__ import annotations

import orjson
import pytest

from loadtest.openai_stream import Event, OpenAIStreamClient, StreamTiming, parse_event, timing


def _line(doc: object) -> bytes:
    return b"data: " + orjson.dumps(doc) + b"\n"


def test_events_of_completion_and_chat_chunks_usage_done_and_errors() -> None:
    assert parse_event(b"\n") is None and parse_event(b": keep-alive\n") is None
    assert parse_event(_line({"choices": [{"index": 0, "text": "ab"}]})) == Event(text="ab")
    assert parse_event(_line({"choices": [{"index": 1, "delta": {"role": "assistant", "content": "é"}}]})) == \
        Event(text="é")
    assert parse_event(_line({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})) == Event()
    assert parse_event(_line({"choices": [], "usage": {"completion_tokens": 7}})) == Event(usage_tokens=7)
    assert parse_event(b"data: [DONE]\n") == Event(done=True)
    assert parse_event(_line({"error": {"message": "boom"}})) == Event(error="boom")


def test_timing_follows_genai_perf() -> None:
    # Sent at 10; text at 10.5, 10.7, 11.5; the server counts 5 tokens (chunks may carry several).
    # The chunks' own gaps stay beside it: 3 chunks over 1 s.
    assert timing(10.0, [10.5, 10.7, 11.5], 5, 12.0) == StreamTiming(None, 0.5, 0.25, 5, 2.0, 3, 5, 0.5)
    # No usage: the chunks stand for tokens.
    assert timing(0.0, [1.0, 3.0], None, 3.0) == StreamTiming(None, 1.0, 2.0, 2, 3.0, 2, None, 2.0)
    assert timing(0.0, [1.0], 1, 1.0).itl_s is None and timing(0.0, [1.0], 1, 1.0).chunk_gap_s is None
    assert timing(0.0, [], 0, 1.0) == StreamTiming(None, None, None, 0, 1.0, usage_tokens=0)


@pytest.mark.parametrize("chat", [False, True])
async def test_request_body_asks_for_a_stream_with_usage(chat: bool) -> None:
    client = OpenAIStreamClient("http://127.0.0.1:1/v1/", "tiny_lm", chat=chat)
    try:
        doc = orjson.loads(client.body("hi", 8, seed=3, temperature=None))
    finally:
        await client.close()
    assert doc["stream"] is True and doc["stream_options"] == {"include_usage": True}
    assert doc["max_tokens"] == 8 and doc["seed"] == 3 and "temperature" not in doc
    assert (doc.get("messages"), doc.get("prompt")) == (([{"role": "user", "content": "hi"}], None) if chat
                                                        else (None, "hi"))
