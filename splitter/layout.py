"""Tensor-parallel dataflow states and the arithmetic of sharded layouts.

Every tensor of a tensor-parallel split is in one state:

* ``R``: replicated, every rank holds the unsplit model's exact value;
* ``P``: partial, the unsplit value is the sum over ranks;
* ``S(axis, pieces)``: sharded along ``axis``. The axis is a repetition of a
  period made of ``pieces`` (full sizes, e.g. ``(64,)`` for one plain block
  or ``(64, 64, 64)`` for a fused QKV projection); rank r holds block r of
  every piece of every period. A plain column split is one piece spanning the
  whole axis; a head axis merged with the batch (``[B*h, ...]``) is many
  periods of one piece.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class State:
    kind: str  # "R", "P" or "S"
    axis: int = -1
    pieces: tuple[int, ...] = ()

    def __str__(self) -> str:
        if self.kind != "S":
            return self.kind
        return f"S(axis={self.axis}, pieces={list(self.pieces)})"


REPLICATED = State("R")
PARTIAL = State("P")


def sharded(axis: int, pieces: tuple[int, ...] | list[int]) -> State:
    return State("S", axis, tuple(int(p) for p in pieces))


def shard_slice(array: np.ndarray, axis: int, n: int, rank: int, pieces: tuple[int, ...]) -> np.ndarray:
    """Rank ``rank``'s part of a full array laid out as ``pieces`` along ``axis``."""
    size = array.shape[axis]
    period = sum(pieces)
    repeats = size // period
    view = array.reshape(array.shape[:axis] + (repeats, period) + array.shape[axis + 1 :])
    parts = []
    start = 0
    for piece in pieces:
        block = piece // n
        parts.append(np.take(view, np.arange(start + rank * block, start + (rank + 1) * block), axis=axis + 1))
        start += piece
    joined = np.concatenate(parts, axis=axis + 1)
    return np.ascontiguousarray(joined.reshape(array.shape[:axis] + (size // n,) + array.shape[axis + 1 :]))


def map_sharded_axis(
    in_shapes: tuple[tuple[int, ...], tuple[int, ...]],
    out_shapes: tuple[tuple[int, ...], tuple[int, ...]],
    axis: int,
    piece: int,
    n: int,
) -> tuple[int, int] | None:
    """Where a one-piece shard lands after a row-major reshape.

    View the input as ``[outer, piece, inner]`` with rank r holding block r of
    ``piece``. The output keeps that layout on axis b when the dims before b,
    times a factor f of ``out[b]``, make ``outer``, and the remaining
    ``out[b] / f`` (the new piece) divides by n: rank r's flat range is then
    the same on both sides. Checked on both probe runs, whose dynamic dims
    differ, so a coincidence of sizes cannot pass. Returns ``(b, new_piece)``.
    """
    found: set[tuple[int, int]] = set()
    for in_shape, out_shape in zip(in_shapes, out_shapes):
        if in_shape[axis] % piece:
            return None
        outer = int(np.prod(in_shape[:axis], dtype=np.int64)) * (in_shape[axis] // piece)
        hit = None
        before = 1
        for b, dim in enumerate(out_shape):
            if before and outer % before == 0:
                f = outer // before
                if f and dim % f == 0 and (dim // f) % n == 0:
                    hit = (b, dim // f)
                    break
            before *= dim
            if before > outer:
                break
        if hit is None:
            return None
        found.add(hit)
    return found.pop() if len(found) == 1 else None
