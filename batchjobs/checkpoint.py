"""Resumable state of an offline batch job: which rows are finished, durably.

Owns the checkpoint file (``checkpoint.json`` in the job's work directory
beside the output) and the arithmetic on row ranges. The job processes its
input in fixed chunks of ``chunk_rows`` rows; a chunk's range is added here
only after its outputs (and its bad-row reports) are on disk, and the file is
replaced atomically, so after a crash, SIGKILL included, every range the file
names is really done and at most the chunks in flight are repeated.

The fingerprint ties a checkpoint to one job: the same input file (path,
size, modification time), model, chunking and output layout. Resuming with
anything else is refused rather than silently mixing two jobs' rows.

Bad rows go to ``errors.jsonl`` in the same directory, appended and synced
before their chunk is committed; on resume, lines of uncommitted chunks are
dropped (those chunks run again), and at the end the sorted list moves next
to the output as ``OUTPUT.errors.jsonl``.
"""

from __future__ import annotations

import json
import os
from bisect import bisect_right
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson

CHECKPOINT_VERSION = 1


class CheckpointError(Exception):
    """The checkpoint cannot be used; the message says why and what to do."""


@dataclass(frozen=True, slots=True)
class JobFingerprint:
    """What must stay the same for a checkpoint to be resumed."""

    input_path: str
    input_size: int
    input_mtime_ns: int
    model: str
    model_version: str
    n_rows: int
    chunk_rows: int
    output_format: str
    outputs: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["outputs"] = list(self.outputs)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> JobFingerprint:
        try:
            return cls(**{**data, "outputs": tuple(data["outputs"])})
        except (KeyError, TypeError) as exc:
            raise CheckpointError(f"checkpoint fingerprint is malformed: {exc}") from None

    def differences(self, other: JobFingerprint) -> list[str]:
        """Names of the fields that differ, for the error message."""
        mine, theirs = self.to_json(), other.to_json()
        return [key for key in mine if mine[key] != theirs[key]]


class RangeSet:
    """Sorted, disjoint, merged half-open row ranges ``[start, stop)``."""

    __slots__ = ("_starts", "_stops")

    def __init__(self, ranges: list[tuple[int, int]] | None = None) -> None:
        self._starts: list[int] = []
        self._stops: list[int] = []
        for start, stop in ranges or []:
            self.add(start, stop)

    def add(self, start: int, stop: int) -> None:
        if stop <= start:
            return
        # Find every range touching [start, stop] and replace them with their union.
        i = bisect_right(self._stops, start - 1)
        j = i
        while j < len(self._starts) and self._starts[j] <= stop:
            start = min(start, self._starts[j])
            stop = max(stop, self._stops[j])
            j += 1
        self._starts[i:j] = [start]
        self._stops[i:j] = [stop]

    def covers(self, start: int, stop: int) -> bool:
        i = bisect_right(self._starts, start) - 1
        return i >= 0 and self._stops[i] >= stop

    def total(self) -> int:
        return sum(b - a for a, b in zip(self._starts, self._stops))

    def ranges(self) -> list[tuple[int, int]]:
        return list(zip(self._starts, self._stops))

    def __len__(self) -> int:
        return len(self._starts)


def chunk_ranges(n_rows: int, chunk_rows: int) -> Iterator[tuple[int, int]]:
    for start in range(0, n_rows, chunk_rows):
        yield start, min(start + chunk_rows, n_rows)


class Checkpoint:
    """The finished ranges of one job, saved atomically to ``path``."""

    def __init__(self, path: Path, fingerprint: JobFingerprint, done: RangeSet | None = None) -> None:
        self.path = path
        self.fingerprint = fingerprint
        self.done = done or RangeSet()

    @classmethod
    def load(cls, path: Path) -> Checkpoint:
        try:
            data = json.loads(path.read_text())
        except OSError as exc:
            raise CheckpointError(f"cannot read checkpoint {path}: {exc.strerror}") from None
        except ValueError:
            raise CheckpointError(f"checkpoint {path} is not valid JSON; delete its directory to start over") from None
        if not isinstance(data, dict) or data.get("version") != CHECKPOINT_VERSION:
            raise CheckpointError(f"checkpoint {path} has an unknown format; delete its directory to start over")
        fingerprint = JobFingerprint.from_json(data.get("job") or {})
        try:
            ranges = [(int(a), int(b)) for a, b in data.get("done") or []]
        except (TypeError, ValueError):
            raise CheckpointError(f"checkpoint {path} has malformed ranges") from None
        return cls(path, fingerprint, RangeSet(ranges))

    def pending(self) -> list[tuple[int, int]]:
        """The chunks not yet finished, in row order."""
        fp = self.fingerprint
        return [r for r in chunk_ranges(fp.n_rows, fp.chunk_rows) if not self.done.covers(*r)]

    def save(self) -> None:
        payload = {"version": CHECKPOINT_VERSION, "job": self.fingerprint.to_json(), "done": self.done.ranges()}
        write_atomic(self.path, json.dumps(payload).encode())


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` so that a reader sees the old or the new file, whole."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def commit_chunk(ckpt: Checkpoint, start: int, stop: int, bad: dict[int, str], errors_path: Path) -> None:
    """Record a durably written chunk: its bad rows first, then its range in the checkpoint."""
    if bad:
        with open(errors_path, "ab") as f:
            f.write(b"".join(orjson.dumps({"row": row, "error": bad[row]}) + b"\n" for row in sorted(bad)))
            f.flush()
            os.fsync(f.fileno())
    ckpt.done.add(start, stop)
    ckpt.save()


def keep_errors_of_done(errors_path: Path, ckpt: Checkpoint) -> int:
    """Drop error lines of chunks the checkpoint does not name (they will be redone); count the rest."""
    if not errors_path.exists():
        return 0
    kept = []
    for line in errors_path.read_bytes().splitlines():
        try:
            row = int(orjson.loads(line)["row"])
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            continue  # cut short by a crash: its chunk was never committed
        if ckpt.done.covers(row, row + 1):
            kept.append(line)
    write_atomic(errors_path, b"".join(line + b"\n" for line in kept))
    return len(kept)


def publish_errors(errors_path: Path, output: Path) -> str | None:
    """Move the bad-row report beside the output, sorted by row; None when every row was fine."""
    target = output.with_name(output.name + ".errors.jsonl")
    if not errors_path.exists() or errors_path.stat().st_size == 0:
        target.unlink(missing_ok=True)
        return None
    entries = sorted((orjson.loads(line) for line in errors_path.read_bytes().splitlines() if line.strip()),
                     key=lambda e: e["row"])
    write_atomic(target, b"".join(orjson.dumps(e) + b"\n" for e in entries))
    return str(target)
