"""The timed stream clients' reading of server-sent events, as each mode
counts responses: the streaming bench's outputs, generation's text tokens over
the generate extension, and OpenAI completion chunks (the end marker and the
tokens the usage chunk counts beyond the chunks). A fake body, a fake clock;
no sockets."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

from loadtest.generate import is_token_event, openai_token_event
from loadtest.stream_clients import (
    EventParser,
    FirstErrors,
    SseStreamSlot,
    add_merged_responses,
    generate_events,
)
from loadtest.stream_requests import is_data_event
from loadtest.streaming import StreamRecord


class FakeBody:
    """A response body arriving in the given chunks, one clock tick per chunk."""

    def __init__(self, chunks: Sequence[bytes], clock: list[float]) -> None:
        self._chunks = chunks
        self._clock = clock

    async def iter_any(self) -> AsyncIterator[bytes]:
        for chunk in self._chunks:
            self._clock[0] += 1.0
            yield chunk


class FakeResponse:
    def __init__(self, chunks: Sequence[bytes], clock: list[float]) -> None:
        self.content = FakeBody(chunks, clock)


def read(parse: EventParser, chunks: Sequence[bytes]) -> StreamRecord:
    clock = [0.0]
    slot = SseStreamSlot(session=None, url="", parse=parse, clock=lambda: clock[0],  # type: ignore[arg-type]
                         errors=FirstErrors())
    record = StreamRecord(sent_s=0.0)
    resp: Any = FakeResponse(chunks, clock)
    asyncio.run(slot.read_events(resp, record))
    return record


def test_streaming_events_with_outputs_are_responses_and_arrive_with_their_chunk() -> None:
    record = read(generate_events(is_data_event), [
        b'data: {"model_name": "m", "OUT": [1]}\n\ndata: {"OUT": [2]}\n',
        b'\ndata: {"model_name": "m", "parameters": {}}\n\n: keep-alive\n',
        b'data: {"OU', b'T": [3]}\n\n',
    ])  # fmt: skip
    assert record.arrivals_s == [1.0, 1.0, 4.0] and record.error is None


def test_an_error_event_ends_the_request() -> None:
    record = read(generate_events(is_data_event), [b'data: {"OUT": [1]}\n\ndata: {"error": "boom"}\n\n',
                                                   b'data: {"OUT": [2]}\n\n'])
    assert record.arrivals_s == [1.0] and record.error == "stream error"


def test_generation_counts_text_output_events_as_tokens() -> None:
    record = read(generate_events(is_token_event), [
        b'data: {"text_output": "a"}\n\n', b'data: {"text_output": "b"}\n\n',
        b'data: {"model_name": "lm", "parameters": {"tokens": 2}}\n\n',
    ])  # fmt: skip
    assert record.arrivals_s == [1.0, 2.0]


def test_openai_chunks_with_text_are_tokens_and_the_usage_fills_merged_ones() -> None:
    chunk = b'data: {"choices": [{"text": "%s"}]}\n\n'
    record = read(openai_token_event, [
        chunk % b"a", chunk % b"", chunk % b"bc",
        b'data: {"choices": [], "usage": {"completion_tokens": 4}}\n\ndata: [DONE]\n\n' + chunk % b"late",
    ])  # fmt: skip
    assert record.arrivals_s == [1.0, 3.0, 3.0, 3.0]
    error = read(openai_token_event, [chunk % b"a", b'data: {"error": {"message": "no"}}\n\n'])
    assert error.error == "stream error" and error.arrivals_s == [1.0]


def test_merged_responses_arrive_with_the_last() -> None:
    record = StreamRecord(sent_s=0.0, arrivals_s=[0.1, 0.2])
    add_merged_responses(record, 4)
    assert record.arrivals_s == [0.1, 0.2, 0.2, 0.2]
    add_merged_responses(record, None)
    add_merged_responses(record, 2)  # never fewer than seen
    assert len(record.arrivals_s) == 4
    empty = StreamRecord(sent_s=0.0)
    add_merged_responses(empty, 3)
    assert empty.arrivals_s == []
