"""Input readers of an offline batch job: NumPy (.npy/.npz), JSON Lines, Parquet.

Owns turning a data set file into :class:`~batchjobs.rows.Chunk` objects,
one requested row range at a time, in row order, with memory bounded by the
chunk size whatever the file's size:

- ``.npy`` (single-input models) and ``.npz`` (one array per input, named
  after it): the array header is parsed and rows are read with seek + read,
  so only the chunk is in memory (no memory map whose pages would pile up in
  the process's resident set). ``.npz`` members may be stored or deflated.
- ``.jsonl``: one JSON object per line, ``{"INPUT": [...], ...}`` (a bare
  list for single-input models). Lines are streamed; a line that does not
  parse or does not fit the model is a bad row, reported by index.
- ``.parquet``: one column per input (see :mod:`batchjobs.arrow`).

Problems that concern the whole file (missing arrays, wrong dims) raise
:class:`BatchInputError` up front; problems of single rows become bad rows.
"""

from __future__ import annotations

import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Protocol

import numpy as np
import orjson

from batchjobs.rows import BatchInputError, Chunk, Range, RowError, convert, make_chunk, shape_problem
from loadtest.inputs import TensorSpec

FORMATS = {".npy": "npy", ".npz": "npz", ".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".pq": "parquet"}


class Source(Protocol):
    n_rows: int

    def chunks(self, ranges: Sequence[Range]) -> Iterator[Chunk]:
        """One chunk per range (sorted, disjoint), in order."""
        ...

    def close(self) -> None: ...


def file_format(path: Path) -> str:
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise BatchInputError(f"{path}: unknown format; use one of {', '.join(sorted(FORMATS))}")
    return fmt


def open_source(path: Path, specs: Sequence[TensorSpec]) -> Source:
    fmt = file_format(path)
    if not path.is_file():
        raise BatchInputError(f"input file {path} does not exist")
    if fmt in ("npy", "npz"):
        return NumpySource(path, specs)
    if fmt == "jsonl":
        return JsonlSource(path, specs)
    from batchjobs.arrow import ParquetSource  # pyarrow is optional

    return ParquetSource(path, specs)


class NpyReader:
    """Rows of one array in .npy layout, read from a seekable file object."""

    def __init__(self, f: IO[bytes], where: str) -> None:
        self.f = f
        try:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
            else:
                shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
        except ValueError as exc:
            raise BatchInputError(f"{where} is not a .npy array: {exc}") from None
        if dtype.hasobject:
            raise BatchInputError(f"{where} holds Python objects; save a numeric array")
        if fortran and len(shape) > 1:
            raise BatchInputError(f"{where} is in Fortran order; save it with np.ascontiguousarray")
        if len(shape) == 0:
            raise BatchInputError(f"{where} is a scalar; rows are along the first dimension")
        self.shape: tuple[int, ...] = tuple(shape)
        self.dtype: np.dtype = dtype
        self.offset = f.tell()
        self.row_bytes = dtype.itemsize * int(np.prod(shape[1:], dtype=np.int64))

    def read(self, start: int, stop: int) -> np.ndarray:
        self.f.seek(self.offset + start * self.row_bytes)
        size = (stop - start) * self.row_bytes
        data = self.f.read(size)
        if len(data) != size:
            raise BatchInputError(f"input ends early: rows {start}..{stop} are missing")
        return np.frombuffer(data, dtype=self.dtype).reshape((stop - start, *self.shape[1:]))


class NumpySource:
    def __init__(self, path: Path, specs: Sequence[TensorSpec]) -> None:
        self.specs = tuple(specs)
        self._zip: zipfile.ZipFile | None = None
        self._files: list[IO[bytes]] = []
        self.readers: dict[str, NpyReader] = {}
        try:
            if path.suffix.lower() == ".npy":
                if len(specs) != 1:
                    names = ", ".join(s.name for s in specs)
                    raise BatchInputError(
                        f"the model has {len(specs)} inputs ({names}): give an .npz with one array each")
                f = open(path, "rb")
                self._files.append(f)
                self.readers[specs[0].name] = NpyReader(f, str(path))
            else:
                self._open_npz(path)
            self.n_rows = self._check()
        except BaseException:
            self.close()
            raise

    def _open_npz(self, path: Path) -> None:
        try:
            self._zip = zipfile.ZipFile(path)
        except zipfile.BadZipFile:
            raise BatchInputError(f"{path} is not an .npz archive") from None
        members = set(self._zip.namelist())
        for spec in self.specs:
            member = f"{spec.name}.npy"
            if member not in members:
                have = ", ".join(sorted(m.removesuffix(".npy") for m in members)) or "none"
                raise BatchInputError(f"{path} has no array {spec.name!r} (arrays: {have})")
            # Several members may be open at once: ZipFile shares its file handle safely.
            f = self._zip.open(member)
            self._files.append(f)
            self.readers[spec.name] = NpyReader(f, f"{path}[{spec.name}]")

    def _check(self) -> int:
        counts = {name: r.shape[0] for name, r in self.readers.items()}
        if len(set(counts.values())) > 1:
            raise BatchInputError(f"the input arrays have different row counts: {counts}")
        for spec in self.specs:
            reader = self.readers[spec.name]
            problem = shape_problem(reader.shape[1:], spec)
            if problem:
                raise BatchInputError(f"{problem} (rows are along the first dimension)")
            try:
                convert(np.empty((0,), dtype=reader.dtype), spec)
            except RowError as exc:
                raise BatchInputError(str(exc)) from None
        return next(iter(counts.values()))

    def chunks(self, ranges: Sequence[Range]) -> Iterator[Chunk]:
        for start, stop in ranges:
            columns = {spec.name: self.readers[spec.name].read(start, stop) for spec in self.specs}
            yield make_chunk(start, stop, columns, {}, self.specs)

    def close(self) -> None:
        for f in self._files:
            f.close()
        self._files.clear()
        if self._zip is not None:
            self._zip.close()


def count_lines(path: Path) -> int:
    """Rows of a JSON Lines file: its lines, counting a last one with no newline."""
    count = 0
    last = b"\n"
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            count += block.count(b"\n")
            last = block[-1:]
    return count + (last != b"\n")


class JsonlSource:
    def __init__(self, path: Path, specs: Sequence[TensorSpec]) -> None:
        self.path = path
        self.specs = tuple(specs)
        self.n_rows = count_lines(path)
        self._file: IO[bytes] | None = None

    def chunks(self, ranges: Sequence[Range]) -> Iterator[Chunk]:
        self._file = open(self.path, "rb")
        lines = enumerate(self._file)
        for start, stop in ranges:
            columns: dict[str, list[np.ndarray | None]] = {s.name: [] for s in self.specs}
            bad: dict[int, str] = {}
            for index, line in lines:
                if index < start:
                    continue  # finished earlier: skipped without parsing
                values = self._parse(line)
                if isinstance(values, str):
                    bad[index] = values
                for spec in self.specs:
                    columns[spec.name].append(None if isinstance(values, str) else values[spec.name])
                if index + 1 >= stop:
                    break
            got = len(columns[self.specs[0].name]) if self.specs else stop - start
            if got != stop - start:
                raise BatchInputError(f"{self.path} changed while reading: rows {start + got}..{stop} are missing")
            yield make_chunk(start, stop, columns, bad, self.specs)

    def _parse(self, line: bytes) -> dict[str, np.ndarray] | str:
        """The row's input arrays, or the reason it is bad."""
        if not line.strip():
            return "empty line"
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            return f"not valid JSON: {exc}"
        if isinstance(obj, list) and len(self.specs) == 1:
            obj = {self.specs[0].name: obj}
        if not isinstance(obj, dict):
            return "expected a JSON object mapping input names to values"
        out: dict[str, np.ndarray] = {}
        for spec in self.specs:
            if spec.name not in obj or obj[spec.name] is None:
                return f"missing input {spec.name!r}"
            try:
                out[spec.name] = np.asarray(obj[spec.name])
            except ValueError:
                return f"{spec.name}: nested lists of uneven lengths"
            if out[spec.name].dtype.kind not in "biuf":
                return f"{spec.name}: expected numbers, got {type(obj[spec.name]).__name__} of non-numbers"
        return out

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
