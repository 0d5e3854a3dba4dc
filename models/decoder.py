"""The generative example model ``tiny_lm``: one decoder step of a small
byte-level, decoder-only transformer with an explicit KV cache, and its
``config.pbtxt`` (``backend: "generate"``, decoupled).

Owns the graph (pre-LN, learned positions, ``layers`` blocks of causal
multi-head attention and a GELU MLP, an untied LM head; seeded weights so
greedy decoding is reproducible), the vocabulary (the 256 byte values, then
BOS, EOS and PAD) and the generation settings the config carries.

One graph serves prefill and decode: it takes ``T`` new tokens of each row
after a cache of ``past`` positions, so the worker runs a whole prompt (T =
its length, past = 0) or one token per running sequence (T = 1). Rows of
different lengths are padded: ``attention_mask`` [B, past + T] marks which
cache and new positions are real (1) or padding (0), and ``position_ids``
[B, T] gives each new token its own position, so a row's result does not
depend on the rows beside it. Outputs: ``logits`` [B, T, V] and, per layer,
``present_key_<l>`` / ``present_value_<l>`` [B, H, past + T, Dh] (the past
with the new positions appended).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto
from tritonclient.grpc import model_config_pb2 as mc

from models.graph_builder import GraphBuilder

BYTE_TOKENS = 256
BOS_ID = 256
EOS_ID = 257
PAD_ID = 258
MASKED_SCORE = -1e9  # replaces a masked score: exp() of it is exactly 0, and no row is ever all masked


@dataclass(frozen=True, slots=True)
class DecoderShape:
    vocab: int = BYTE_TOKENS + 3
    d_model: int = 64
    heads: int = 4
    layers: int = 2
    d_ff: int = 256
    max_positions: int = 512

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads


TINY_LM = DecoderShape()


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """What ``tiny_lm``'s config tells the generation backend (config ``parameters``)."""

    max_sequences: int = 32  # running + waiting sequences one instance admits
    max_cache_bytes: int = 64 * 1024 * 1024  # KV cache the admitted sequences may reserve, in bytes


def _key_mask(g: GraphBuilder) -> str:
    """[B, 1, T, past + T] bool: key ``k`` is visible to new token ``q`` when it is real and not after it."""
    ids_len = g.op("Shape", "input_ids", out="mask.new_len", start=1, end=2)  # [1] = T
    total_len = g.op("Shape", "attention_mask", out="mask.total_len", start=1, end=2)  # [1] = past + T
    past_len = g.op("Sub", total_len, ids_len, out="mask.past_len")
    zero, one = g.const("mask.zero", np.array(0, dtype=np.int64)), g.const("mask.one", np.array(1, dtype=np.int64))
    squeeze_axes = g.const("mask.axes0", np.array([0], dtype=np.int64))
    queries = g.op("Range", zero, g.op("Squeeze", ids_len, squeeze_axes), one, out="mask.queries")  # [T]
    keys = g.op("Range", zero, g.op("Squeeze", total_len, squeeze_axes), one, out="mask.keys")  # [S]
    # New token q sits at cache index past + q: key k is causal for it when k - past <= q.
    key_offsets = g.op("Sub", keys, past_len, out="mask.key_offsets")  # [S]
    query_column = g.op("Unsqueeze", queries, g.const("mask.axes1", np.array([1], dtype=np.int64)))  # [T, 1]
    causal = g.op("LessOrEqual", key_offsets, query_column, out="mask.causal")  # [T, S]
    real = g.op("Cast", g.op("Unsqueeze", "attention_mask", g.const("mask.axes12", np.array([1, 2], dtype=np.int64))),
                out="mask.real", to=TensorProto.BOOL)  # [B, 1, 1, S]
    return g.op("And", causal, real, out="mask.visible")


def _attention(g: GraphBuilder, x: str, layer: int, visible: str, shape: DecoderShape) -> str:
    prefix = f"layer{layer}.attn"
    heads_shape = np.array([0, 0, shape.heads, shape.head_dim], dtype=np.int64)
    q, k, v = (g.linear(x, f"{prefix}.{n}", shape.d_model, shape.d_model) for n in ("q", "k", "v"))
    q, k, v = (g.op("Transpose", g.op("Reshape", t, g.const(f"{prefix}.{n}.heads_shape", heads_shape)), perm=[0, 2, 1, 3])
               for t, n in ((q, "q"), (k, "k"), (v, "v")))  # [B, H, T, Dh]
    keys = g.op("Concat", f"past_key_{layer}", k, out=f"present_key_{layer}", axis=2)  # [B, H, S, Dh]
    values = g.op("Concat", f"past_value_{layer}", v, out=f"present_value_{layer}", axis=2)
    scores = g.op("Mul", g.op("MatMul", q, g.op("Transpose", keys, perm=[0, 1, 3, 2])), g.scalar(1.0 / math.sqrt(shape.head_dim)))
    scores = g.op("Where", visible, scores, g.scalar(MASKED_SCORE), out=f"{prefix}.masked_scores")
    probs = g.op("Softmax", scores, out=f"{prefix}.probs", axis=-1)
    context = g.op("Transpose", g.op("MatMul", probs, values), perm=[0, 2, 1, 3])  # [B, T, H, Dh]
    merged = g.const(f"{prefix}.merge_shape", np.array([0, 0, shape.d_model], dtype=np.int64))
    return g.linear(g.op("Reshape", context, merged, out=f"{prefix}.context"), f"{prefix}.o", shape.d_model, shape.d_model)


def build_tiny_lm(shape: DecoderShape = TINY_LM, name: str = "tiny_lm", seed: int = 28) -> onnx.ModelProto:
    """One decoder step: (new tokens, their positions, the mask, the cache) -> (logits, the grown cache)."""
    g = GraphBuilder(name, seed=seed)
    width, cache_dims = shape.d_model, ["batch", shape.heads, "past", shape.head_dim]
    g.input("input_ids", TensorProto.INT64, ["batch", "new"])
    g.input("attention_mask", TensorProto.INT64, ["batch", "total"])
    g.input("position_ids", TensorProto.INT64, ["batch", "new"])
    for layer in range(shape.layers):
        g.input(f"past_key_{layer}", TensorProto.FLOAT, cache_dims)
        g.input(f"past_value_{layer}", TensorProto.FLOAT, cache_dims)
    tokens = g.random("embed.tokens", (shape.vocab, width), std=1.0)
    positions = g.random("embed.positions", (shape.max_positions, width), std=0.5)
    x = g.op("Add", g.op("Gather", tokens, "input_ids", axis=0), g.op("Gather", positions, "position_ids", axis=0),
             out="embed.out")
    visible = _key_mask(g)
    for layer in range(shape.layers):
        p = f"layer{layer}"
        x = g.op("Add", x, _attention(g, g.layer_norm(x, f"{p}.ln1", width), layer, visible, shape), out=f"{p}.attn_residual")
        hidden = g.gelu(g.linear(g.layer_norm(x, f"{p}.ln2", width), f"{p}.mlp.fc1", width, shape.d_ff))
        x = g.op("Add", x, g.linear(hidden, f"{p}.mlp.fc2", shape.d_ff, width), out=f"{p}.mlp_residual")
    # A wide spread of logits: greedy choices are far from ties, sampling has something to choose from.
    head = g.random("lm_head.weight", (width, shape.vocab), std=3.0 / math.sqrt(width))
    g.op("MatMul", g.layer_norm(x, "final_ln", width), head, out="logits")
    g.output("logits", TensorProto.FLOAT, ["batch", "new", shape.vocab])
    present_dims = ["batch", shape.heads, "total", shape.head_dim]
    for layer in range(shape.layers):
        g.output(f"present_key_{layer}", TensorProto.FLOAT, present_dims)
        g.output(f"present_value_{layer}", TensorProto.FLOAT, present_dims)
    return g.model()


def tiny_lm_config(name: str = "tiny_lm", shape: DecoderShape = TINY_LM,
                   defaults: GenerationDefaults = GenerationDefaults()) -> mc.ModelConfig:
    """The generation contract's signature, served by the worker's ``generate`` backend."""
    config = mc.ModelConfig(name=name, backend="generate", max_batch_size=0)
    config.model_transaction_policy.decoupled = True
    config.input.add(name="text_input", data_type=mc.TYPE_STRING, dims=[1])
    for input_name, data_type, dims in (("max_tokens", mc.TYPE_INT32, [1]), ("temperature", mc.TYPE_FP32, [1]),
                                        ("top_p", mc.TYPE_FP32, [1]), ("seed", mc.TYPE_UINT64, [1]),
                                        ("stop", mc.TYPE_STRING, [-1])):
        config.input.add(name=input_name, data_type=data_type, dims=dims, optional=True)
    config.output.add(name="text_output", data_type=mc.TYPE_STRING, dims=[1])
    # One instance: its scheduler batches every running sequence into each step.
    config.instance_group.add(count=1, kind=mc.ModelInstanceGroup.KIND_AUTO)
    for key, value in (("max_sequences", defaults.max_sequences), ("max_cache_bytes", defaults.max_cache_bytes),
                       ("bos_token_id", BOS_ID), ("eos_token_id", EOS_ID), ("pad_token_id", PAD_ID),
                       ("max_positions", shape.max_positions)):
        config.parameters[key].string_value = str(value)
    return config
