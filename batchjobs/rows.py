"""Rows of an offline batch job: checked against the model, grouped into batches.

Owns the step between reading a chunk of the input and sending it: every
row's tensors are converted to the model's datatypes and checked against its
dims; a row that cannot be sent is *bad* (reported with its index, never
sent) and the rest are grouped by shape, because one request can only stack
rows whose shapes agree (variable dims, e.g. token sequences of different
lengths, form several groups). Readers hand over columns either stacked (one
array, rows along dim 0: the fast path) or as one array per row.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from loadtest.inputs import TensorSpec
from protos import codec

# One input's values for the rows of a chunk: stacked, or one array (None: missing) per row.
Column = np.ndarray | Sequence[np.ndarray | None]


# Rows [start, stop) of the input.
Range = tuple[int, int]


class BatchInputError(Exception):
    """The input file cannot be used for this model; the message says why."""


class RowError(ValueError):
    """A row (or a whole column) that cannot be sent; the message is the reason."""


@dataclass(slots=True)
class RowGroup:
    """Rows of one chunk whose tensors have the same shapes: sent in slices of the batch size."""

    rows: np.ndarray  # absolute row indices, ascending, int64
    tensors: dict[str, np.ndarray]  # input name -> (len(rows), *row_shape), the model's dtype


@dataclass(slots=True)
class Chunk:
    """A contiguous range of input rows, ready to send."""

    start: int
    stop: int
    groups: list[RowGroup] = field(default_factory=list)
    bad: dict[int, str] = field(default_factory=dict)  # absolute row -> reason


def convert(values: np.ndarray, spec: TensorSpec) -> np.ndarray:
    """``values`` in the model's dtype; RowError when that would change their meaning.

    Integer range is not checked here (it is per row: see :func:`out_of_range`).
    """
    target = codec.numpy_dtype(spec.datatype)
    src = values.dtype
    if src == target:
        return values
    ok = {
        "f": "biuf",  # ints to floats as JSON writes them; float64 to float32
        "i": "biu",
        "u": "biu",
        "b": "b",
    }.get(target.kind, "")
    if src.kind not in ok:
        raise RowError(f"{spec.name}: cannot use {src} values as {spec.datatype}")
    return values.astype(target)


def out_of_range(values: np.ndarray, spec: TensorSpec) -> np.ndarray | None:
    """Per-row mask of integer values that do not fit the model's integer type (None: all fit)."""
    target = codec.numpy_dtype(spec.datatype)
    if target.kind not in "iu" or values.dtype.kind not in "iu" or values.size == 0:
        return None
    info = np.iinfo(target)
    if values.min() >= info.min and values.max() <= info.max:
        return None
    flat = values.reshape(values.shape[0], -1)
    return ((flat < info.min) | (flat > info.max)).any(axis=1)


def shape_problem(row_shape: tuple[int, ...], spec: TensorSpec) -> str | None:
    dims = spec.dims
    if len(row_shape) != len(dims) or any(d >= 0 and d != s for d, s in zip(dims, row_shape)):
        want = "[" + ",".join(str(d) for d in dims) + "]"
        got = "[" + ",".join(str(s) for s in row_shape) + "]"
        return f"{spec.name}: shape {got} does not match the model's {want}"
    return None


def make_chunk(start: int, stop: int, columns: Mapping[str, Column], bad: dict[int, str],
               specs: Sequence[TensorSpec]) -> Chunk:
    """Check and group the rows ``[start, stop)``; ``bad`` holds rows the reader already rejected."""
    chunk = Chunk(start, stop, bad=dict(bad))
    if all(isinstance(columns[s.name], np.ndarray) and columns[s.name].ndim >= 1 for s in specs):
        _stacked(chunk, columns, specs)  # type: ignore[arg-type]
    else:
        _per_row(chunk, columns, specs)
    return chunk


def _stacked(chunk: Chunk, columns: Mapping[str, np.ndarray], specs: Sequence[TensorSpec]) -> None:
    n = chunk.stop - chunk.start
    keep = np.ones(n, dtype=bool)
    for row in chunk.bad:
        keep[row - chunk.start] = False
    tensors: dict[str, np.ndarray] = {}
    for spec in specs:
        values = columns[spec.name]
        problem = shape_problem(tuple(values.shape[1:]), spec)
        try:
            if problem:
                raise RowError(problem)
            tensors[spec.name] = convert(values, spec)
        except RowError as exc:
            # The whole column is unusable: every row of the chunk is bad for the same reason.
            for i in np.flatnonzero(keep):
                chunk.bad[chunk.start + int(i)] = str(exc)
            return
        mask = out_of_range(values, spec)
        if mask is not None:
            for i in np.flatnonzero(mask & keep):
                chunk.bad[chunk.start + int(i)] = f"{spec.name}: values out of range for {spec.datatype}"
            keep &= ~mask
    rows = np.arange(chunk.start, chunk.stop, dtype=np.int64)
    if not keep.all():
        rows = rows[keep]
        tensors = {name: t[keep] for name, t in tensors.items()}
    if len(rows):
        chunk.groups.append(RowGroup(rows, tensors))


def _per_row(chunk: Chunk, columns: Mapping[str, Column], specs: Sequence[TensorSpec]) -> None:
    by_shape: dict[tuple[tuple[int, ...], ...], tuple[list[int], list[list[np.ndarray]]]] = {}
    for i in range(chunk.stop - chunk.start):
        row = chunk.start + i
        if row in chunk.bad:
            continue
        arrays: list[np.ndarray] = []
        try:
            for spec in specs:
                value = columns[spec.name][i]
                if value is None:
                    raise RowError(f"{spec.name}: missing value")
                value = np.asarray(value)
                problem = shape_problem(value.shape, spec)
                if problem:
                    raise RowError(problem)
                if out_of_range(value[np.newaxis], spec) is not None:
                    raise RowError(f"{spec.name}: values out of range for {spec.datatype}")
                arrays.append(convert(value, spec))
        except RowError as exc:
            chunk.bad[row] = str(exc)
            continue
        key = tuple(a.shape for a in arrays)
        rows, values = by_shape.setdefault(key, ([], [[] for _ in specs]))
        rows.append(row)
        for k, a in enumerate(arrays):
            values[k].append(a)
    groups = [
        RowGroup(np.asarray(rows, dtype=np.int64), {s.name: np.stack(v[k]) for k, s in enumerate(specs)})
        for rows, v in by_shape.values()
    ]
    chunk.groups = sorted(groups, key=lambda g: int(g.rows[0]))
