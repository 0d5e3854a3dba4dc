"""A Hugging Face model's text, read from its own files: the tokenizer
(``tokenizer.json``, through the ``tokenizers`` package), its special tokens
(``tokenizer_config.json``), and its Jinja chat template
(``chat_template.jinja``, else ``chat_template`` in ``tokenizer_config.json``).

- :meth:`HFText.encode` tokenizes a prompt as ``tokenizer(prompt)`` does in
  transformers (the tokenizer's own special tokens added, a BOS for Llama);
- :meth:`HFText.render_chat` renders messages as transformers'
  ``apply_chat_template(messages, tokenize=False, add_generation_prompt=True)``
  renders them: the same sandboxed Jinja environment (``trim_blocks``,
  ``lstrip_blocks``, ``loopcontrols``, its ``tojson``, ``raise_exception``,
  ``strftime_now``), the named special tokens as variables; the rendered
  prompt is tokenized with no special tokens added (the template has them);
- :class:`Detokenizer` turns one sequence's tokens into text as they come
  (vLLM's incremental detokenisation: a window of earlier tokens decoded
  with the new ones, text held while it ends in an incomplete character),
  and at the end gives what is left, so that the pieces always join to
  ``decode(all ids, skip_special_tokens=True)``;
- :class:`TokenizerVocabulary` reads a request with it: ``text_input``
  (a prompt) or ``messages`` (a JSON list of chat messages);
- :meth:`HFText.token_info` names a token for log probabilities: its text
  and its bytes (a byte-level token's own bytes, which may be part of a
  character).

Runs on a generation instance; nothing here touches the network.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from execution.backends.generate_scheduler import TokenText
from execution.backends.vocabulary import TokenInfo, one_text
from protos.errors import InvalidArgument

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_FILE = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# transformers' named special tokens (SPECIAL_TOKENS_ATTRIBUTES), the variables a chat template sees.
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
ADDITIONAL_SPECIAL_TOKENS = "additional_special_tokens"


def _token_text(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken's dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def read_chat_template(version_dir: Path, tokenizer_config: Mapping[str, Any]) -> str | None:
    """The template transformers would use: ``chat_template.jinja`` first, else tokenizer_config's
    (a string, or a list of named templates, of which ``default``)."""
    path = version_dir / CHAT_TEMPLATE_FILE
    if path.is_file():
        return path.read_text(encoding="utf-8")
    value = tokenizer_config.get("chat_template")
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        default = named.get("default")
        return default if isinstance(default, str) else None
    return None


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object file, or {} where there is none or it is not one (transformers' files are optional)."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    return value if isinstance(value, dict) else {}


def _special_tokens(config: Mapping[str, Any], special_map: Mapping[str, Any]) -> dict[str, Any]:
    """The named special tokens as transformers' ``special_tokens_map`` gives them to a template:
    tokenizer_config.json's, else special_tokens_map.json's; the set ones only."""
    tokens: dict[str, Any] = {}
    for name in SPECIAL_TOKENS:
        text = _token_text(config.get(name))
        if text is None:
            text = _token_text(special_map.get(name))
        if text:
            tokens[name] = text
    extra = config.get(ADDITIONAL_SPECIAL_TOKENS) or special_map.get(ADDITIONAL_SPECIAL_TOKENS)
    if isinstance(extra, list):
        texts = [t for v in extra if (t := _token_text(v))]
        if texts:
            tokens[ADDITIONAL_SPECIAL_TOKENS] = texts
    return tokens


@lru_cache(maxsize=16)
def _compile(template: str) -> Any:
    """The template compiled in transformers' environment (``_compile_jinja_template``)."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: object, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:  # fmt: skip
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    class GenerationBlock(Extension):
        """``{% generation %}...{% endgeneration %}`` (transformers marks assistant text so): its body as is."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise InvalidArgument(f"the model's chat template does not compile: {exc}") from None


class HFText:
    """One model's tokenizer, special tokens and chat template."""

    def __init__(self, version_dir: Path, model: str) -> None:
        from tokenizers import Tokenizer

        self.model = model
        path = version_dir / TOKENIZER_FILE
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # the tokenizers package's own errors
            raise InvalidArgument(f"model '{model}': cannot read {TOKENIZER_FILE}: {exc}") from None
        # A tokenizer.json may carry the truncation and padding of its last training run (MiniLM's:
        # 128 tokens): transformers turns both off for a call that does not ask, and so does this,
        # so that a long input is seen whole (and refused by its length, never cut unseen).
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        config_path = version_dir / TOKENIZER_CONFIG_FILE
        config: dict[str, Any] = {}
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_text(encoding="utf-8"))
            except (ValueError, UnicodeDecodeError) as exc:
                raise InvalidArgument(f"model '{model}': {TOKENIZER_CONFIG_FILE} is not JSON: {exc}") from None
        self.special_tokens = _special_tokens(config, _read_json(version_dir / SPECIAL_TOKENS_FILE))
        self.chat_template = read_chat_template(version_dir, config)
        if self.chat_template is not None:
            _compile(self.chat_template)  # a template that cannot compile fails the load, not a request
        self._byte_level = _is_byte_level(self.tokenizer)
        self._byte_of_char = _byte_decoder() if self._byte_level else {}

    def token_id(self, text: str) -> int | None:
        return self.tokenizer.token_to_id(text)

    def encode(self, prompt: str) -> list[int]:
        """A prompt's ids, with the tokenizer's own special tokens (as ``tokenizer(prompt)``)."""
        return list(self.tokenizer.encode(prompt, add_special_tokens=True).ids)

    def render_chat(self, messages: Sequence[Mapping[str, Any]]) -> str:
        """The prompt of ``messages``, rendered as ``apply_chat_template(..., add_generation_prompt=True)``."""
        if self.chat_template is None:
            raise InvalidArgument(f"model '{self.model}' has no chat template (no {CHAT_TEMPLATE_FILE}, none in "
                                  f"{TOKENIZER_CONFIG_FILE}); send a prompt instead")
        import jinja2

        try:
            return str(_compile(self.chat_template).render(messages=list(messages), tools=None, documents=None,
                                                           add_generation_prompt=True, **self.special_tokens))
        except jinja2.exceptions.TemplateError as exc:
            raise InvalidArgument(f"model '{self.model}''s chat template refused the messages: {exc}") from None

    def encode_chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The rendered chat's ids; the template wrote its special tokens itself."""
        return list(self.tokenizer.encode(self.render_chat(messages), add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def detokenizer(self) -> "Detokenizer":
        return Detokenizer(self)

    def token_info(self, token: int) -> TokenInfo:
        """A token's text and bytes: a byte-level token's own bytes (maybe part of a character), a
        byte-fallback token ``<0xNN>`` its byte, any other its text's UTF-8."""
        piece = self.tokenizer.id_to_token(token)
        if piece is None:
            return TokenInfo("", b"")
        if self._byte_level and all(c in self._byte_of_char for c in piece):
            data = bytes(self._byte_of_char[c] for c in piece)
            return TokenInfo(data.decode("utf-8", errors="replace"), data)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                data = bytes([int(piece[3:5], 16)])
                return TokenInfo(data.decode("utf-8", errors="replace"), data)
            except ValueError:
                pass
        text = str(self.tokenizer.decode([token], skip_special_tokens=False))
        return TokenInfo(text, text.encode("utf-8"))


class TokenizerVocabulary:
    """A Hugging Face model's vocabulary: its tokenizer, and its chat template for ``messages``."""

    def __init__(self, text: HFText) -> None:
        self.text = text

    def prompt_ids(self, inputs: Mapping[str, np.ndarray]) -> list[int]:
        if "messages" in inputs:
            if "text_input" in inputs:
                raise InvalidArgument("send either 'text_input' (a prompt) or 'messages' (a chat), not both")
            try:
                messages = json.loads(one_text(inputs, "messages"))
            except ValueError as exc:
                raise InvalidArgument(f"input 'messages' is not JSON: {exc}") from None
            if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
                raise InvalidArgument("input 'messages' must be a JSON list of message objects")
            return self.text.encode_chat(messages)
        if "text_input" not in inputs:
            raise InvalidArgument("the request needs 'text_input' (a prompt) or 'messages' (a chat)")
        prompt = one_text(inputs, "text_input")
        try:
            return self.text.encode(prompt.decode("utf-8"))
        except UnicodeDecodeError:
            raise InvalidArgument("input 'text_input' is not UTF-8") from None

    def text_stream(self) -> TokenText:
        return self.text.detokenizer()

    @property
    def size(self) -> int:
        return int(self.text.tokenizer.get_vocab_size(with_added_tokens=True))

    def token_info(self, token: int) -> TokenInfo:
        return self.text.token_info(token)

    def text_ids(self, text: str) -> list[int]:
        return list(self.text.tokenizer.encode(text, add_special_tokens=False).ids)


class Detokenizer:
    """One sequence's tokens -> its text, piece by piece, never splitting a character.

    Each :meth:`feed` decodes a window of the last tokens already shown with
    the new ones and gives the text they add, unless that text ends in an
    incomplete character (held until a later token completes it). A window,
    not the new token alone, because decoders look at neighbours (a
    SentencePiece word's leading space, a byte sequence). :meth:`flush` gives
    what the whole decode has beyond what was given, so the pieces join to
    ``decode(ids)`` exactly.
    """

    def __init__(self, text: HFText) -> None:
        self._text = text
        self._ids: list[int] = []
        self._prefix = 0  # the window's start
        self._read = 0  # tokens whose text has been given
        self._given: list[str] = []

    def feed(self, token: int) -> bytes:
        self._ids.append(token)
        decode = self._text.decode
        before = decode(self._ids[self._prefix:self._read])
        now = decode(self._ids[self._prefix:])
        if len(now) <= len(before) or now.endswith("\ufffd") or not now.startswith(before):
            return b""
        piece = now[len(before):]
        self._prefix, self._read = self._read, len(self._ids)
        self._given.append(piece)
        return piece.encode("utf-8")

    def flush(self) -> bytes:
        given = "".join(self._given)
        whole = self._text.decode(self._ids)
        if not whole.startswith(given) or len(whole) == len(given):
            return b""
        self._given.append(whole[len(given):])
        return whole[len(given):].encode("utf-8")


def _is_byte_level(tokenizer: Any) -> bool:
    try:
        decoder = json.loads(tokenizer.to_str()).get("decoder") or {}
    except ValueError:
        return False
    kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders", []) if isinstance(d, dict)]
    return "ByteLevel" in kinds


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-ins for bytes, reversed: char -> byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}
