"""The shared vocabulary of the tensor-parallel rules: the :class:`Context`
they read shapes, constants and probe values from, and the :class:`Emit`
record they return (output states plus each rank's nodes and initializers).

Rules are pure: they read from the context and return everything they add,
because the splitter also calls them on hypothetical input states to decide
which collective to insert.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from splitter.graph import GraphView
from splitter.layout import State, shard_slice
from splitter.probe import Probe


@dataclass(slots=True)
class Emit:
    """What placing one node adds: output states and each rank's nodes and initializers."""

    outputs: list[State]
    nodes: list[list[onnx.NodeProto]]
    inits: list[dict[str, onnx.TensorProto]]
    note: str | None = None  # a fallback worth reporting (e.g. a weight kept whole)


@dataclass(slots=True)
class Context:
    view: GraphView
    probe: Probe
    n: int
    hints: dict[str, tuple[int, ...]]  # fused-piece layouts wanted for column-split outputs
    _used: set[str] = field(default_factory=set)
    _slices: dict[tuple[str, int, tuple[int, ...]], str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._used = set(self.view.producer) | set(self.view.initializers) | set(self.view.inputs)
        self._used |= {node.name for node in self.view.nodes}

    def shape(self, name: str, run: int = 0) -> tuple[int, ...]:
        return self.probe.shape(name, run)

    def shapes(self, name: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return self.probe.shapes[0][name], self.probe.shapes[1][name]

    def rank(self, name: str) -> int:
        return self.probe.rank(name)

    def const(self, name: str) -> np.ndarray | None:
        return self.view.const(name)

    def values(self, name: str) -> tuple[np.ndarray, np.ndarray] | None:
        a, b = self.probe.values[0].get(name), self.probe.values[1].get(name)
        return None if a is None or b is None else (a, b)

    def fresh(self, base: str) -> str:
        name, k = base, 0
        while name in self._used:
            k += 1
            name = f"{base}_{k}"
        self._used.add(name)
        return name

    def copy(self, node: onnx.NodeProto, outputs: list[State], note: str | None = None) -> Emit:
        return Emit(outputs, [[node] for _ in range(self.n)], [{} for _ in range(self.n)], note)

    def sliced(self, name: str, axis: int, pieces: tuple[int, ...]) -> tuple[str, list[onnx.TensorProto]]:
        """Per-rank slices of a constant, under one new name shared by all ranks."""
        key = (name, axis, pieces)
        if key not in self._slices:
            self._slices[key] = self.fresh(f"{name}.tp{self.n}.a{axis}")
        new = self._slices[key]
        array = self.const(name)
        assert array is not None
        return new, [numpy_helper.from_array(shard_slice(array, axis, self.n, r, pieces), new) for r in range(self.n)]

    def with_inputs(self, node: onnx.NodeProto, replace: dict[int, str], inits: list[list[onnx.TensorProto]]) -> tuple[
        list[list[onnx.NodeProto]], list[dict[str, onnx.TensorProto]]
    ]:
        """The node with some inputs renamed, plus per-rank initializers."""
        clone = onnx.NodeProto()
        clone.CopyFrom(node)
        for index, name in replace.items():
            clone.input[index] = name
        per_rank = [{t.name: t for t in (group[r] for group in inits)} for r in range(self.n)]
        return [[clone] for _ in range(self.n)], per_rank

    def constant(self, base: str, array: np.ndarray) -> onnx.TensorProto:
        return numpy_helper.from_array(array, self.fresh(base))


Rule = Callable[[Context, onnx.NodeProto, list[State]], Emit | None]


def attr(node: onnx.NodeProto, name: str, default: object) -> object:
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def static_extent(ctx: Context, name: str, axis: int) -> int | None:
    a, b = ctx.shape(name, 0)[axis], ctx.shape(name, 1)[axis]
    return a if a == b else None


def axes_of(ctx: Context, node: onnx.NodeProto, rank: int) -> list[int] | None:
    """The ``axes`` of Squeeze/Unsqueeze/Slice/Reduce*, from input 1/3 or the attribute."""
    position = 3 if node.op_type == "Slice" else 1
    if len(node.input) > position and node.input[position]:
        array = ctx.const(node.input[position])
        if array is None:
            return None
        axes = [int(a) for a in array.reshape(-1)]
    else:
        found = attr(node, "axes", None)
        if found is None:
            return None
        axes = [int(a) for a in found]  # type: ignore[union-attr]
    return [a % rank for a in axes]
