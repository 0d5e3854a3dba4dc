"""Small ONNX models that some well-formed requests cannot run, as real
trained models do: the checks at the gateway and the worker pass, and ONNX
Runtime refuses the request while running it.

- ``pair`` (no batching): ``A`` FP32 [-1, 4] + ``B`` FP32 [-1, 4] -> ``SUM``.
  The two first dims must match (or one be 1): [2, 4] + [3, 4] cannot
  broadcast (ONNX Runtime's ``Fail`` from the Add kernel).
- ``encoder`` (batched, max_batch_size 8): ``TOKENS`` INT64 [n, -1] ->
  ``HIDDEN`` FP32 [n, -1, 2], a token embedding (16 ids) plus a position
  embedding of ``MAX_SEQUENCE`` positions. A token id of 16 or more indexes
  past the vocabulary (``InvalidArgument`` from Gather); a longer sequence
  gets only ``MAX_SEQUENCE`` positions (ONNX Runtime rewrites that Gather
  into a Slice), which cannot be added to its tokens (``Fail`` from Add).
- ``fill`` (no batching): ``SIZE`` INT64 [1] -> ``ZEROS`` FP32 [SIZE]. A size
  no memory holds fails to allocate: the worker cannot tell that from a
  server fault (INTERNAL), so the gateway's rule decides (the same failure on
  a second replica is the request's fault).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

MAX_SEQUENCE = 8
VOCABULARY = 16

PAIR_CONFIG = """name: "pair"
max_batch_size: 0
input [ { name: "A" data_type: TYPE_FP32 dims: [ -1, 4 ] },
        { name: "B" data_type: TYPE_FP32 dims: [ -1, 4 ] } ]
output [ { name: "SUM" data_type: TYPE_FP32 dims: [ -1, 4 ] } ]
"""

ENCODER_CONFIG = """name: "encoder"
max_batch_size: 8
input [ { name: "TOKENS" data_type: TYPE_INT64 dims: [ -1 ] } ]
output [ { name: "HIDDEN" data_type: TYPE_FP32 dims: [ -1, 2 ] } ]
"""


FILL_CONFIG = """name: "fill"
max_batch_size: 0
input [ { name: "SIZE" data_type: TYPE_INT64 dims: [ 1 ] } ]
output [ { name: "ZEROS" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""


def _model(graph: onnx.GraphProto) -> onnx.ModelProto:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10  # the newest onnx writes an IR version onnxruntime refuses
    onnx.checker.check_model(model)
    return model


def pair_model() -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("Add", ["A", "B"], ["SUM"])],
        "pair",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["N", 4]),
         helper.make_tensor_value_info("B", TensorProto.FLOAT, ["M", 4])],
        [helper.make_tensor_value_info("SUM", TensorProto.FLOAT, ["N", 4])],
    )
    return _model(graph)


def encoder_model() -> onnx.ModelProto:
    tokens = numpy_helper.from_array(np.arange(VOCABULARY * 2, dtype=np.float32).reshape(VOCABULARY, 2), "token_table")
    positions = numpy_helper.from_array(
        np.arange(MAX_SEQUENCE * 2, dtype=np.float32).reshape(MAX_SEQUENCE, 2) / 100, "position_table")
    consts = [numpy_helper.from_array(np.array(v, dtype=np.int64), n) for n, v in (("zero", 0), ("one", 1))]
    nodes = [
        helper.make_node("Gather", ["token_table", "TOKENS"], ["tok"]),  # [n, S, 2]
        helper.make_node("Shape", ["TOKENS"], ["shape"]),
        helper.make_node("Gather", ["shape", "one"], ["length"]),  # S, a scalar
        helper.make_node("Range", ["zero", "length", "one"], ["position"]),  # 0..S-1
        helper.make_node("Gather", ["position_table", "position"], ["pos"]),  # [S, 2]: fails past MAX_SEQUENCE
        helper.make_node("Add", ["tok", "pos"], ["HIDDEN"]),
    ]
    graph = helper.make_graph(
        nodes, "encoder",
        [helper.make_tensor_value_info("TOKENS", TensorProto.INT64, ["N", "S"])],
        [helper.make_tensor_value_info("HIDDEN", TensorProto.FLOAT, ["N", "S", 2])],
        [tokens, positions, *consts],
    )
    return _model(graph)


def fill_model() -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("ConstantOfShape", ["SIZE"], ["ZEROS"])], "fill",
        [helper.make_tensor_value_info("SIZE", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("ZEROS", TensorProto.FLOAT, ["L"])],
    )
    return _model(graph)


def write_repository(root: Path) -> Path:
    """A Triton-layout repository with ``pair``, ``encoder`` and ``fill`` (version 1 each)."""
    models = (("pair", pair_model(), PAIR_CONFIG), ("encoder", encoder_model(), ENCODER_CONFIG),
              ("fill", fill_model(), FILL_CONFIG))
    for name, model, config in models:
        version = root / name / "1"
        version.mkdir(parents=True, exist_ok=True)
        onnx.save(model, str(version / "model.onnx"))
        (root / name / "config.pbtxt").write_text(config)
    return root
