"""A small builder of ONNX graphs with seeded initializers: the layers the
example models are made of (dense, GELU, LayerNorm) in the exact structure
the tensor-parallel splitter depends on (``MatMul`` with a 2-D weight
initializer, then ``Add`` of the bias).
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import helper, numpy_helper

IR_VERSION = 10
OPSET = 17

Dims = list[int | str]


class GraphBuilder:
    """Accumulates nodes and seeded initializers for one ONNX graph."""

    def __init__(self, name: str, seed: int) -> None:
        self.name = name
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self._scalars: dict[float, str] = {}
        self._counter = 0

    def input(self, name: str, elem_type: int, shape: Dims) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem_type, shape))
        return name

    def output(self, name: str, elem_type: int, shape: Dims) -> None:
        self.outputs.append(helper.make_tensor_value_info(name, elem_type, shape))

    def const(self, name: str, array: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(array, name))
        return name

    def scalar(self, value: float) -> str:
        """A shared fp32 scalar initializer (0-d, so it broadcasts anywhere)."""
        if value not in self._scalars:
            self._scalars[value] = self.const(f"const_{len(self._scalars)}", np.array(value, dtype=np.float32))
        return self._scalars[value]

    def random(self, name: str, shape: tuple[int, ...], std: float, mean: float = 0.0) -> str:
        values = mean + std * self.rng.standard_normal(shape)
        return self.const(name, values.astype(np.float32))

    def op(self, op_type: str, *inputs: str, out: str | None = None, **attrs: object) -> str:
        """Appends one single-output node; its output name doubles as the node name."""
        if out is None:
            self._counter += 1
            out = f"{op_type.lower()}_{self._counter}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=out, **attrs))
        return out

    def linear(self, x: str, prefix: str, n_in: int, n_out: int, out: str | None = None) -> str:
        """``x @ W + b`` with W a 2-D [n_in, n_out] initializer (He-scaled)."""
        weight = self.random(f"{prefix}.weight", (n_in, n_out), std=math.sqrt(2.0 / n_in))
        # Non-zero biases so a split that adds a row-parallel bias twice is caught.
        bias = self.random(f"{prefix}.bias", (n_out,), std=0.05)
        return self.op("Add", self.op("MatMul", x, weight, out=f"{prefix}.matmul"), bias, out=out or f"{prefix}.out")

    def gelu(self, x: str) -> str:
        """Exact GELU, ``0.5 * x * (1 + erf(x / sqrt(2)))``: opset 17 has no Gelu op."""
        erf = self.op("Erf", self.op("Mul", x, self.scalar(1.0 / math.sqrt(2.0))))
        return self.op("Mul", self.op("Mul", x, self.op("Add", erf, self.scalar(1.0))), self.scalar(0.5))

    def layer_norm(self, x: str, prefix: str, width: int, out: str | None = None) -> str:
        scale = self.random(f"{prefix}.scale", (width,), std=0.1, mean=1.0)
        bias = self.random(f"{prefix}.bias", (width,), std=0.05)
        return self.op("LayerNormalization", x, scale, bias, out=out or f"{prefix}.out", axis=-1, epsilon=1e-5)

    def model(self) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, self.initializers)
        model = helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid("", OPSET)],
            producer_name="infergate-models",
        )
        # Set after make_model: newer onnx writes an IR version onnxruntime rejects.
        model.ir_version = IR_VERSION
        return model
