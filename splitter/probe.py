"""Running a model to learn what static analysis cannot: the concrete shape,
dtype and (for small integer tensors) value of every tensor, at two input
sizes, so a splitter can tell static dimensions and static reshape-target
entries from ones that follow the batch or sequence length. Also synthesises
random inputs for probing and for verification.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from splitter.graph import GraphView, SplitError

log = logging.getLogger(__name__)

# Values given to the model's dynamic dimensions, one per distinct symbol in
# order of first appearance. The two probe runs differ in every symbol, and
# verification uses sizes used by neither, as a split must hold at any size.
PROBE_SIZES: tuple[tuple[int, ...], tuple[int, ...]] = ((2, 3, 5, 7, 11, 13), (3, 5, 7, 11, 13, 17))
VERIFY_SIZES: tuple[int, ...] = (4, 6, 8, 9, 10, 12)
_MAX_VALUE_ELEMENTS = 64  # integer tensors up to this size are recorded by value (shape arithmetic)


@dataclass(frozen=True, slots=True)
class InputSpec:
    name: str
    dtype: np.dtype
    dims: tuple[int | str, ...]  # int: static size; str: a symbol shared by equal dims


def input_specs(model: onnx.ModelProto) -> list[InputSpec]:
    """The model's real inputs; unnamed dynamic dims share a symbol per axis."""
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
            elif dim.HasField("dim_param") and dim.dim_param:
                dims.append(dim.dim_param)
            else:
                dims.append(f"axis{axis}")
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


def make_inputs(
    model: onnx.ModelProto, sizes: tuple[int, ...], rng: np.random.Generator, bounds: dict[str, int] | None = None
) -> dict[str, np.ndarray]:
    """Random inputs with the dynamic dims set from ``sizes`` (one per symbol)."""
    symbols: dict[str, int] = {}
    feeds: dict[str, np.ndarray] = {}
    bounds = bounds or {}
    for spec in input_specs(model):
        shape = []
        for dim in spec.dims:
            if isinstance(dim, str):
                if dim not in symbols:
                    symbols[dim] = sizes[len(symbols) % len(sizes)]
                shape.append(symbols[dim])
            else:
                shape.append(dim)
        if spec.dtype.kind == "f":
            feeds[spec.name] = rng.standard_normal(shape).astype(spec.dtype)
        elif spec.dtype.kind in "iu":
            feeds[spec.name] = rng.integers(0, bounds.get(spec.name, 2), size=shape).astype(spec.dtype)
        elif spec.dtype.kind == "b":
            feeds[spec.name] = rng.integers(0, 2, size=shape).astype(bool)
        else:
            raise ValueError(f"input {spec.name!r}: cannot synthesise dtype {spec.dtype}")
    return feeds


def cpu_session(model: onnx.ModelProto | bytes, threads: int = 1) -> ort.InferenceSession:
    """An ONNX Runtime session on the CPU provider (splitting and checking are offline work)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    data = model if isinstance(model, bytes) else model.SerializeToString()
    return ort.InferenceSession(data, sess_options=options, providers=["CPUExecutionProvider"])


@dataclass(frozen=True, slots=True)
class Probe:
    """What two runs of a model at different input sizes showed."""

    dtypes: dict[str, np.dtype]
    shapes: tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]
    values: tuple[dict[str, np.ndarray], dict[str, np.ndarray]]

    def knows(self, name: str) -> bool:
        return name in self.shapes[0] and name in self.shapes[1]

    def shape(self, name: str, run: int = 0) -> tuple[int, ...]:
        return self.shapes[run][name]

    def rank(self, name: str) -> int:
        return len(self.shapes[0][name])

    def spec_shape(self, name: str) -> tuple[int, ...]:
        """The shape with -1 wherever the two runs disagreed."""
        a, b = self.shapes[0][name], self.shapes[1][name]
        return tuple(x if x == y else -1 for x, y in zip(a, b))


def probe(view: GraphView, seed: int = 0) -> Probe:
    """Run the model twice, asking for every node output."""
    model = onnx.ModelProto()
    model.CopyFrom(view.model)
    existing = {o.name for o in model.graph.output}
    for node in model.graph.node:
        for name in node.output:
            if name and name not in existing:
                model.graph.output.append(onnx.ValueInfoProto(name=name))
                existing.add(name)
    rng = np.random.default_rng(seed)
    bounds = index_bounds(view)
    dtypes: dict[str, np.dtype] = {}
    shapes: list[dict[str, tuple[int, ...]]] = []
    values: list[dict[str, np.ndarray]] = []
    try:
        session = cpu_session(model)
    except Exception as exc:  # ORT raises its own types: report them as a split failure
        raise SplitError(f"ONNX Runtime cannot load the model to learn its shapes: {exc}") from exc
    names = [o.name for o in session.get_outputs()]
    for sizes in PROBE_SIZES:
        feeds = make_inputs(view.model, sizes, rng, bounds)
        try:
            results = session.run(names, feeds)
        except Exception as exc:
            shapes_seen = {k: list(v.shape) for k, v in feeds.items()}
            raise SplitError(f"ONNX Runtime cannot run the model on inputs {shapes_seen}: {exc}") from exc
        run_shapes: dict[str, tuple[int, ...]] = {}
        run_values: dict[str, np.ndarray] = {}
        for name, array in list(zip(names, results)) + list(feeds.items()):
            array = np.asarray(array)
            dtypes[name] = array.dtype
            run_shapes[name] = tuple(int(d) for d in array.shape)
            if array.dtype.kind in "iu" and array.size <= _MAX_VALUE_ELEMENTS:
                run_values[name] = array.copy()
        shapes.append(run_shapes)
        values.append(run_values)
    for name, tensor in view.initializers.items():
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type))
        dims = tuple(int(d) for d in tensor.dims)
        dtypes[name] = dtype
        small_int = dtype.kind in "iu" and int(np.prod(dims, dtype=np.int64)) <= _MAX_VALUE_ELEMENTS
        for run in range(2):
            shapes[run][name] = dims
            if small_int:
                values[run][name] = view.const(name)  # type: ignore[assignment]
    log.debug("probed %d tensors at sizes %s", len(names), PROBE_SIZES)
    return Probe(dtypes=dtypes, shapes=(shapes[0], shapes[1]), values=(values[0], values[1]))
