"""Tensors of the collective protocol (``protos/collective.proto``): numpy
arrays to and from ``collective_pb2.Tensor``, and how the ranks' parts of one
tensor join -- a sum in rank order or a concatenation laid out as the
splitter cut it (``gather_pieces``).

Joining lives here, beside the wire format, because both ends must agree on
it bit for bit: the splitter's reference executor and the gateway's star path
join parts at the gateway, the workers join them between themselves, and
every rank must end with the same bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from protos import codec
from protos.collective_pb2 import Tensor

ALLREDUCE_SUM = "allreduce_sum"
ALLGATHER = "allgather"
NONE = "none"


def to_message(name: str, array: np.ndarray) -> Tensor:
    return fill_message(Tensor(), name, array)


def fill_message(tensor: Tensor, name: str, array: np.ndarray) -> Tensor:
    """Write ``array`` into ``tensor`` in place -- e.g. the tensor field of a message
    being built: passing a finished ``Tensor`` to a message's constructor copies its
    bytes once more (~0.2 ms for a 512 KiB part)."""
    datatype, shape, raw = codec.encode(array)
    tensor.name = name
    tensor.datatype = datatype
    tensor.shape.extend(shape)
    tensor.raw = raw
    return tensor


def from_message(tensor: Tensor, *, role: str = "input") -> np.ndarray:
    return codec.decode(tensor.datatype, list(tensor.shape), tensor.raw, name=tensor.name, role=role)


def gather_pieces(parts: Sequence[np.ndarray], axis: int, pieces: tuple[int, ...]) -> np.ndarray:
    """Inverse of the fused-piece layout: rank r holds, for every period of
    ``sum(pieces)`` along ``axis``, block r of each piece in turn."""
    if not pieces:
        return np.concatenate(parts, axis=axis)
    n = len(parts)
    period = sum(pieces)
    local_period = period // n
    full_len = parts[0].shape[axis] * n
    repeats = full_len // period
    views = []
    for part in parts:
        shape = part.shape[:axis] + (repeats, local_period) + part.shape[axis + 1 :]
        views.append(part.reshape(shape))
    out = []
    start = 0
    for size in pieces:
        local = size // n
        blocks = [np.take(v, np.arange(start, start + local), axis=axis + 1) for v in views]
        out.append(np.concatenate(blocks, axis=axis + 1))
        start += local
    joined = np.concatenate(out, axis=axis + 1)
    return joined.reshape(parts[0].shape[:axis] + (full_len,) + parts[0].shape[axis + 1 :])


def combine(collective: str, parts: Sequence[np.ndarray], axis: int | None = None, pieces: tuple[int, ...] = ()) -> np.ndarray:
    """Every rank's part (in rank order) joined: summed, or gathered along ``axis``."""
    if collective == ALLREDUCE_SUM:
        # ((p0 + p1) + p2) + ...: the first add writes a fresh array (no copy of p0 first).
        total = parts[0] + parts[1] if len(parts) > 1 else parts[0].copy()
        for part in parts[2:]:
            total += part
        return total
    if collective == ALLGATHER:
        assert axis is not None
        return gather_pieces(parts, axis, pieces)
    raise ValueError(f"unknown collective {collective!r}")
