"""Running a model to learn what static analysis cannot: the concrete shape,
dtype and (for small integer tensors) value of every tensor, at two input
sizes, so a splitter can tell static dimensions and static reshape-target
entries from ones that follow the input sizes.

Which dimensions are dynamic is decided by symbolic shape inference first
(:mod:`splitter.shapes`); the two runs, at realistic sizes that differ in
every input symbol (:mod:`splitter.sizes`), catch what inference missed, so
a dimension that varied is never frozen.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from splitter.graph import GraphView, SplitError
from splitter.shapes import SymbolicShapes, infer_symbolic
from splitter.sizes import (
    HINT,
    InputHints,
    InputSpec,
    SizePlan,
    declared_model,
    index_bounds,
    input_specs,
    make_inputs,
    size_plans,
    typical_sizes,
)

log = logging.getLogger(__name__)

_MAX_VALUE_ELEMENTS = 64  # integer tensors up to this size are recorded by value (shape arithmetic)


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
    """What two runs of a model at different input sizes showed, and what
    symbolic shape inference says about each dimension."""

    dtypes: dict[str, np.dtype]
    shapes: tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]
    values: tuple[dict[str, np.ndarray], dict[str, np.ndarray]]
    symbolic: SymbolicShapes = field(default_factory=SymbolicShapes)
    sizes: SizePlan | None = None  # None when the runs' inputs were given

    def knows(self, name: str) -> bool:
        return name in self.shapes[0] and name in self.shapes[1]

    def shape(self, name: str, run: int = 0) -> tuple[int, ...]:
        return self.shapes[run][name]

    def rank(self, name: str) -> int:
        return len(self.shapes[0][name])

    def spec_shape(self, name: str) -> tuple[int, ...]:
        """The shape with -1 wherever the dim follows an input size: symbolic
        inference says so, or the two runs disagreed."""
        a, b = self.shapes[0][name], self.shapes[1][name]
        dynamic = self.symbolic.dynamic_axes(name) if len(self.symbolic.dims.get(name, ())) == len(a) else frozenset()
        return tuple(x if x == y and axis not in dynamic else -1 for axis, (x, y) in enumerate(zip(a, b)))


@dataclass(frozen=True, slots=True)
class Inputs:
    """How a model's inputs are made: their specs and the declared hints."""

    specs: list[InputSpec]
    hints: InputHints
    bounds: dict[str, int]
    symbolic: SymbolicShapes
    plans: list[SizePlan]

    def make(self, sizes: Mapping[str, int], rng: np.random.Generator) -> dict[str, np.ndarray]:
        return make_inputs(self.specs, sizes, rng, self.bounds, self.hints.values)


def model_inputs(view: GraphView, hints: InputHints | None = None, declared: Mapping[str, tuple[int, ...]] | None = None) -> Inputs:
    """Infer symbolic shapes and work out the size plans for ``view``'s model."""
    hints = hints or InputHints()
    model = declared_model(view.model, hints)
    symbolic = infer_symbolic(model)
    specs = input_specs(model, symbolic.merges)
    plans = size_plans(specs, typical_sizes(specs, hints, declared or {}))
    return Inputs(specs, hints, index_bounds(view), symbolic, plans)


def probe(
    view: GraphView,
    hints: InputHints | None = None,
    *,
    declared: Mapping[str, tuple[int, ...]] | None = None,
    feeds: tuple[dict[str, np.ndarray], dict[str, np.ndarray]] | None = None,
    seed: int = 0,
) -> Probe:
    """Run the model twice, asking for every node output: at the first size
    plan ONNX Runtime accepts, or on the given ``feeds``."""
    model = onnx.ModelProto()
    model.CopyFrom(view.model)
    existing = {o.name for o in model.graph.output}
    for node in model.graph.node:
        for name in node.output:
            if name and name not in existing:
                model.graph.output.append(onnx.ValueInfoProto(name=name))
                existing.add(name)
    inputs = model_inputs(view, hints, declared)
    try:
        session = cpu_session(model)
    except Exception as exc:  # ORT raises its own types: report them as a split failure
        raise SplitError(f"ONNX Runtime cannot load the model to learn its shapes: {exc}") from exc
    names = [o.name for o in session.get_outputs()]
    plan: SizePlan | None = None
    if feeds is not None:
        results = [session.run(names, f) for f in feeds]
        runs = list(feeds)
    else:
        plan, runs, results = _first_plan_that_runs(session, names, inputs, seed)
    dtypes: dict[str, np.dtype] = {}
    shapes: list[dict[str, tuple[int, ...]]] = []
    values: list[dict[str, np.ndarray]] = []
    for run_feeds, run_results in zip(runs, results):
        run_shapes: dict[str, tuple[int, ...]] = {}
        run_values: dict[str, np.ndarray] = {}
        for name, array in list(zip(names, run_results)) + list(run_feeds.items()):
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
    log.debug("probed %d tensors (%s)", len(names), plan.label if plan else "given inputs")
    return Probe(dtypes, (shapes[0], shapes[1]), (values[0], values[1]), inputs.symbolic, plan)


def _first_plan_that_runs(
    session: ort.InferenceSession, names: list[str], inputs: Inputs, seed: int
) -> tuple[SizePlan, list[dict[str, np.ndarray]], list[list[np.ndarray]]]:
    first_error: tuple[dict[str, list[int]], Exception] | None = None
    for plan in inputs.plans:
        rng = np.random.default_rng(seed)
        runs = [inputs.make(sizes, rng) for sizes in plan.probe]
        try:
            results = [session.run(names, feeds) for feeds in runs]
        except Exception as exc:  # noqa: BLE001 - a size plan the model refuses: try the next
            log.info("size plan %s refused: %s", plan.label, exc)
            if first_error is None:
                first_error = ({k: list(v.shape) for k, v in runs[0].items()}, exc)
            continue
        return plan, runs, results
    assert first_error is not None
    shapes_seen, exc = first_error
    integers = [s.name for s in inputs.specs if s.dtype.kind in "iu" and s.name not in inputs.bounds
                and s.name not in inputs.hints.values]
    extra = f" (integer inputs filled with random 0/1: {', '.join(integers)})" if integers else ""
    raise SplitError(f"ONNX Runtime cannot run the model on inputs {shapes_seen} nor at the other sizes tried "
                     f"({', '.join(p.label for p in inputs.plans)}){extra}: {str(exc).strip()}. To split it, {HINT}") from exc
