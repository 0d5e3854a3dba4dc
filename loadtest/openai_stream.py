"""A timed client of the OpenAI-compatible API for generative measurement.

:class:`OpenAIStreamClient` sends one streamed completion (or chat
completion) at a time per call over ``/v1`` and times it as genai-perf does:
time to first token (the first chunk with text, from the send), inter-token
latency (from the first to the last text chunk, over the tokens after the
first) and the output tokens the server reports (``stream_options``
``include_usage``; the text chunks when it reports none), with the text
chunks' own count and mean gap beside them (a server that streams words,
not tokens, is read by those). Errors are values
(``HTTP 429``, ``timeout``, ``connection``, ``stream error``), as in
``loadtest.clients``, so one failed request never stops a level.

The request body (:func:`completion_body`) and chunk parsing
(:func:`parse_event`) are pure functions, tested without sockets; the
bench's ``--generate -i openai`` uses both.

May import: aiohttp and orjson; nothing of the servers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

DONE = "[DONE]"


@dataclass(frozen=True, slots=True)
class StreamTiming:
    """One streamed request as the client saw it; times in seconds."""

    error: str | None
    ttft_s: float | None = None  # None when no text came
    itl_s: float | None = None   # mean gap between tokens after the first; None below two tokens
    output_tokens: int = 0
    total_s: float = 0.0
    chunks: int = 0                    # chunks with text
    usage_tokens: int | None = None    # the server's count; None when it reported none
    chunk_gap_s: float | None = None   # mean gap between text chunks; None below two chunks


@dataclass(frozen=True, slots=True)
class Event:
    """What one ``data:`` line carried."""

    text: str = ""
    usage_tokens: int | None = None
    error: str | None = None
    done: bool = False


def parse_event(line: bytes) -> Event | None:
    """The event of one line of the body (None for blank lines and comments)."""
    line = line.strip()
    if not line.startswith(b"data:"):
        return None
    payload = line[len(b"data:"):].strip()
    if payload == DONE.encode():
        return Event(done=True)
    doc: Any = orjson.loads(payload)
    if "error" in doc:
        error = doc["error"]
        return Event(error=error.get("message", "") if isinstance(error, dict) else str(error))
    text = ""
    for choice in doc.get("choices") or ():
        delta = choice.get("delta")
        text += (delta.get("content") or "") if isinstance(delta, dict) else (choice.get("text") or "")
    usage = doc.get("usage")
    return Event(text=text, usage_tokens=usage.get("completion_tokens") if isinstance(usage, dict) else None)


def completion_body(model: str, prompt: str, max_tokens: int, *, chat: bool = False, **sampling: Any) -> bytes:
    """A streamed completion (or chat completion) that reports its usage; None sampling values are left out."""
    doc: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "stream": True,
                           "stream_options": {"include_usage": True}}
    if chat:
        doc["messages"] = [{"role": "user", "content": prompt}]
    else:
        doc["prompt"] = prompt
    doc.update({k: v for k, v in sampling.items() if v is not None})
    return orjson.dumps(doc)


def timing(sent: float, text_times: list[float], usage_tokens: int | None, ended: float) -> StreamTiming:
    """The timing of a request sent at ``sent`` whose text chunks came at ``text_times``."""
    tokens = usage_tokens if usage_tokens is not None else len(text_times)
    if not text_times:
        return StreamTiming(None, None, None, tokens, ended - sent, usage_tokens=usage_tokens)
    span = text_times[-1] - text_times[0]
    itl = span / (tokens - 1) if tokens > 1 else None
    gap = span / (len(text_times) - 1) if len(text_times) > 1 else None
    return StreamTiming(None, text_times[0] - sent, itl, tokens, ended - sent, len(text_times), usage_tokens, gap)


class OpenAIStreamClient:
    """Streamed generations against ``base_url`` (e.g. ``http://127.0.0.1:8000/v1``)."""

    def __init__(self, base_url: str, model: str, *, api_key: str | None = None, chat: bool = False,
                 timeout_s: float = 60.0, clock: Callable[[], float] = time.perf_counter) -> None:
        self._url = base_url.rstrip("/") + ("/chat/completions" if chat else "/completions")
        self._model = model
        self._chat = chat
        self._clock = clock
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # No connection cap: the load generator itself bounds requests in flight.
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), headers=headers,
                                              timeout=aiohttp.ClientTimeout(total=timeout_s))

    def body(self, prompt: str, max_tokens: int, **sampling: Any) -> bytes:
        return completion_body(self._model, prompt, max_tokens, chat=self._chat, **sampling)

    async def generate(self, prompt: str, max_tokens: int, **sampling: Any) -> StreamTiming:
        body = self.body(prompt, max_tokens, **sampling)
        sent = self._clock()
        text_times: list[float] = []
        usage: int | None = None
        try:
            async with self._session.post(self._url, data=body,
                                          headers={"Content-Type": "application/json"}) as resp:
                if resp.status != 200:
                    await resp.read()
                    return StreamTiming(f"HTTP {resp.status}", total_s=self._clock() - sent)
                async for line in resp.content:
                    event = parse_event(line)
                    if event is None:
                        continue
                    if event.error is not None:
                        return StreamTiming("stream error", total_s=self._clock() - sent)
                    if event.done:
                        break
                    if event.text:
                        text_times.append(self._clock())
                    if event.usage_tokens is not None:
                        usage = event.usage_tokens
        except asyncio.TimeoutError:
            return StreamTiming("timeout", total_s=self._clock() - sent)
        except aiohttp.ClientError:
            return StreamTiming("connection", total_s=self._clock() - sent)
        return timing(sent, text_times, usage, self._clock())

    async def close(self) -> None:
        await self._session.close()
