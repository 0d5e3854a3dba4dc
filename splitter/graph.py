"""Static facts about an ONNX graph that both splitters rely on: a normalised
copy (constants as initializers, unique node names, topological order), who
produces and consumes each tensor, names captured by If/Loop/Scan bodies, and
the weight bytes of initializers.
"""

from __future__ import annotations

import heapq
import logging
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

log = logging.getLogger(__name__)


class SplitError(ValueError):
    """The model cannot be split as asked; the message names the node or tensor."""


def prepare(model: onnx.ModelProto, *, split_gemm_bias: bool = False) -> onnx.ModelProto:
    """A normalised copy of ``model``.

    Constant nodes become initializers so every shard that needs a constant
    gets its own copy instead of a tensor crossing a cut; unnamed nodes get
    names so errors can point at them; nodes are put in a stable topological
    order. With ``split_gemm_bias``, ``Gemm(A, B, C)`` with a constant B
    becomes ``Gemm(A, B)`` followed by ``Add(beta * C)`` so the tensor-parallel
    rules see the bias as an ordinary Add (sliced after a column split, added
    once after the reduction of a row split).
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    inits = {t.name for t in graph.initializer}
    kept: list[onnx.NodeProto] = []
    used_names: set[str] = {n.name for n in graph.node if n.name} | inits | {i.name for i in graph.input}
    used_names |= {o for n in graph.node for o in n.output}
    for index, node in enumerate(graph.node):
        if not node.name:
            node.name = _fresh(f"{node.op_type}_{index}", used_names)
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and len(node.output) == 1:
            value = _constant_value(node)
            if value is not None:
                graph.initializer.append(value)
                inits.add(node.output[0])
                continue
        kept.append(node)
    if split_gemm_bias:
        kept = _split_gemm_bias(kept, graph, inits, used_names)
    graph.ClearField("node")
    graph.node.extend(_topological(kept, {i.name for i in graph.input} | inits))
    return out


def _fresh(base: str, used: set[str]) -> str:
    name, k = base, 0
    while name in used:
        k += 1
        name = f"{base}_{k}"
    used.add(name)
    return name


def _constant_value(node: onnx.NodeProto) -> onnx.TensorProto | None:
    attr = node.attribute[0]
    name = node.output[0]
    if attr.name == "value":
        tensor = onnx.TensorProto()
        tensor.CopyFrom(attr.t)
        tensor.name = name
        return tensor
    if attr.name == "value_float":
        return numpy_helper.from_array(np.array(attr.f, dtype=np.float32), name)
    if attr.name == "value_floats":
        return numpy_helper.from_array(np.array(list(attr.floats), dtype=np.float32), name)
    if attr.name == "value_int":
        return numpy_helper.from_array(np.array(attr.i, dtype=np.int64), name)
    if attr.name == "value_ints":
        return numpy_helper.from_array(np.array(list(attr.ints), dtype=np.int64), name)
    return None  # sparse or string constants stay nodes


def _split_gemm_bias(
    nodes: list[onnx.NodeProto], graph: onnx.GraphProto, inits: set[str], used: set[str]
) -> list[onnx.NodeProto]:
    tensors = {t.name: t for t in graph.initializer}
    out: list[onnx.NodeProto] = []
    for node in nodes:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if (
            node.op_type == "Gemm"
            and len(node.input) == 3
            and node.input[2]
            and node.input[1] in inits
            and node.input[2] in tensors
        ):
            beta = float(attrs.get("beta", 1.0))
            bias_name = node.input[2]
            if beta != 1.0:
                bias = numpy_helper.to_array(tensors[node.input[2]])
                bias_name = _fresh(f"{node.input[2]}.beta", used)
                graph.initializer.append(numpy_helper.from_array((bias * beta).astype(bias.dtype), bias_name))
                inits.add(bias_name)
            product = _fresh(f"{node.output[0]}.nobias", used)
            gemm = onnx.NodeProto()
            gemm.CopyFrom(node)
            del gemm.input[2]
            gemm.output[0] = product
            for a in list(gemm.attribute):
                if a.name == "beta":
                    gemm.attribute.remove(a)
            add = helper.make_node("Add", [product, bias_name], [node.output[0]], name=_fresh(f"{node.name}.bias", used))
            out.extend([gemm, add])
        else:
            out.append(node)
    return out


def _topological(nodes: list[onnx.NodeProto], available: set[str]) -> list[onnx.NodeProto]:
    """Kahn's algorithm, breaking ties by original position (stable)."""
    produced_by: dict[str, int] = {}
    for i, node in enumerate(nodes):
        for o in node.output:
            if o:
                produced_by[o] = i
    waiting: list[int] = [0] * len(nodes)
    dependants: dict[int, list[int]] = {}
    for i, node in enumerate(nodes):
        deps = {produced_by[x] for x in node_inputs(node) if x in produced_by and x not in available}
        deps.discard(i)
        waiting[i] = len(deps)
        for d in deps:
            dependants.setdefault(d, []).append(i)
    ready = [i for i, w in enumerate(waiting) if w == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for j in dependants.get(i, ()):
            waiting[j] -= 1
            if waiting[j] == 0:
                heapq.heappush(ready, j)
    if len(order) != len(nodes):
        stuck = next(nodes[i].name for i, w in enumerate(waiting) if w > 0)
        raise SplitError(f"graph has a cycle or a missing input near node {stuck!r}")
    return [nodes[i] for i in order]


def node_inputs(node: onnx.NodeProto) -> list[str]:
    """Explicit inputs plus outer-scope names captured by subgraph bodies."""
    names = [x for x in node.input if x]
    for attr in node.attribute:
        for sub in _subgraphs(attr):
            for name in sorted(_captured(sub)):
                if name not in names:
                    names.append(name)
    return names


def _subgraphs(attr: onnx.AttributeProto) -> list[onnx.GraphProto]:
    if attr.type == onnx.AttributeProto.GRAPH:
        return [attr.g]
    if attr.type == onnx.AttributeProto.GRAPHS:
        return list(attr.graphs)
    return []


def _captured(graph: onnx.GraphProto) -> set[str]:
    local = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    captured: set[str] = set()
    for node in graph.node:
        for name in node_inputs(node):
            if name not in local:
                captured.add(name)
        local.update(o for o in node.output if o)
    return captured


def has_subgraph(node: onnx.NodeProto) -> bool:
    return any(_subgraphs(a) for a in node.attribute)


def tensor_nbytes(tensor: onnx.TensorProto) -> int:
    count = int(np.prod(tensor.dims, dtype=np.int64)) if tensor.dims else 1
    if tensor.data_type == onnx.TensorProto.STRING:
        return sum(len(s) for s in tensor.string_data)
    return count * np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type)).itemsize


@dataclass(slots=True)
class GraphView:
    """Read-only indexes over a prepared model's main graph."""

    model: onnx.ModelProto
    nodes: list[onnx.NodeProto] = field(init=False)
    initializers: dict[str, onnx.TensorProto] = field(init=False)
    inputs: list[str] = field(init=False)
    outputs: list[str] = field(init=False)
    producer: dict[str, int] = field(init=False)
    consumers: dict[str, list[int]] = field(init=False)
    inputs_of: list[list[str]] = field(init=False)
    _arrays: dict[str, np.ndarray] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        graph = self.model.graph
        self.nodes = list(graph.node)
        self.initializers = {t.name: t for t in graph.initializer}
        self.inputs = [i.name for i in graph.input if i.name not in self.initializers]
        self.outputs = [o.name for o in graph.output]
        self.producer = {}
        self.consumers = {}
        self.inputs_of = []
        self._arrays = {}
        for index, node in enumerate(self.nodes):
            for o in node.output:
                if o:
                    self.producer[o] = index
            names = node_inputs(node)
            self.inputs_of.append(names)
            for name in names:
                self.consumers.setdefault(name, []).append(index)

    def const(self, name: str) -> np.ndarray | None:
        """The value of an initializer, or None for anything computed."""
        if name not in self.initializers:
            return None
        if name not in self._arrays:
            self._arrays[name] = numpy_helper.to_array(self.initializers[name])
        return self._arrays[name]

    def weight_bytes(self) -> int:
        return sum(tensor_nbytes(t) for t in self.initializers.values())
