"""A generation model as the source of a logical model: how to tell one, how
to split its decoder step, and the signature the logical model shows.

A source whose ``config.pbtxt`` says ``backend: "generate"`` (the example
``tiny_lm``) is a decoder step graph with an explicit KV cache, served under
the generation contract (``text_input`` in, one ``text_output`` token per
response, decoupled). Split, its shards run the step; the gateway runs the
decoding loop (``gateway.parallel.generation``), so the logical model keeps
the source's generation signature, not the step graph's tensors.

The step graph's inputs have a rule the splitter cannot guess:
``attention_mask``'s length is the cache's (``past_*``) plus the new tokens'
(``input_ids``, ``position_ids``). :func:`decoder_hints` gives sizes that
keep it at every size the splitter tries (T and 2T probe, T and 3T verify:
10 = 8 + 2 scales to 20 = 16 + 4 and 30 = 24 + 6). A config's own
``input_shapes`` replace them.
"""

from __future__ import annotations

from collections.abc import Sequence

import onnx
from tritonclient.grpc import model_config_pb2, service_pb2

from splitter.sizes import InputHints

GENERATE_BACKEND = "generate"
NEW_TOKENS, CACHED, TOTAL = ("new", 2), ("past", 8), ("total", 10)
_Dims = tuple[int | str | tuple[str, int], ...]


def is_generation_source(config: model_config_pb2.ModelConfig | None) -> bool:
    return config is not None and config.backend == GENERATE_BACKEND


def _static(dims: Sequence[onnx.TensorShapeProto.Dimension], index: int) -> int | None:
    if len(dims) <= index or not dims[index].HasField("dim_value"):
        return None
    return int(dims[index].dim_value)


def decoder_hints(model: onnx.ModelProto) -> InputHints:
    """Sizes for a decoder step's inputs that keep ``total = past + new``; empty for another graph."""
    shapes: dict[str, _Dims] = {}
    for tensor in model.graph.input:
        dims = tensor.type.tensor_type.shape.dim
        if tensor.name in ("input_ids", "position_ids"):
            shapes[tensor.name] = ("batch", NEW_TOKENS)
        elif tensor.name == "attention_mask":
            shapes[tensor.name] = ("batch", TOTAL)
        elif tensor.name.startswith(("past_key_", "past_value_")):
            heads, head_dim = _static(dims, 1), _static(dims, 3)
            if heads is None or head_dim is None:
                return InputHints()  # not the cache layout [batch, heads, past, head_dim] this rule is for
            shapes[tensor.name] = ("batch", heads, CACHED, head_dim)
    if "attention_mask" not in shapes or not any(name.startswith("past_key_") for name in shapes):
        return InputHints()
    return InputHints(shapes)


def generation_signature(
    name: str, source: model_config_pb2.ModelConfig,
) -> tuple[model_config_pb2.ModelConfig, service_pb2.ModelMetadataResponse]:
    """The source's generation contract under the logical model's name (its ``parameters`` kept)."""
    config = model_config_pb2.ModelConfig()
    config.CopyFrom(source)
    config.name = name
    metadata = service_pb2.ModelMetadataResponse(name=name)
    for specs, target in ((config.input, metadata.inputs), (config.output, metadata.outputs)):
        for t in specs:
            datatype = model_config_pb2.DataType.Name(t.data_type).removeprefix("TYPE_")
            target.add(name=t.name, datatype="BYTES" if datatype == "STRING" else datatype, shape=list(t.dims))
    return config, metadata
