"""Which inputs a split is probed and verified on: the shapes and values a
user declares (``--input-shape``, ``--input-values``, or ``input_shapes`` /
``input_values`` in a gateway config), the symbols of the model's dynamic
input dimensions, the size plans tried for them, and the random (or given)
input arrays built from a plan.

A *symbol* is one dynamic input dimension; dims that must agree share one
(a dim_param used twice, or dims that ONNX Runtime's symbolic shape
inference merged, such as a batch on axis 0 of one input and axis 1 of a
state). Every symbol gets sizes of its own, different between the two probe
runs, so a dimension that follows any input size is seen to vary.

Size plans, tried in order until ONNX Runtime runs the model at both probe
sizes: symbols with a typical size use it (probe T and 2T, verify T and 3T:
multiples keep whatever divisibility T has); batch-like symbols (axis 0, or
named so) use 2 and 3 (verify 1 and 4); the others use multiples of 8, then
of 32 (strided convolutions, encoder-decoders), then small primes (models
with short position tables).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import helper
from tritonclient.grpc import model_config_pb2

from splitter.graph import GraphView, SplitError

_SYMBOL = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_BATCH = re.compile(r"batch|^(n|b|bs)$", re.IGNORECASE)
_SMALL = ((2, 3, 5, 7, 11, 13), (3, 5, 7, 11, 13, 17), (4, 6, 8, 9, 10, 12), (6, 10, 12, 4, 8, 9))
_UNITS = (8, 32)
VERIFY_RUNS = 3
HINT = ("pass --input-shape NAME=D0,D1,... with a typical size for dynamic axes (e.g. width:320), "
        "or --input-values NAME=FILE.npy for inputs that need real values (input_shapes / input_values "
        "in a gateway config)")


@dataclass(frozen=True, slots=True)
class InputHints:
    """What the user declared about the model's inputs.

    ``shapes[name]``: one entry per axis, an int (a static size) or a
    symbol name, optionally with a typical size (``("width", 320)``); -1 is
    an unnamed dynamic axis. ``values[name]``: an array whose values (tiled
    or cropped to each run's shape) feed that input.
    """

    shapes: Mapping[str, tuple[int | str | tuple[str, int], ...]] = field(default_factory=dict)
    values: Mapping[str, np.ndarray] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.shapes or self.values)


def parse_dims(text: str | list[object] | tuple[object, ...]) -> tuple[int | str | tuple[str, int], ...]:
    """``"batch,3,48,width:320"`` (or a list of those entries) -> dims."""
    items = text.split(",") if isinstance(text, str) else list(text)
    dims: list[int | str | tuple[str, int]] = []
    for item in items:
        token = str(item).strip()
        name, _, typical = token.partition(":")
        try:
            size = int(name)
        except ValueError:
            size = None
        if size is not None and size > 0 and not typical:
            dims.append(size)
        elif size == -1 and not typical:
            dims.append(-1)
        elif _SYMBOL.match(name) and (not typical or typical.isdigit() and int(typical) > 0):
            dims.append((name, int(typical)) if typical else name)
        else:
            raise ValueError(f"bad dimension {token!r}: use a size (48), -1 or a name (width) for a dynamic axis, "
                             "or a name with a typical size (width:320)")
    return tuple(dims)


def parse_shape_arg(text: str) -> tuple[str, tuple[int | str | tuple[str, int], ...]]:
    """``NAME=D0,D1,...`` as given to ``--input-shape``."""
    name, sep, dims = text.partition("=")
    if not sep or not name:
        raise ValueError(f"--input-shape {text!r}: expected NAME=D0,D1,... (e.g. image=batch,3,48,width:320)")
    return name, parse_dims(dims)


def load_values(name: str, path: Path) -> np.ndarray:
    """An ``.npy`` file of values for input ``name``."""
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise ValueError(f"input values for {name!r}: cannot read {path} as a .npy array: {exc}") from None


def config_shapes(config: model_config_pb2.ModelConfig) -> dict[str, tuple[int, ...]]:
    """Full input shapes a Triton config declares (-1 for the batch axis of a batching model)."""
    batch = (-1,) if config.max_batch_size > 0 else ()
    return {t.name: batch + tuple(int(d) for d in t.dims) for t in config.input}


@dataclass(frozen=True, slots=True)
class InputSpec:
    name: str
    dtype: np.dtype
    dims: tuple[int | str, ...]  # int: static size; str: a symbol


def declared_model(model: onnx.ModelProto, hints: InputHints) -> onnx.ModelProto:
    """A copy whose graph inputs carry the declared shapes, and a name for
    every dynamic dim (``<input>_d<axis>`` where the model gives none)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    inits = {t.name for t in out.graph.initializer}
    names = {i.name for i in out.graph.input if i.name not in inits}
    unknown = sorted(set(hints.shapes) - names) + sorted(set(hints.values) - names)
    if unknown:
        raise SplitError(f"declared input {unknown[0]!r} is not an input of the model (inputs: {sorted(names)})")
    for value in out.graph.input:
        if value.name in inits:
            continue
        shape = value.type.tensor_type.shape
        declared = hints.shapes.get(value.name)
        given = hints.values.get(value.name)
        if declared is not None and len(declared) != len(shape.dim):
            raise SplitError(f"--input-shape {value.name}: {len(declared)} dims given, the model's input has {len(shape.dim)}")
        if given is not None and given.ndim != len(shape.dim):
            raise SplitError(f"--input-values {value.name}: the array has {given.ndim} dims, the model's input has {len(shape.dim)}")
        for axis, dim in enumerate(shape.dim):
            entry = declared[axis] if declared is not None else None
            if isinstance(entry, tuple):
                entry = entry[0]
            if isinstance(entry, int) and entry > 0:
                dim.Clear()
                dim.dim_value = entry
            elif isinstance(entry, str):
                dim.Clear()
                dim.dim_param = entry
            elif not (dim.HasField("dim_value") and dim.dim_value > 0) and not dim.dim_param:
                dim.Clear()
                dim.dim_param = f"{value.name}_d{axis}"
    return out


def input_specs(model: onnx.ModelProto, merges: Mapping[str, str] | None = None) -> list[InputSpec]:
    """The model's real inputs, dynamic dims as (merged) symbols."""
    merges = merges or {}
    inits = {t.name for t in model.graph.initializer}
    specs = []
    for value in model.graph.input:
        if value.name in inits:
            continue
        ttype = value.type.tensor_type
        dims: list[int | str] = []
        for axis, dim in enumerate(ttype.shape.dim):
            if dim.HasField("dim_value") and dim.dim_value > 0:
                dims.append(int(dim.dim_value))
            else:
                symbol = dim.dim_param or f"axis{axis}"
                while symbol in merges and merges[symbol] != symbol:
                    symbol = merges[symbol]
                dims.append(symbol)
        specs.append(InputSpec(value.name, np.dtype(helper.tensor_dtype_to_np_dtype(ttype.elem_type)), tuple(dims)))
    return specs


def index_bounds(view: GraphView) -> dict[str, int]:
    """For integer inputs used as Gather indices into a constant table: the table size."""
    bounds: dict[str, int] = {}
    for name in view.inputs:
        for index in view.consumers.get(name, ()):
            node = view.nodes[index]
            table = view.const(node.input[0]) if node.op_type == "Gather" else None
            if table is not None and len(node.input) > 1 and node.input[1] == name:
                axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
                size = int(table.shape[axis])
                bounds[name] = min(bounds.get(name, size), size)
    return bounds


@dataclass(frozen=True, slots=True)
class SizePlan:
    """Sizes per symbol: the two probe runs, then the verification runs."""

    label: str
    probe: tuple[dict[str, int], dict[str, int]]
    verify: tuple[dict[str, int], ...]


def typical_sizes(specs: list[InputSpec], hints: InputHints, declared: Mapping[str, tuple[int, ...]]) -> dict[str, int]:
    """Typical sizes per symbol: given with the shape, read off given values,
    or static in the source's config.pbtxt (``declared``, full shapes)."""
    typical: dict[str, int] = {}
    for spec in specs:
        sources: list[list[int | None]] = []
        if spec.name in hints.shapes:
            sources.append([e[1] if isinstance(e, tuple) else None for e in hints.shapes[spec.name]])
        if spec.name in hints.values:
            sources.append([int(d) for d in hints.values[spec.name].shape])
        if spec.name in declared:
            sources.append([int(d) for d in declared[spec.name]])
        for source in sources:
            if len(source) != len(spec.dims):
                continue
            for dim, size in zip(spec.dims, source):
                if isinstance(dim, str) and size is not None and size > 0:
                    typical.setdefault(dim, size)
    return typical


def size_plans(specs: list[InputSpec], typical: Mapping[str, int]) -> list[SizePlan]:
    symbols: list[str] = []
    batch_like: set[str] = set()
    for spec in specs:
        for axis, dim in enumerate(spec.dims):
            if isinstance(dim, str):
                if dim not in symbols:
                    symbols.append(dim)
                if (axis == 0 and len(spec.dims) > 1) or _BATCH.search(dim):
                    batch_like.add(dim)
    plans: list[SizePlan] = []
    for unit in (*_UNITS, None):
        probe: tuple[dict[str, int], dict[str, int]] = ({}, {})
        verify: tuple[dict[str, int], ...] = tuple({} for _ in range(VERIFY_RUNS))
        others = 0
        for k, symbol in enumerate(symbols):
            if symbol in typical:
                t = typical[symbol]
                pair, checks = ((2, 3), (t, 4)) if t == 1 else ((t, 2 * t), (t, 3 * t))
            elif unit is None:
                pair = (_SMALL[0][k % 6], _SMALL[1][k % 6])
                checks = (_SMALL[2][k % 6], _SMALL[3][k % 6])
            elif symbol in batch_like:
                pair, checks = (2, 3), (1, 4, 5)
            else:
                multipliers = (3 + others, 5 + 2 * others)
                spare = [m for m in (2, 4, 6, 8, 10, 12) if m not in multipliers][:VERIFY_RUNS]
                pair, checks = (multipliers[0] * unit, multipliers[1] * unit), tuple(m * unit for m in spare)
                others += 1
            for run in range(2):
                probe[run][symbol] = pair[run]
            for run in range(VERIFY_RUNS):
                verify[run][symbol] = checks[run % len(checks)]
        plan = SizePlan("small" if unit is None else f"x{unit}", probe, verify)
        if all((plan.probe, plan.verify) != (p.probe, p.verify) for p in plans):
            plans.append(plan)
    return plans


def make_inputs(
    specs: list[InputSpec],
    sizes: Mapping[str, int],
    rng: np.random.Generator,
    bounds: Mapping[str, int] | None = None,
    values: Mapping[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """Inputs with each symbol at ``sizes[symbol]``: given values tiled or
    cropped to that shape, else random (integers within a Gather's table)."""
    bounds = bounds or {}
    values = values or {}
    feeds: dict[str, np.ndarray] = {}
    for spec in specs:
        shape = [sizes[d] if isinstance(d, str) else d for d in spec.dims]
        if spec.name in values:
            given = np.asarray(values[spec.name], dtype=spec.dtype)
            if given.size == 0:
                raise SplitError(f"--input-values {spec.name}: the array is empty")
            index = np.ix_(*[np.arange(size) % have for size, have in zip(shape, given.shape)]) if shape else ()
            feeds[spec.name] = np.ascontiguousarray(given[index]) if shape else given.copy()
        elif spec.dtype.kind == "f":
            feeds[spec.name] = rng.standard_normal(shape).astype(spec.dtype)
        elif spec.dtype.kind in "iu":
            feeds[spec.name] = rng.integers(0, bounds.get(spec.name, 2), size=shape).astype(spec.dtype)
        elif spec.dtype.kind == "b":
            feeds[spec.name] = rng.integers(0, 2, size=shape).astype(bool)
        else:
            raise SplitError(f"input {spec.name!r}: cannot synthesise dtype {spec.dtype}; pass --input-values {spec.name}=FILE.npy")
    return feeds
