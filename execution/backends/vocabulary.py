"""A generation model's vocabulary: a request's prompt as token ids, a
sequence's tokens as text, and tokens named for log probabilities.

- :class:`ByteVocabulary`: the example decoders' (``tiny_lm``): ids 0-255
  are bytes, a BOS before the prompt, ``text_input`` only;
- a Hugging Face model's: ``TokenizerVocabulary`` in
  :mod:`execution.backends.hf_tokenizer`;
- :func:`logprobs_json`: a token's log probabilities as the response
  parameter ``logprobs`` carries them (JSON: ``token``, ``bytes``,
  ``logprob``, ``top_logprobs``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from execution.backends.generate_scheduler import TokenLogprobs, TokenText
from protos.errors import InvalidArgument

@dataclass(frozen=True, slots=True)
class TokenInfo:
    """A token as log probabilities name it: its text, and its own bytes (maybe part of a character)."""

    text: str
    data: bytes


def as_bytes(value: object) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode("utf-8")


def _token_bytes(token: int) -> bytes:
    return bytes((token,)) if 0 <= token < 256 else b""


class Vocabulary(Protocol):
    """A model's tokens and text: prompt ids from a request's inputs, text from its tokens."""

    def prompt_ids(self, inputs: Mapping[str, np.ndarray]) -> list[int]:
        """The prompt's token ids (raises InvalidArgument for a request it cannot read)."""
        ...

    def text_stream(self) -> TokenText:
        """A new sequence's tokens -> its text's bytes."""
        ...

    def token_info(self, token: int) -> TokenInfo:
        """A token's text and bytes, as log probabilities name it."""
        ...

    def text_ids(self, text: str) -> list[int]:
        """Generated text's ids (``resume_text``), with no special tokens."""
        ...

    @property
    def size(self) -> int:
        """The ids a request may name (``resume_token_ids``): 0 to size - 1."""
        ...


def one_text(inputs: Mapping[str, np.ndarray], name: str) -> bytes:
    values = inputs[name].reshape(-1)
    if values.size != 1:
        raise InvalidArgument(f"input '{name}' must hold one value")
    return as_bytes(values[0])


class ByteVocabulary:
    """The example decoders' vocabulary: ids 0-255 are bytes, a BOS before the prompt."""

    def __init__(self, bos: int) -> None:
        self._bos = bos

    @property
    def size(self) -> int:
        return 256  # the bytes: a generation's BOS, EOS or padding is never sent

    def prompt_ids(self, inputs: Mapping[str, np.ndarray]) -> list[int]:
        return ([self._bos] if self._bos >= 0 else []) + list(one_text(inputs, "text_input"))

    def text_stream(self) -> TokenText:
        return _BYTES_TEXT

    def token_info(self, token: int) -> TokenInfo:
        data = _token_bytes(token)
        return TokenInfo(data.decode("utf-8", errors="replace"), data)

    def text_ids(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


class _ByteText:
    def feed(self, token: int) -> bytes:
        return _token_bytes(token)

    def flush(self) -> bytes:
        return b""


_BYTES_TEXT = _ByteText()


def logprobs_json(vocabulary: Vocabulary, logprobs: TokenLogprobs) -> str:
    """A token's log probabilities as the response parameter ``logprobs`` carries them."""

    def entry(token: int, logprob: float) -> dict[str, object]:
        info = vocabulary.token_info(token)
        return {"token": info.text, "bytes": list(info.data), "logprob": logprob}

    doc = entry(logprobs.token, logprobs.logprob)
    doc["top_logprobs"] = [entry(t, lp) for t, lp in logprobs.top]
    return json.dumps(doc, ensure_ascii=False)
