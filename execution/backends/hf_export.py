"""A Hugging Face decoder as ``optimum-cli export onnx --task
text-generation-with-past`` writes it, recognised and served with no
``config.pbtxt``.

Recognised (:func:`is_decoder_export`): a version directory holding
``model.onnx``, ``config.json`` and ``tokenizer.json`` whose config names a
causal language model (an architecture ``...ForCausalLM`` or
``...LMHeadModel``: an encoder's export, with the same files, is not one;
:mod:`execution.backends.hf_encoder` takes it).
Read from it:

- ``model.onnx``: inputs ``input_ids``, ``attention_mask``, optionally
  ``position_ids``, ``past_key_values.N.key|value`` [batch, kv_heads, past,
  head_dim] (float32 or float16); outputs ``logits`` and ``present.N.key|value``;
- ``config.json``: ``max_position_embeddings`` (the context), the layer
  and head counts (``num_key_value_heads`` below ``num_attention_heads``
  is grouped-query attention: the cache holds the KV heads only), the
  token ids;
- ``generation_config.json``: ``eos_token_id`` (one or a list: every one
  ends a generation), ``pad_token_id``, and the defaults of a request that
  does not say: ``max_new_tokens``, ``do_sample`` (false: greedy),
  ``temperature``, ``top_p``, ``top_k`` (transformers' 50 when sampling and
  unset);
- the tokenizer files and chat template: :mod:`execution.backends.hf_tokenizer`.

:func:`complete_export_config` fills the config the generation backend
serves it with: decoupled; inputs ``text_input`` (a prompt, tokenized) or
``messages`` (a JSON list of chat messages, rendered by the model's
template), both optional but one required, and the generation contract's
``max_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop``; output
``text_output``. A ``config.pbtxt`` beside the export may set the
scheduler's parameters (``max_sequences``, ``max_cache_bytes``, ...) and
instance groups; what it leaves out comes from the files.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tritonclient.grpc import model_config_pb2 as mc

from execution.backends.generate_scheduler import SamplingParams
from execution.backends.hf_tokenizer import TOKENIZER_FILE
from protos.errors import InvalidArgument

MODEL_FILE = "model.onnx"
CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
DEFAULT_MAX_NEW_TOKENS = 16
TRANSFORMERS_TOP_K = 50  # GenerationConfig's default, applied when sampling
CAUSAL_LM_ARCHITECTURES = ("ForCausalLM", "LMHeadModel")
PAST_INPUT = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")


def export_architectures(version_dir: Path) -> list[str] | None:
    """The architectures config.json names, where the directory holds an export's three files
    (``model.onnx``, ``config.json``, ``tokenizer.json``); None where it does not."""
    if not all((version_dir / name).is_file() for name in (MODEL_FILE, CONFIG_FILE, TOKENIZER_FILE)):
        return None
    try:
        config = json.loads((version_dir / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    architectures = config.get("architectures") if isinstance(config, dict) else None
    if not isinstance(architectures, list):
        return None
    return [a for a in architectures if isinstance(a, str)]


def is_decoder_export(version_dir: Path) -> bool:
    """Whether the directory looks like a Hugging Face decoder exported to ONNX."""
    architectures = export_architectures(version_dir)
    return architectures is not None and any(a.endswith(CAUSAL_LM_ARCHITECTURES) for a in architectures)


def _json(path: Path, model: str) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"model '{model}': {path.name} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidArgument(f"model '{model}': {path.name} is not a JSON object")
    return value


def _ids(value: object) -> tuple[int, ...]:
    if isinstance(value, bool):
        return ()
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list):
        return tuple(v for v in value if isinstance(v, int) and not isinstance(v, bool))
    return ()


@dataclass(frozen=True, slots=True)
class ExportSettings:
    """What the export's JSON files say about serving it."""

    max_positions: int
    eos_ids: tuple[int, ...]
    pad_id: int
    layers: int
    kv_heads: int
    head_dim: int
    defaults: SamplingParams


def read_export(version_dir: Path, model: str) -> ExportSettings:
    config = _json(version_dir / CONFIG_FILE, model)
    generation = _json(version_dir / GENERATION_CONFIG_FILE, model)
    text = config.get("text_config")  # a multimodal config nests the decoder's
    if isinstance(text, dict):
        config = {**config, **text}
    heads = int(config.get("num_attention_heads") or config.get("n_head") or 0)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    hidden = int(config.get("hidden_size") or config.get("n_embd") or 0)
    head_dim = int(config.get("head_dim") or (hidden // heads if heads else 0))
    max_positions = int(config.get("max_position_embeddings") or config.get("n_positions") or 0)
    eos = _ids(generation.get("eos_token_id")) or _ids(config.get("eos_token_id"))
    pad = _ids(generation.get("pad_token_id")) or _ids(config.get("pad_token_id"))
    sample = bool(generation.get("do_sample", False))

    def number(key: str, default: float) -> float:
        value = generation.get(key)
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default

    max_new = generation.get("max_new_tokens")
    defaults = SamplingParams(
        max_tokens=int(max_new) if isinstance(max_new, int) and max_new > 0 else DEFAULT_MAX_NEW_TOKENS,
        temperature=number("temperature", 1.0) if sample else 0.0,
        top_p=number("top_p", 1.0),
        top_k=int(number("top_k", TRANSFORMERS_TOP_K if sample else 0)),
    )
    if not 0.0 < defaults.top_p <= 1.0 or defaults.top_k < 0 or defaults.temperature < 0.0:
        raise InvalidArgument(f"model '{model}': {GENERATION_CONFIG_FILE} has a temperature, top_p or top_k "
                              "out of range")
    return ExportSettings(max_positions=max_positions, eos_ids=eos, pad_id=pad[0] if pad else 0,
                          layers=int(config.get("num_hidden_layers") or config.get("n_layer") or 0),
                          kv_heads=kv_heads, head_dim=head_dim, defaults=defaults)


def _add_input(config: mc.ModelConfig, name: str, data_type: int, dims: list[int]) -> None:
    tensor = config.input.add(name=name, data_type=data_type, optional=True)
    tensor.dims.extend(dims)


def complete_export_config(config: mc.ModelConfig, version_dir: Path) -> mc.ModelConfig:
    """The generation backend's config of an export: what ``config`` leaves out, from the files."""
    settings = read_export(version_dir, config.name)
    config.backend = "generate"
    config.model_transaction_policy.decoupled = True
    if not config.input:
        for name, data_type, dims in (("text_input", mc.TYPE_STRING, [1]), ("messages", mc.TYPE_STRING, [1]),
                                      ("max_tokens", mc.TYPE_INT32, [1]), ("temperature", mc.TYPE_FP32, [1]),
                                      ("top_p", mc.TYPE_FP32, [1]), ("seed", mc.TYPE_UINT64, [1]),
                                      ("stop", mc.TYPE_STRING, [-1])):
            _add_input(config, name, data_type, dims)
    if not config.output:
        config.output.add(name="text_output", data_type=mc.TYPE_STRING, dims=[1])
    if not config.instance_group:
        config.instance_group.add(count=1)
    params: Mapping[str, str] = {"max_positions": str(settings.max_positions or 1 << 30), "hf_export": "true"}
    for key, value in params.items():
        if key not in config.parameters:
            config.parameters[key].string_value = value
    return config


def cache_names(input_names: list[str], model: str) -> tuple[int, list[str], list[str]]:
    """The layers of an export's cache, and its past inputs and present outputs in step order."""
    layers = sorted({int(m.group(1)) for name in input_names if (m := PAST_INPUT.match(name))})
    if not layers or layers != list(range(len(layers))):
        raise InvalidArgument(f"model '{model}': {MODEL_FILE} has no past_key_values.N.key/value inputs "
                              "(export it with --task text-generation-with-past)")
    pasts = [f"past_key_values.{layer}.{kind}" for layer in layers for kind in ("key", "value")]
    missing = [name for name in pasts if name not in input_names]
    if missing:
        raise InvalidArgument(f"model '{model}': {MODEL_FILE} lacks the cache inputs {missing}")
    presents = [f"present.{layer}.{kind}" for layer in layers for kind in ("key", "value")]
    return len(layers), pasts, presents
