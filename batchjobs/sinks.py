"""Output writers of an offline batch job: results land in input row order.

Owns the job's output data while it runs (in the work directory beside the
output) and its assembly into the final file. Chunks finish in any order;
each writer makes a chunk durable before :meth:`Sink.write` returns, which is
what lets the checkpoint name it as done.

- ``.npy``/``.npz``: one preallocated ``.npy`` file per output (header written
  with NumPy's format functions, data region sparse), rows written in place
  with ``pwrite`` at their offsets and ``fdatasync``-ed: random access, no
  reorder buffer, no memory map. ``.npy`` is then renamed into place; ``.npz``
  is zipped (stored, streamed) from the per-output files.
- ``.parquet``/``.jsonl``: each chunk becomes one part file, written to a
  temporary name and renamed; the final file concatenates the parts in row
  order (a Parquet row group per part), one part in memory at a time.

A bad row is zeros in NumPy outputs, null in Parquet and ``{"error": ...}``
in JSON Lines; the job's errors file lists them all.
"""

from __future__ import annotations

import os
import shutil
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Protocol

import numpy as np
import orjson

from batchjobs.checkpoint import write_atomic
from batchjobs.rows import BatchInputError
from loadtest.inputs import TensorSpec
from protos import codec

_COPY_BYTES = 1 << 20


@dataclass(slots=True)
class ChunkResult:
    """The outputs of one chunk: ``(absolute rows, {output: stacked values})`` parts, and its bad rows."""

    start: int
    stop: int
    parts: list[tuple[np.ndarray, dict[str, np.ndarray]]] = field(default_factory=list)
    bad: dict[int, str] = field(default_factory=dict)


class Sink(Protocol):
    def write(self, result: ChunkResult) -> dict[int, str]:
        """Store the chunk durably; returns rows it could not store (row -> reason)."""
        ...

    def finish(self, output: Path) -> None:
        """Assemble the final output file atomically (every chunk has been written)."""
        ...

    def close(self) -> None: ...


def open_sink(fmt: str, work_dir: Path, specs: Sequence[TensorSpec], n_rows: int) -> Sink:
    if fmt in ("npy", "npz"):
        if fmt == "npy" and len(specs) != 1:
            names = ", ".join(s.name for s in specs)
            raise BatchInputError(f"the model has {len(specs)} outputs ({names}): write .npz, .parquet or .jsonl, "
                             "or pick one with --outputs")
        return NumpySink(fmt, work_dir, specs, n_rows)
    return PartsSink(fmt, work_dir, specs, n_rows)


def _runs(rows: np.ndarray) -> list[tuple[int, int]]:
    """Index ranges ``[i, j)`` of ``rows`` (ascending) holding consecutive values."""
    if len(rows) == 0:
        return []
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    edges = [0, *breaks.tolist(), len(rows)]
    return list(zip(edges[:-1], edges[1:]))


class _NpyFile:
    """A preallocated .npy file of ``n_rows`` rows written in place."""

    def __init__(self, path: Path, n_rows: int, dtype: np.dtype, row_shape: tuple[int, ...] | None) -> None:
        self.path = path
        self.dtype = dtype
        self.row_shape = row_shape
        self.n_rows = n_rows
        self.fd = -1
        self.offset = 0
        if path.exists():
            self._open_existing()
        elif row_shape is not None:
            self._create(row_shape)

    def _create(self, row_shape: tuple[int, ...]) -> None:
        self.row_shape = row_shape
        header = {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False,
                  "shape": (self.n_rows, *row_shape)}
        with open(self.path, "wb") as f:
            np.lib.format.write_array_header_2_0(f, header)
            self.offset = f.tell()
            f.truncate(self.offset + self.n_rows * self.row_bytes)  # sparse: no data written yet
        self.fd = os.open(self.path, os.O_RDWR)

    def _open_existing(self) -> None:
        with open(self.path, "rb") as f:
            try:
                version = np.lib.format.read_magic(f)
                read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                               else np.lib.format.read_array_header_2_0)
                shape, _, dtype = read_header(f)
            except ValueError as exc:
                raise BatchInputError(f"{self.path} is not a .npy file: {exc}") from None
            self.offset = f.tell()
        if len(shape) == 0 or shape[0] != self.n_rows or dtype != self.dtype:
            raise BatchInputError(f"{self.path} does not belong to this job (shape {shape}, dtype {dtype})")
        self.row_shape = tuple(shape[1:])
        self.fd = os.open(self.path, os.O_RDWR)

    @property
    def row_bytes(self) -> int:
        assert self.row_shape is not None
        return self.dtype.itemsize * int(np.prod(self.row_shape, dtype=np.int64))

    def put(self, rows: np.ndarray, values: np.ndarray) -> None:
        if self.fd < 0:
            self._create(tuple(values.shape[1:]))
        values = np.ascontiguousarray(values, dtype=self.dtype)
        for i, j in _runs(rows):
            os.pwrite(self.fd, values[i:j].tobytes(), self.offset + int(rows[i]) * self.row_bytes)

    def zero(self, rows: np.ndarray) -> None:
        if self.fd < 0 or len(rows) == 0:
            return
        for i, j in _runs(rows):
            os.pwrite(self.fd, bytes((j - i) * self.row_bytes), self.offset + int(rows[i]) * self.row_bytes)

    def sync(self) -> None:
        if self.fd >= 0:
            os.fdatasync(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class NumpySink:
    def __init__(self, fmt: str, work_dir: Path, specs: Sequence[TensorSpec], n_rows: int) -> None:
        self.fmt = fmt
        self.specs = tuple(specs)
        self.files: dict[str, _NpyFile] = {}
        for spec in specs:
            fixed = tuple(spec.dims) if all(d >= 0 for d in spec.dims) else None
            self.files[spec.name] = _NpyFile(work_dir / f"{spec.name}.npy", n_rows,
                                             codec.numpy_dtype(spec.datatype), fixed)

    def write(self, result: ChunkResult) -> dict[int, str]:
        extra: dict[int, str] = {}
        for rows, outputs in result.parts:
            for name, values in outputs.items():
                f = self.files[name]
                if f.row_shape is not None and tuple(values.shape[1:]) != f.row_shape:
                    for row in rows.tolist():
                        extra[row] = (f"{name}: output shape {list(values.shape[1:])} differs from "
                                      f"{list(f.row_shape)} of earlier rows; a .npy output needs one shape")
        for rows, outputs in result.parts:
            if extra:
                keep = np.array([r not in extra for r in rows.tolist()], dtype=bool)
                rows = rows[keep]
                outputs = {name: v[keep] for name, v in outputs.items()}
            for name, values in outputs.items():
                self.files[name].put(rows, values)
        bad = np.array(sorted({*result.bad, *extra}), dtype=np.int64)
        for f in self.files.values():
            f.zero(bad)
            f.sync()
        return extra

    def finish(self, output: Path) -> None:
        for spec in self.specs:
            f = self.files[spec.name]
            if f.fd < 0:  # every row was bad and a dim was never resolved
                f._create(tuple(max(d, 0) for d in spec.dims))
            f.close()
        if self.fmt == "npy":
            os.replace(self.files[self.specs[0].name].path, output)
            return
        tmp = output.with_name(f".{output.name}.tmp{os.getpid()}")
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
            for spec in self.specs:
                with open(self.files[spec.name].path, "rb") as src, \
                        zf.open(f"{spec.name}.npy", "w", force_zip64=True) as dst:
                    shutil.copyfileobj(src, dst, _COPY_BYTES)
        _fsync_path(tmp)
        os.replace(tmp, output)

    def close(self) -> None:
        for f in self.files.values():
            f.close()


class PartsSink:
    def __init__(self, fmt: str, work_dir: Path, specs: Sequence[TensorSpec], n_rows: int) -> None:
        self.fmt = fmt
        self.specs = tuple(specs)
        self.n_rows = n_rows
        self.dir = work_dir / "parts"
        self.dir.mkdir(exist_ok=True)
        self.ext = "parquet" if fmt == "parquet" else "jsonl"
        if fmt == "parquet":
            from batchjobs.arrow import arrow_schema

            self.schema = arrow_schema(self.specs)

    def _part(self, start: int, stop: int) -> Path:
        return self.dir / f"part-{start:012d}-{stop:012d}.{self.ext}"

    def write(self, result: ChunkResult) -> dict[int, str]:
        path = self._part(result.start, result.stop)
        if self.fmt == "parquet":
            self._write_parquet(path, result)
        else:
            write_atomic(path, self._jsonl(result))
        return {}

    def _jsonl(self, result: ChunkResult) -> bytes:
        n = result.stop - result.start
        lines: list[bytes | None] = [None] * n
        for row, reason in result.bad.items():
            lines[row - result.start] = orjson.dumps({"error": reason})
        option = orjson.OPT_SERIALIZE_NUMPY
        for rows, outputs in result.parts:
            names = list(outputs)
            arrays = [outputs[name] for name in names]
            for k, row in enumerate((rows - result.start).tolist()):
                lines[row] = orjson.dumps({name: a[k] for name, a in zip(names, arrays)}, option=option)
        missing = [i for i, line in enumerate(lines) if line is None]
        if missing:
            raise ValueError(f"rows {missing[:5]} of chunk {result.start}.. have no result")
        return b"\n".join(lines) + b"\n"  # type: ignore[arg-type]

    def _write_parquet(self, path: Path, result: ChunkResult) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        from batchjobs.arrow import build_column

        n = result.stop - result.start
        columns = [
            build_column(n, [(rows - result.start, outputs[spec.name]) for rows, outputs in result.parts], spec)
            for spec in self.specs
        ]
        table = pa.Table.from_arrays(columns, schema=self.schema)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        pq.write_table(table, tmp)
        _fsync_path(tmp)
        os.replace(tmp, path)

    def _parts_in_order(self) -> list[Path]:
        parts = sorted(self.dir.glob(f"part-*.{self.ext}"))
        expected = 0
        for part in parts:
            start, stop = (int(x) for x in part.stem.split("-")[1:3])
            if start != expected:
                raise ValueError(f"output parts do not cover rows {expected}..{start}")
            expected = stop
        if expected != self.n_rows:
            raise ValueError(f"output parts end at row {expected} of {self.n_rows}")
        return parts

    def finish(self, output: Path) -> None:
        parts = self._parts_in_order()
        tmp = output.with_name(f".{output.name}.tmp{os.getpid()}")
        if self.fmt == "parquet":
            import pyarrow.parquet as pq

            with pq.ParquetWriter(tmp, self.schema) as writer:
                for part in parts:
                    writer.write_table(pq.read_table(part, schema=self.schema))
        else:
            with open(tmp, "wb") as dst:
                for part in parts:
                    with open(part, "rb") as src:
                        shutil.copyfileobj(src, dst, _COPY_BYTES)
        _fsync_path(tmp)
        os.replace(tmp, output)

    def close(self) -> None:
        pass


def _fsync_path(path: Path) -> None:
    f: IO[bytes]
    with open(path, "rb+") as f:
        os.fsync(f.fileno())
