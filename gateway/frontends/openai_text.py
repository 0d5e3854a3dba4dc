"""Text of the OpenAI-compatible API: the chat template, token bytes joined into
text, and stop strings.

- :func:`chat_messages` checks chat ``messages`` and gives them plain
  (``developer`` as ``system``, text parts joined): what a model with a
  ``messages`` input renders with its own chat template on its worker;
- :func:`render_chat` turns them into the one prompt a model without one
  reads (the template documented in docs/openai.md).
- :class:`TextJoiner` joins the bytes of streamed tokens with an incremental
  UTF-8 decoder, so a character whose bytes arrive in several tokens comes
  out whole, in the chunk that completes it; invalid bytes become U+FFFD.
- :class:`StopMatcher` finds the request's stop strings in the generated
  text as it grows and holds back a tail that could still begin one, so no
  part of a stop string ever reaches the client: a model that ignores the
  ``stop`` input (or sends the stop string's own tokens) still stops where
  OpenAI's API says.

Pure functions and small state machines, tested without sockets.

May import: what ``gateway.frontends`` may import.
"""

from __future__ import annotations

import codecs
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from protos.errors import InvalidArgument

# Roles a message may have; "developer" is OpenAI's newer name for "system".
ROLES = ("system", "developer", "user", "assistant", "tool")


class BadParameter(InvalidArgument):
    """A request field OpenAI's API would refuse; ``param`` names it in the error body."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _content_text(content: Any, where: str) -> str:
    """A message's content: a string, or a list of ``{"type": "text", "text": ...}`` parts."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        texts: list[str] = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadParameter(f"{where}: only text content parts are supported", "messages")
            texts.append(part["text"])
        return "".join(texts)
    raise BadParameter(f"{where}: content must be a string or a list of text parts", "messages")


def chat_messages(messages: Any) -> tuple[dict[str, Any], ...]:
    """``messages`` checked, each as ``{"role", "content"}`` plus its other fields (``name``,
    ``tool_calls``, ...) as sent; ``developer`` becomes ``system``, text parts one string."""
    if not isinstance(messages, list) or not messages:
        raise BadParameter("'messages' must be a non-empty list of messages", "messages")
    plain: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, Mapping):
            raise BadParameter(f"{where} must be an object", "messages")
        role = message.get("role")
        if role not in ROLES:
            raise BadParameter(f"{where}: role must be one of {', '.join(ROLES)}; got {role!r}", "messages")
        plain.append({**message, "role": "system" if role == "developer" else role,
                      "content": _content_text(message.get("content"), where)})
    return tuple(plain)


def render_chat(messages: Any) -> str:
    """The prompt of ``messages``: each as ``<|role|>\\ncontent\\n``, then ``<|assistant|>\\n``.

    A ``developer`` message renders as ``system``. The model continues after
    the last line, as the assistant.
    """
    lines = [f"<|{m['role']}|>\n{m['content']}\n" for m in chat_messages(messages)]
    lines.append("<|assistant|>\n")
    return "".join(lines)


class TextJoiner:
    """Bytes of tokens in, text out, characters never split."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, data: bytes) -> str:
        """The text that ``data`` completes ("" while a character is still partial)."""
        return self._decoder.decode(data, final=False)

    def flush(self) -> str:
        """What is left at the end: an unfinished character becomes U+FFFD."""
        return self._decoder.decode(b"", final=True)


@dataclass(slots=True)
class StopMatcher:
    """Finds the first stop string in a growing text; holds back a possible start of one."""

    stops: Sequence[str]
    _held: str = ""
    stopped: bool = False

    def feed(self, text: str) -> str:
        """The text that may go out now; sets ``stopped`` once a stop string is complete."""
        if self.stopped or not text:
            return ""
        if not self.stops:
            return text
        pending = self._held + text
        first = -1
        for stop in self.stops:
            at = pending.find(stop)
            if at >= 0 and (first < 0 or at < first):
                first = at
        if first >= 0:
            self.stopped = True
            self._held = ""
            return pending[:first]
        keep = self._tail(pending)
        self._held = pending[len(pending) - keep:] if keep else ""
        return pending[:len(pending) - keep]

    def flush(self) -> str:
        """At the end of the text: what was held back was no stop string after all."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _tail(self, text: str) -> int:
        """The length of the longest end of ``text`` that begins some stop string."""
        longest = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if stop.startswith(text[len(text) - size:]):
                    longest = size
                    break
        return longest
