"""Parquet for offline batch jobs: columns in and out of Arrow, streamed.

Owns the mapping between a model's tensors and Parquet columns: one column
per tensor; a row's tensor is a (nested) list column, one list level per
dimension (``[64]`` -> ``list<float>``, ``[-1, 64]`` ->
``list<list<float>>``), or a plain column for a scalar. For reading, a flat
list of ``prod(dims)`` numbers also fits a multi-dimensional input with fixed
dims, and fixed-size lists work as lists. Null values are bad rows; in
written outputs a bad row is null in every column.

Reading goes row group by row group with ``iter_batches``, decoding only the
batches that overlap a requested range, so memory stays bounded by the chunk
size. pyarrow is imported only here: the other formats do not need it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

try:
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("Parquet files need pyarrow: pip install 'infergate[parquet]'") from exc

from batchjobs.rows import BatchInputError, Chunk, Column, Range, make_chunk
from loadtest.inputs import TensorSpec
from protos import codec

_READ_BATCH_ROWS = 4096


def arrow_type(spec: TensorSpec) -> pa.DataType:
    leaf = pa.from_numpy_dtype(codec.numpy_dtype(spec.datatype))
    for _ in spec.dims:
        leaf = pa.list_(leaf)
    return leaf


def arrow_schema(specs: Sequence[TensorSpec]) -> pa.Schema:
    return pa.schema([pa.field(s.name, arrow_type(s), nullable=True) for s in specs])


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def column_rows(col: pa.Array, spec: TensorSpec) -> tuple[Column, dict[int, str]]:
    """One input's values for ``len(col)`` rows; bad rows keyed by position in ``col``."""
    n = len(col)
    bad: dict[int, str] = {}
    nulls = col.is_null().to_numpy(zero_copy_only=False)
    for i in np.flatnonzero(nulls):
        bad[int(i)] = f"{spec.name}: null value"
    levels: list[np.ndarray] = []
    arr: pa.Array = col
    while _is_list(arr.type):
        levels.append(pc.list_value_length(arr).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64))
        arr = arr.flatten()
    if arr.null_count:
        return _rows_one_by_one(col, spec, bad), bad
    values = arr.to_numpy(zero_copy_only=False)
    if not levels:
        return values, bad
    valid = ~nulls
    regular = all(len(np.unique(lens[valid] if k == 0 else lens)) <= 1 for k, lens in enumerate(levels))
    if not regular:
        if len(levels) == 1:
            offsets = np.concatenate(([0], np.cumsum(levels[0])))
            rows = [None if nulls[i] else _fit(values[offsets[i]:offsets[i + 1]], spec) for i in range(n)]
            return rows, bad
        return _rows_one_by_one(col, spec, bad), bad
    row_shape = tuple(int(lens[valid][0] if k == 0 else lens[0]) if len(lens) and valid.any() else 0
                      for k, lens in enumerate(levels))
    row_shape = _fitted_shape(row_shape, spec)
    stacked = np.zeros((n, *row_shape), dtype=values.dtype)
    stacked[valid] = values.reshape((int(valid.sum()), *row_shape))
    return stacked, bad


def _fitted_shape(shape: tuple[int, ...], spec: TensorSpec) -> tuple[int, ...]:
    """A flat row of prod(dims) values read as the model's fixed multi-dimensional shape."""
    dims = spec.dims
    if len(shape) == 1 and len(dims) > 1 and all(d >= 0 for d in dims) and shape[0] == int(np.prod(dims)):
        return tuple(dims)
    return shape


def _fit(row: np.ndarray, spec: TensorSpec) -> np.ndarray:
    return row.reshape(_fitted_shape(row.shape, spec))


def _rows_one_by_one(col: pa.Array, spec: TensorSpec, bad: dict[int, str]) -> list[np.ndarray | None]:
    """The slow path for ragged nesting or nulls inside rows."""
    rows: list[np.ndarray | None] = []
    for i, value in enumerate(col.to_pylist()):
        if value is None:
            rows.append(None)
            continue
        try:
            row = np.asarray(value)
        except ValueError:
            row = None
        if row is None or row.dtype.kind not in "biuf":
            bad[i] = f"{spec.name}: ragged or null values inside the row"
            rows.append(None)
        else:
            rows.append(_fit(row, spec))
    return rows


class ParquetSource:
    def __init__(self, path: Path, specs: Sequence[TensorSpec]) -> None:
        self.specs = tuple(specs)
        try:
            self.file = pq.ParquetFile(path)
        except (pa.ArrowInvalid, OSError) as exc:
            raise BatchInputError(f"{path} is not a Parquet file: {exc}") from None
        names = set(self.file.schema_arrow.names)
        missing = [s.name for s in specs if s.name not in names]
        if missing:
            raise BatchInputError(f"{path} has no column {missing[0]!r} (columns: {', '.join(sorted(names))})")
        self.n_rows = self.file.metadata.num_rows

    def _batches(self, ranges: Sequence[Range]) -> Iterator[tuple[int, pa.RecordBatch]]:
        """(first row, batch) for the batches that overlap ``ranges``, in order."""
        columns = [s.name for s in self.specs]
        meta = self.file.metadata
        group_start = 0
        for g in range(meta.num_row_groups):
            group_stop = group_start + meta.row_group(g).num_rows
            if any(a < group_stop and b > group_start for a, b in ranges):
                row = group_start
                for batch in self.file.iter_batches(batch_size=_READ_BATCH_ROWS, row_groups=[g], columns=columns,
                                                    use_threads=False):
                    yield row, batch
                    row += batch.num_rows
            group_start = group_stop

    def chunks(self, ranges: Sequence[Range]) -> Iterator[Chunk]:
        pending = list(ranges)
        k = 0
        pieces: list[pa.RecordBatch] = []
        for row, batch in self._batches(pending):
            end = row + batch.num_rows
            while k < len(pending):
                start, stop = pending[k]
                lo, hi = max(start, row), min(stop, end)
                if lo < hi:
                    pieces.append(batch.slice(lo - row, hi - lo))
                if stop > end:
                    break  # the range goes on in a later batch
                # Every batch overlapping the range was read (whole row groups are), so it is complete.
                yield self._chunk(start, stop, pieces)
                pieces = []
                k += 1
            if k == len(pending):
                return
        if k < len(pending):
            raise BatchInputError(f"the Parquet file ended before row {pending[k][1]}")

    def _chunk(self, start: int, stop: int, pieces: list[pa.RecordBatch]) -> Chunk:
        table = pa.Table.from_batches(pieces)
        columns: dict[str, Column] = {}
        bad: dict[int, str] = {}
        for spec in self.specs:
            values, col_bad = column_rows(table.column(spec.name).combine_chunks(), spec)
            columns[spec.name] = values
            for i, reason in col_bad.items():
                bad.setdefault(start + i, reason)
        if len(table) != stop - start:
            raise BatchInputError(f"rows {start}..{stop}: read {len(table)} rows")
        return make_chunk(start, stop, columns, bad, self.specs)

    def close(self) -> None:
        self.file.close()


def build_column(n: int, parts: Sequence[tuple[np.ndarray, np.ndarray]], spec: TensorSpec) -> pa.Array:
    """An output column of ``n`` rows from ``(positions, stacked values)`` parts; other rows are null."""
    leaf_type = pa.from_numpy_dtype(codec.numpy_dtype(spec.datatype))
    valid = np.zeros(n, dtype=bool)
    for positions, _ in parts:
        valid[positions] = True
    if len(parts) == 1 and len(parts[0][0]) == n:
        rows_values = parts[0][1]
        shapes = [rows_values.shape[1:]] * n
        flat = rows_values.reshape(-1)
    else:
        per_row: list[np.ndarray | None] = [None] * n
        for positions, values in parts:
            for p, v in zip(positions.tolist(), values):
                per_row[p] = v
        shapes = [r.shape if r is not None else None for r in per_row]
        present = [r.reshape(-1) for r in per_row if r is not None]
        flat = np.concatenate(present) if present else np.zeros(0, dtype=codec.numpy_dtype(spec.datatype))
    rank = len(spec.dims)
    if rank == 0:
        full = np.zeros(n, dtype=flat.dtype)
        full[valid] = flat
        return pa.array(full, type=leaf_type, mask=~valid)
    array: pa.Array = pa.array(flat, type=leaf_type)
    # Innermost level first: level k has one list per element of the row's dims[:k].
    for k in range(rank - 1, -1, -1):
        if k == 0:
            lengths = np.array([s[0] if s is not None else 0 for s in shapes], dtype=np.int64)
        elif len({s for s in shapes if s is not None}) <= 1:
            s = next((s for s in shapes if s is not None), None)
            count = int(valid.sum()) * int(np.prod(s[:k])) if s is not None else 0
            lengths = np.full(count, s[k] if s is not None else 0, dtype=np.int64)
        else:
            lengths = np.concatenate([np.full(int(np.prod(s[:k])), s[k], dtype=np.int64)
                                      for s in shapes if s is not None])
        offsets = pa.array(np.concatenate(([0], np.cumsum(lengths))).astype(np.int32))
        mask = pa.array(~valid) if k == 0 else None
        array = pa.ListArray.from_arrays(offsets, array, mask=mask)
    return array
