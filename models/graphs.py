"""The example models' ONNX graphs: ``simple``, ``mlp``, ``cnn``, ``encoder``, the
string models ``identity_string`` and ``string_to_int``, the ``classify``
ensemble's ``preprocess`` and ``postprocess`` steps, and the benchmark's
``cnn_large`` and ``encoder_large``; their weights are seeded, so every build
writes the same bytes.

The dense layers are ``MatMul(activation, 2-D weight initializer)`` followed by
``Add(bias)`` and attention reshapes use constant target shapes: the
tensor-parallel splitter depends on exactly that structure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

from models.graph_builder import GraphBuilder

# Encoder geometry, shared by the graph and the README.
VOCAB_SIZE = 1000
MAX_SEQ_LEN = 128
D_MODEL = 64
N_HEADS = 4
HEAD_DIM = D_MODEL // N_HEADS
D_FF = 256
N_LAYERS = 2


@dataclass(frozen=True, slots=True)
class EncoderShape:
    d_model: int
    heads: int
    d_ff: int
    layers: int

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads


ENCODER = EncoderShape(D_MODEL, N_HEADS, D_FF, N_LAYERS)
# ~200 MB of fp32 weights: a matrix-multiply-bound model where splitting pays.
ENCODER_LARGE = EncoderShape(d_model=1024, heads=16, d_ff=4096, layers=4)

# The `classify` ensemble: an HWC uint8 image, normalised per channel, top-k of the cnn's classes.
IMAGE_SIZE = 32
CHANNEL_MEAN = (0.485, 0.456, 0.406)
CHANNEL_STD = (0.229, 0.224, 0.225)
TOP_K = 3


def build_simple() -> onnx.ModelProto:
    """Triton's ``simple`` example: OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1."""
    g = GraphBuilder("simple", seed=0)
    a = g.input("INPUT0", TensorProto.INT32, ["batch", 16])
    b = g.input("INPUT1", TensorProto.INT32, ["batch", 16])
    g.op("Add", a, b, out="OUTPUT0")
    g.op("Sub", a, b, out="OUTPUT1")
    g.output("OUTPUT0", TensorProto.INT32, ["batch", 16])
    g.output("OUTPUT1", TensorProto.INT32, ["batch", 16])
    return g.model()


def build_mlp() -> onnx.ModelProto:
    """64 -> 256 (Relu) -> 256 (GELU) -> 10."""
    g = GraphBuilder("mlp", seed=1)
    x = g.input("INPUT", TensorProto.FLOAT, ["batch", 64])
    x = g.op("Relu", g.linear(x, "fc1", 64, 256))
    x = g.gelu(g.linear(x, "fc2", 256, 256))
    g.linear(x, "fc3", 256, 10, out="OUTPUT")
    g.output("OUTPUT", TensorProto.FLOAT, ["batch", 10])
    return g.model()


# (out_channels, max-pool after this conv); sized so one image costs about a
# millisecond of one CPU core: compute-bound, unlike `simple` and `mlp`.
_CNN_LAYERS: tuple[tuple[int, bool], ...] = ((32, True), (64, False), (64, True), (128, False))


def build_cnn() -> onnx.ModelProto:
    """3x32x32 image -> 3x3 conv stack with max-pools -> global average pool -> FC -> softmax."""
    return _conv_net("cnn", _CNN_LAYERS, seed=2)


# The bench's compute-bound model: `cnn` widened, about 1 GFLOP (5 ms of one core) an
# image; built only for the bench (`--bench`), so `make install` stays fast.
_CNN_LARGE_LAYERS: tuple[tuple[int, bool], ...] = ((64, False), (128, False), (128, True), (256, False), (256, True), (256, False))


def build_cnn_large() -> onnx.ModelProto:
    return _conv_net("cnn_large", _CNN_LARGE_LAYERS, seed=4)


def _conv_net(name: str, layers: tuple[tuple[int, bool], ...], seed: int) -> onnx.ModelProto:
    g = GraphBuilder(name, seed=seed)
    x = g.input("IMAGE", TensorProto.FLOAT, ["batch", 3, 32, 32])
    channels = 3
    for i, (out_channels, pool) in enumerate(layers):
        weight = g.random(f"conv{i}.weight", (out_channels, channels, 3, 3), std=math.sqrt(2.0 / (channels * 9)))
        bias = g.random(f"conv{i}.bias", (out_channels,), std=0.05)
        x = g.op("Relu", g.op("Conv", x, weight, bias, out=f"conv{i}.out", kernel_shape=[3, 3], pads=[1, 1, 1, 1]))
        if pool:
            x = g.op("MaxPool", x, out=f"pool{i}.out", kernel_shape=[2, 2], strides=[2, 2])
        channels = out_channels
    x = g.op("Flatten", g.op("GlobalAveragePool", x), axis=1)
    fc_weight = g.random("fc.weight", (channels, 10), std=math.sqrt(2.0 / channels))
    fc_bias = g.random("fc.bias", (10,), std=0.05)
    logits = g.op("Gemm", x, fc_weight, fc_bias, out="logits")
    g.op("Softmax", logits, out="PROBS", axis=-1)
    g.output("PROBS", TensorProto.FLOAT, ["batch", 10])
    return g.model()


def build_preprocess() -> onnx.ModelProto:
    """uint8 HWC image [N, 32, 32, 3] -> (x / 255 - mean) / std as float CHW [N, 3, 32, 32]: the cnn's input."""
    g = GraphBuilder("preprocess", seed=6)
    x = g.input("IMAGE", TensorProto.UINT8, ["batch", IMAGE_SIZE, IMAGE_SIZE, 3])
    x = g.op("Div", g.op("Cast", x, to=TensorProto.FLOAT), g.scalar(255.0))
    x = g.op("Sub", x, g.const("mean", np.array(CHANNEL_MEAN, dtype=np.float32)))
    x = g.op("Div", x, g.const("std", np.array(CHANNEL_STD, dtype=np.float32)))
    g.op("Transpose", x, out="PIXELS", perm=[0, 3, 1, 2])
    g.output("PIXELS", TensorProto.FLOAT, ["batch", 3, IMAGE_SIZE, IMAGE_SIZE])
    return g.model()


def build_postprocess() -> onnx.ModelProto:
    """Class probabilities [N, 10] -> the top-k scores [N, k] and class ids [N, k], best first."""
    g = GraphBuilder("postprocess", seed=7)
    probs = g.input("PROBS", TensorProto.FLOAT, ["batch", 10])
    k = g.const("k", np.array([TOP_K], dtype=np.int64))
    g.nodes.append(helper.make_node("TopK", [probs, k], ["SCORES", "CLASSES"], name="topk", axis=-1, largest=1, sorted=1))
    g.output("SCORES", TensorProto.FLOAT, ["batch", TOP_K])
    g.output("CLASSES", TensorProto.INT64, ["batch", TOP_K])
    return g.model()


def _attention(g: GraphBuilder, x: str, prefix: str, shape: EncoderShape) -> str:
    """Multi-head self-attention, no mask; heads split by constant-shape Reshapes."""
    heads_shape = np.array([0, 0, shape.heads, shape.head_dim], dtype=np.int64)
    q, k, v = (g.linear(x, f"{prefix}.{n}", shape.d_model, shape.d_model) for n in ("q", "k", "v"))
    # One shape initializer per Reshape, so a splitter can rewrite each independently.
    q = g.op("Reshape", q, g.const(f"{prefix}.q.heads_shape", heads_shape))
    k = g.op("Reshape", k, g.const(f"{prefix}.k.heads_shape", heads_shape))
    v = g.op("Reshape", v, g.const(f"{prefix}.v.heads_shape", heads_shape))
    q = g.op("Transpose", q, perm=[0, 2, 1, 3])  # [B, nh, S, hd]
    k = g.op("Transpose", k, perm=[0, 2, 3, 1])  # [B, nh, hd, S]
    v = g.op("Transpose", v, perm=[0, 2, 1, 3])  # [B, nh, S, hd]
    scores = g.op("Mul", g.op("MatMul", q, k), g.scalar(1.0 / math.sqrt(shape.head_dim)))
    probs = g.op("Softmax", scores, out=f"{prefix}.probs", axis=-1)
    context = g.op("Transpose", g.op("MatMul", probs, v), perm=[0, 2, 1, 3])  # [B, S, nh, hd]
    merged_shape = g.const(f"{prefix}.merge_shape", np.array([0, 0, shape.d_model], dtype=np.int64))
    context = g.op("Reshape", context, merged_shape, out=f"{prefix}.context")
    return g.linear(context, f"{prefix}.o", shape.d_model, shape.d_model)


def build_encoder(shape: EncoderShape = ENCODER, name: str = "encoder", seed: int = 3) -> onnx.ModelProto:
    """Token ids [B, S] -> pre-LN transformer encoder -> hidden states [B, S, d_model]."""
    g = GraphBuilder(name, seed=seed)
    width = shape.d_model
    tokens = g.input("TOKENS", TensorProto.INT64, ["batch", "seq"])
    token_table = g.random("embed.tokens", (VOCAB_SIZE, width), std=1.0)
    position_table = g.random("embed.positions", (MAX_SEQ_LEN, width), std=0.5)
    seq_len = g.op("Shape", tokens, out="embed.seq_len", start=1, end=2)
    positions = g.op(
        "Slice",
        position_table,
        g.const("embed.slice_start", np.array([0], dtype=np.int64)),
        seq_len,
        g.const("embed.slice_axis", np.array([0], dtype=np.int64)),
        out="embed.positions_used",
    )
    x = g.op("Add", g.op("Gather", token_table, tokens, out="embed.gather", axis=0), positions, out="embed.out")
    for layer in range(shape.layers):
        p = f"layer{layer}"
        attn = _attention(g, g.layer_norm(x, f"{p}.ln1", width), f"{p}.attn", shape)
        x = g.op("Add", x, attn, out=f"{p}.attn_residual")
        hidden = g.gelu(g.linear(g.layer_norm(x, f"{p}.ln2", width), f"{p}.mlp.fc1", width, shape.d_ff))
        x = g.op("Add", x, g.linear(hidden, f"{p}.mlp.fc2", shape.d_ff, width), out=f"{p}.mlp_residual")
    g.layer_norm(x, "final_ln", width, out="HIDDEN")
    g.output("HIDDEN", TensorProto.FLOAT, ["batch", "seq", width])
    return g.model()


def build_encoder_large() -> onnx.ModelProto:
    """``encoder`` at hidden 1024, 16 heads, FFN 4096, 4 layers (sequences up to 128 tokens)."""
    return build_encoder(ENCODER_LARGE, "encoder_large", seed=6)


def build_identity_string() -> onnx.ModelProto:
    """Triton's string identity: OUTPUT0 = INPUT0, a 1-D STRING tensor of any length (no batching)."""
    g = GraphBuilder("identity_string", seed=4)
    g.op("Identity", g.input("INPUT0", TensorProto.STRING, ["n"]), out="OUTPUT0")
    g.output("OUTPUT0", TensorProto.STRING, ["n"])
    return g.model()


def build_string_to_int() -> onnx.ModelProto:
    """One decimal string per row parsed to INT64 by ``Cast``; a non-number is refused by ONNX Runtime."""
    g = GraphBuilder("string_to_int", seed=5)
    g.op("Cast", g.input("INPUT0", TensorProto.STRING, ["batch", 1]), out="OUTPUT0", to=TensorProto.INT64)
    g.output("OUTPUT0", TensorProto.INT64, ["batch", 1])
    return g.model()
