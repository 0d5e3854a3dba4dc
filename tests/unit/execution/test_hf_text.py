"""A Hugging Face model's text from its own files (``execution.backends.hf_tokenizer``)
and its serving settings (``execution.backends.hf_export``), checked against
``transformers`` reading the same files: prompts tokenized as
``tokenizer(prompt)``, chats rendered as ``apply_chat_template(...,
add_generation_prompt=True)`` (template file or inside tokenizer_config.json),
streamed text that joins to ``decode`` whatever the tokens, stop tokens and
defaults from ``generation_config.json``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from execution.backends.hf_export import is_decoder_export, read_export
from execution.backends.hf_tokenizer import HFText, TokenizerVocabulary
from protos.errors import InvalidArgument

CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hello"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo ✓ 日本語"},
     {"role": "assistant", "content": "  Hi!  "}, {"role": "user", "content": "Again?\n"}],
    [{"role": "user", "content": ""}],
]
# A template with what transformers' environment adds: loop controls, tojson, {% generation %}, raise_exception.
RICH_TEMPLATE = (
    "{%- for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}"
    "[{{ m.role | upper }}] {{ m | tojson }}"
    "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}{% endif %}"
    "{{ eos_token }}\n{% endfor %}"
    "{%- if messages | length > 8 %}{{ raise_exception('too many') }}{% endif %}"
    "{%- if add_generation_prompt %}[ASSISTANT]{% endif %}"
)


def _hf(directory: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)


def _copy(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def test_prompts_tokenize_as_transformers_does(hf_llama_source: Path) -> None:
    text, hf = HFText(hf_llama_source, "llama"), _hf(hf_llama_source)
    for prompt in ["Hello", "The quick brown fox", "Héllo wörld ✓ 日本語", "", " leading space", "a\nb\tc"]:
        assert text.encode(prompt) == hf(prompt)["input_ids"]
    assert text.encode("x")[0] == hf.bos_token_id


def test_chats_render_as_apply_chat_template(hf_llama_source: Path, tmp_path: Path) -> None:
    text, hf = HFText(hf_llama_source, "llama"), _hf(hf_llama_source)
    for chat in CHATS:
        assert text.render_chat(chat) == hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert text.encode_chat(chat) == hf.apply_chat_template(chat, add_generation_prompt=True)
    # The template inside tokenizer_config.json when there is no chat_template.jinja; a richer template.
    inside = _copy(hf_llama_source, tmp_path / "inside")
    (inside / "chat_template.jinja").unlink()
    config = json.loads((inside / "tokenizer_config.json").read_text())
    config["chat_template"] = RICH_TEMPLATE
    (inside / "tokenizer_config.json").write_text(json.dumps(config))
    text, hf = HFText(inside, "llama"), _hf(inside)
    chat = [*CHATS[1], {"role": "skip", "content": "not shown"}]
    rendered = text.render_chat(chat)
    assert rendered == hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert "[SYSTEM]" in rendered and "not shown" not in rendered and rendered.endswith("[ASSISTANT]")
    with pytest.raises(InvalidArgument, match="too many"):
        text.render_chat(CHATS[0] * 9)


def test_a_model_without_a_template_refuses_chats_and_a_broken_one_fails_its_load(hf_llama_source: Path,
                                                                                  tmp_path: Path) -> None:  # fmt: skip
    bare = _copy(hf_llama_source, tmp_path / "bare")
    (bare / "chat_template.jinja").unlink()
    with pytest.raises(InvalidArgument, match="no chat template"):
        HFText(bare, "llama").render_chat(CHATS[0])
    (bare / "chat_template.jinja").write_text("{% for m in messages %}")
    with pytest.raises(InvalidArgument, match="does not compile"):
        HFText(bare, "llama")


def test_streamed_text_joins_to_the_whole_decode_whatever_the_tokens(hf_llama_source: Path) -> None:
    text, hf = HFText(hf_llama_source, "llama"), _hf(hf_llama_source)
    vocab = hf.vocab_size
    rng = np.random.default_rng(7)
    sequences = [hf("Héllo wörld ✓ 日本語 and more")["input_ids"][1:]]  # characters split over byte tokens
    sequences += [[int(t) for t in rng.integers(0, vocab, size=int(rng.integers(1, 40)))] for _ in range(200)]
    for ids in sequences:
        detokenizer = text.detokenizer()
        pieces = [detokenizer.feed(t) for t in ids] + [detokenizer.flush()]
        joined = b"".join(pieces).decode("utf-8")  # every piece is whole characters
        assert joined == hf.decode(ids, skip_special_tokens=True), ids
    # A character split over tokens goes out whole, with the token that completes it.
    ids = hf("日")["input_ids"][1:]
    assert len(ids) > 1
    detokenizer = text.detokenizer()
    assert [detokenizer.feed(t) for t in ids] == [b""] * (len(ids) - 1) + ["日".encode()]


def test_tokens_are_named_by_their_own_bytes(hf_llama_source: Path) -> None:
    from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

    text, hf = HFText(hf_llama_source, "llama"), _hf(hf_llama_source)
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    for token in range(2, hf.vocab_size):
        info = text.token_info(token)
        assert info.data == bytes(byte_of[c] for c in hf.convert_ids_to_tokens(token))
        assert info.text == info.data.decode("utf-8", errors="replace")


def test_requests_are_read_as_a_prompt_or_a_chat(hf_llama_source: Path) -> None:
    text, hf = HFText(hf_llama_source, "llama"), _hf(hf_llama_source)
    vocabulary = TokenizerVocabulary(text)
    prompt = np.array([b"Hello"], dtype=np.object_)
    messages = np.array([json.dumps(CHATS[1]).encode()], dtype=np.object_)
    assert vocabulary.prompt_ids({"text_input": prompt}) == hf("Hello")["input_ids"]
    assert vocabulary.prompt_ids({"messages": messages}) == hf.apply_chat_template(CHATS[1], add_generation_prompt=True)
    for inputs, match in [({"text_input": prompt, "messages": messages}, "not both"), ({}, "needs"),
                          ({"messages": np.array([b"{"], dtype=np.object_)}, "not JSON"),
                          ({"messages": np.array([b"[]"], dtype=np.object_)}, "JSON list"),
                          ({"text_input": np.array([b"\xff"], dtype=np.object_)}, "UTF-8")]:
        with pytest.raises(InvalidArgument, match=match):
            vocabulary.prompt_ids(inputs)


def test_stop_tokens_and_defaults_come_from_generation_config(hf_llama_source: Path, tmp_path: Path) -> None:
    assert not is_decoder_export(hf_llama_source)  # a checkpoint, not an export: no model.onnx
    files = _copy(hf_llama_source, tmp_path / "files")
    (files / "model.onnx").write_bytes(b"")
    assert is_decoder_export(files)
    config = json.loads((files / "config.json").read_text())
    (files / "config.json").write_text(json.dumps({**config, "architectures": ["BertModel"]}))
    assert not is_decoder_export(files)  # an encoder's export has the same files
    settings = read_export(hf_llama_source, "llama")
    assert (settings.layers, settings.kv_heads, settings.head_dim, settings.max_positions) == (2, 2, 16, 512)
    assert settings.eos_ids == (1,)
    assert (settings.defaults.temperature, settings.defaults.max_tokens) == (0.0, 16)  # greedy, our default length
    sampled = _copy(hf_llama_source, tmp_path / "sampled")
    (sampled / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [1, 7], "do_sample": True, "temperature": 0.7, "top_p": 0.9, "max_new_tokens": 5}))
    settings = read_export(sampled, "llama")
    assert settings.eos_ids == (1, 7)
    d = settings.defaults
    assert (d.temperature, d.top_p, d.top_k, d.max_tokens) == (0.7, 0.9, 50, 5)  # top_k: transformers' 50
    (sampled / "generation_config.json").write_text('{"do_sample": true, "top_p": 0}')
    with pytest.raises(InvalidArgument, match="out of range"):
        read_export(sampled, "llama")


def test_a_continuation_s_text_reads_back_as_its_ids_with_no_special_tokens(hf_llama_source: Path) -> None:
    text, hf = HFText(hf_llama_source, "llama"), _hf(hf_llama_source)
    vocabulary = TokenizerVocabulary(text)
    sent = " once upon a time, wörld ✓"
    ids = vocabulary.text_ids(sent)
    assert ids == hf(sent, add_special_tokens=False)["input_ids"] and hf.bos_token_id not in ids
    assert hf.decode(ids) == sent
