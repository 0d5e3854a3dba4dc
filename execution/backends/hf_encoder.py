"""A Hugging Face encoder as ``optimum-cli export onnx --task feature-extraction``
writes it, with its sentence-transformers files beside it, recognised and
served as an embedding model with no ``config.pbtxt``.

Recognised (:func:`is_encoder_export`): a version directory holding
``model.onnx``, ``config.json`` and ``tokenizer.json`` that is no decoder's
export (:mod:`execution.backends.hf_export`) and is an encoder's: its
config names a base model (``BertModel``, ``XLMRobertaModel``, ...: an
architecture ending in ``Model``) or a sentence-transformers
``modules.json`` lies beside it. Read from it (:func:`read_encoder`):

- ``model.onnx``: inputs ``input_ids``, ``attention_mask``, optionally
  ``token_type_ids``; output ``last_hidden_state`` (or
  ``token_embeddings``) [batch, tokens, width], or ``sentence_embedding``
  [batch, width] (an export by the sentence-transformers library, pooled and
  normalised already);
- ``config.json``: ``hidden_size`` (the width), ``vocab_size``,
  ``max_position_embeddings``, ``pad_token_id`` (what pads a shorter row);
- ``tokenizer_config.json``: ``model_max_length``;
- sentence-transformers' own files, as ``SentenceTransformer`` reads them:
  ``modules.json`` (a ``Normalize`` module listed: vectors of length 1),
  the pooling module's ``config.json`` (``1_Pooling/``: ``pooling_mode_mean_tokens``,
  ``_cls_token``, ``_max_tokens``, ``_mean_sqrt_len_tokens``, ``_lasttoken``),
  ``sentence_bert_config.json`` (``max_seq_length``, the most tokens it
  embeds, and ``do_lower_case``). Without them: mean pooling, not normalised.

The longest input is the least of ``max_position_embeddings``,
``model_max_length`` and ``max_seq_length``: sentence-transformers cuts an
input there, so an embedding of more tokens would not be the model's.

:func:`complete_encoder_config` fills the config the embedding backend
(:mod:`execution.backends.embed`) serves it with; :func:`pool` is the
pooling, in numpy.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from execution.backends.hf_export import CAUSAL_LM_ARCHITECTURES, CONFIG_FILE, export_architectures
from execution.backends.hf_tokenizer import TOKENIZER_CONFIG_FILE
from protos.errors import InvalidArgument

MODULES_FILE = "modules.json"
SENTENCE_CONFIG_FILE = "sentence_bert_config.json"
POOLING_MODULE = "sentence_transformers.models.Pooling"
NORMALIZE_MODULE = "sentence_transformers.models.Normalize"
# The backend's names for the model's contract: one text (or its token ids) a row in, one vector a row out.
TEXT_INPUT = "text_input"
IDS_INPUT = "input_ids"
MASK_INPUT = "attention_mask"
TRUNCATE_INPUT = "truncate_prompt_tokens"  # vLLM's name for the same request field
EMBEDDING_OUTPUT = "embedding"
TOKENS_OUTPUT = "prompt_tokens"
# The most inputs one request may carry (OpenAI's bound on an embeddings request's list).
MAX_INPUTS = 2048
# transformers' stand-in for "no limit" in tokenizer_config.json's model_max_length.
_UNBOUNDED = 10**18


class Pooling(Enum):
    """sentence-transformers' pooling modes, by their ``pooling_mode_*`` keys."""

    MEAN = "mean_tokens"
    CLS = "cls_token"
    MAX = "max_tokens"
    MEAN_SQRT_LEN = "mean_sqrt_len_tokens"
    LAST = "lasttoken"


@dataclass(frozen=True, slots=True)
class EncoderSettings:
    """What an encoder export's files say about embedding with it."""

    width: int
    vocab_size: int
    pad_id: int
    max_tokens: int
    max_tokens_from: str  # which file set the limit, for the message that refuses a longer input
    pooling: Pooling
    normalize: bool
    lower_case: bool
    sentence_transformers: bool  # whether its sentence-transformers files were there


def is_encoder_export(version_dir: Path) -> bool:
    """Whether the directory looks like a Hugging Face encoder exported to ONNX."""
    architectures = export_architectures(version_dir)
    if architectures is None or any(a.endswith(CAUSAL_LM_ARCHITECTURES) for a in architectures):
        return False
    return (version_dir / MODULES_FILE).is_file() or (
        bool(architectures) and all(a.endswith("Model") for a in architectures))


def _json(path: Path, model: str) -> Any:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"model '{model}': {path.name} is not JSON: {exc}") from None


def _object(path: Path, model: str) -> dict[str, Any]:
    value = _json(path, model)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidArgument(f"model '{model}': {path.name} is not a JSON object")
    return value


def _positive(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _modules(version_dir: Path, model: str) -> list[dict[str, Any]]:
    value = _json(version_dir / MODULES_FILE, model)
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
        raise InvalidArgument(f"model '{model}': {MODULES_FILE} is not a list of modules")
    return value


def _pooling(version_dir: Path, modules: list[dict[str, Any]], model: str) -> Pooling:
    module = next((m for m in modules if m.get("type") == POOLING_MODULE), None)
    if module is None:
        return Pooling.MEAN
    path = version_dir / str(module.get("path") or "") / CONFIG_FILE
    config = _object(path, model)
    modes = [p for p in Pooling if config.get(f"pooling_mode_{p.value}") is True]
    if config.get("pooling_mode_weightedmean_tokens") is True or len(modes) > 1:
        raise InvalidArgument(f"model '{model}': {path.parent.name}/{CONFIG_FILE} asks for a pooling this server "
                              f"does not run (one of {', '.join('pooling_mode_' + p.value for p in Pooling)})")
    if not modes:
        raise InvalidArgument(f"model '{model}': {path.parent.name}/{CONFIG_FILE} names no pooling mode")
    return modes[0]


def read_encoder(version_dir: Path, model: str) -> EncoderSettings:
    config = _object(version_dir / CONFIG_FILE, model)
    tokenizer = _object(version_dir / TOKENIZER_CONFIG_FILE, model)
    sentence = _object(version_dir / SENTENCE_CONFIG_FILE, model)
    modules = _modules(version_dir, model)
    width = _positive(config.get("hidden_size")) or _positive(config.get("dim")) or 0
    limits = [(_positive(config.get("max_position_embeddings")), f"max_position_embeddings in {CONFIG_FILE}"),
              (_positive(tokenizer.get("model_max_length")), f"model_max_length in {TOKENIZER_CONFIG_FILE}"),
              (_positive(sentence.get("max_seq_length")), f"max_seq_length in {SENTENCE_CONFIG_FILE}")]
    known = [(n, where) for n, where in limits if n is not None and n < _UNBOUNDED]
    max_tokens, where = min(known) if known else (0, "")
    return EncoderSettings(
        width=width, vocab_size=_positive(config.get("vocab_size")) or 0,
        pad_id=pad if isinstance(pad := config.get("pad_token_id"), int) and not isinstance(pad, bool) else 0,
        max_tokens=max_tokens,
        max_tokens_from=where, pooling=_pooling(version_dir, modules, model),
        normalize=any(m.get("type") == NORMALIZE_MODULE for m in modules),
        lower_case=sentence.get("do_lower_case") is True, sentence_transformers=bool(modules))


def _add(config: mc.ModelConfig, name: str, data_type: int, dims: list[int], *, optional: bool = False) -> None:
    tensor = config.input.add(name=name, data_type=data_type, optional=optional)
    tensor.dims.extend(dims)


def complete_encoder_config(config: mc.ModelConfig, version_dir: Path) -> mc.ModelConfig:
    """The embedding backend's config of an export: what ``config`` leaves out, from the files.

    Batched (a request's inputs are its rows), with no dynamic batching unless the config asks for
    it: an input the model refuses (too long) fails every request of the batch it rides in.
    """
    settings = read_encoder(version_dir, config.name)
    config.backend = "embed"
    if config.max_batch_size == 0:
        config.max_batch_size = MAX_INPUTS
    if not config.input:
        _add(config, TEXT_INPUT, mc.TYPE_STRING, [1], optional=True)
        _add(config, IDS_INPUT, mc.TYPE_INT64, [-1], optional=True)
        _add(config, MASK_INPUT, mc.TYPE_INT64, [-1], optional=True)
        _add(config, TRUNCATE_INPUT, mc.TYPE_INT32, [1], optional=True)
    if not config.output:
        config.output.add(name=EMBEDDING_OUTPUT, data_type=mc.TYPE_FP32, dims=[settings.width or -1])
        config.output.add(name=TOKENS_OUTPUT, data_type=mc.TYPE_INT32, dims=[1])
    params = {"hf_export": "true", "max_tokens": str(settings.max_tokens), "vocab_size": str(settings.vocab_size),
              "pooling": settings.pooling.name.lower(), "normalize": str(settings.normalize).lower()}
    for key, value in params.items():
        if key not in config.parameters:
            config.parameters[key].string_value = value
    return config


def pool(hidden: np.ndarray, mask: np.ndarray, pooling: Pooling) -> np.ndarray:
    """Token states [batch, tokens, width] and their attention mask [batch, tokens] -> [batch, width],
    as sentence-transformers' ``Pooling`` computes them (float32)."""
    weights = mask.astype(np.float32)[:, :, None]
    counts = np.clip(weights.sum(axis=1), 1e-9, None)  # its clamp: a row of no tokens divides by 1e-9
    if pooling is Pooling.CLS:
        return hidden[:, 0].astype(np.float32)
    if pooling is Pooling.MAX:
        masked = np.where(weights > 0, hidden, np.float32(-1e9))
        return masked.max(axis=1).astype(np.float32)
    if pooling is Pooling.LAST:
        last = np.maximum(mask.astype(np.int64).sum(axis=1) - 1, 0)  # right padding: the last real token
        return hidden[np.arange(hidden.shape[0]), last].astype(np.float32)
    summed = (hidden * weights).sum(axis=1, dtype=np.float32)
    if pooling is Pooling.MEAN_SQRT_LEN:
        return (summed / np.sqrt(counts)).astype(np.float32)
    return (summed / counts).astype(np.float32)


def normalize(vectors: np.ndarray) -> np.ndarray:
    """Each row to length 1, as ``torch.nn.functional.normalize(p=2, dim=1)`` (eps 1e-12)."""
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return (vectors / np.maximum(norms, 1e-12)).astype(np.float32)
