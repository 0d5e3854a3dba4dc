"""Symbolic shapes: which dimensions of which tensors follow an input
dimension, by inference rather than by probing.

ONNX Runtime's symbolic shape inference (``SymbolicShapeInference``, with
``auto_merge``) carries input symbols through the graph as expressions
(``floor(width/8)``, ``2*seq``), and merges symbols that an operator forces
equal (a batch on axis 0 of one input and on axis 1 of a state). Where it
gives up, ONNX's own shape inference (with data propagation) fills in what
it can; a dimension neither knows is left to the probe runs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import onnx

log = logging.getLogger(__name__)

Dim = int | str | None  # static size, a symbol or expression, or unknown


@dataclass(frozen=True, slots=True)
class SymbolicShapes:
    dims: dict[str, tuple[Dim, ...]] = field(default_factory=dict)
    merges: dict[str, str] = field(default_factory=dict)  # input symbol -> the symbol it was merged into
    source: str = "none"  # "onnxruntime", "onnx" or "none"

    def dynamic_axes(self, name: str) -> frozenset[int]:
        """Axes inference says follow an input dimension."""
        return frozenset(axis for axis, dim in enumerate(self.dims.get(name, ())) if isinstance(dim, str))


def _collect(model: onnx.ModelProto) -> dict[str, tuple[Dim, ...]]:
    dims: dict[str, tuple[Dim, ...]] = {}
    graph = model.graph
    for value in [*graph.input, *graph.value_info, *graph.output]:
        ttype = value.type.tensor_type
        if not ttype.HasField("shape"):
            continue
        shape: list[Dim] = []
        for dim in ttype.shape.dim:
            if dim.HasField("dim_value"):
                shape.append(int(dim.dim_value))
            elif dim.dim_param and not dim.dim_param.startswith("unk__"):
                shape.append(dim.dim_param)
            else:
                shape.append(None)
        dims[value.name] = tuple(shape)
    return dims


def infer_symbolic(model: onnx.ModelProto) -> SymbolicShapes:
    """Symbolic dims of every tensor ONNX Runtime's tool (else ONNX) can infer."""
    try:
        return _onnxruntime(model)
    except Exception as exc:  # noqa: BLE001 - the tool raises plain Exceptions; ONNX's inference is the fallback
        log.info("ONNX Runtime symbolic shape inference stopped (%s); using ONNX shape inference", exc)
    try:
        inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
    except Exception as exc:  # noqa: BLE001 - probing still decides what inference cannot
        log.info("ONNX shape inference failed (%s); dims come from probing alone", exc)
        return SymbolicShapes()
    return SymbolicShapes(_collect(inferred), {}, "onnx")


def _onnxruntime(model: onnx.ModelProto) -> SymbolicShapes:
    # The tool's own infer_shapes() saves a file into the working directory
    # when inference is incomplete; drive its steps here instead and keep
    # whatever it did infer.
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    logging.getLogger("onnxruntime.tools.symbolic_shape_infer").setLevel(logging.ERROR)
    tool = SymbolicShapeInference(2**31 - 1, True, True, 0)
    tool._preprocess(model)
    while tool.run_:
        tool._infer_impl()
    tool._update_output_from_vi()
    merges = {k: str(v) for k, v in tool.suggested_merge_.items()}
    dims = _collect(tool.out_mp_)
    # the tool keeps graph inputs as declared: apply its merges to them too
    for value in model.graph.input:
        if value.name in dims:
            dims[value.name] = tuple(merges.get(d, d) if isinstance(d, str) else d for d in dims[value.name])
    return SymbolicShapes(dims, merges, "onnxruntime")
