"""The KServe v2 tensor codec: datatypes, raw bytes, typed contents, JSON.

Owns the conversions between numpy arrays and raw tensor bytes: the datatype
table, the BYTES length-prefix encoding (a 4-byte little-endian length before
each element, row-major), and splitting or joining batched tensors along
dim 0. The other wire forms are built on this module: gRPC typed contents
(``InferTensorContents``) in ``protos.contents_codec``, HTTP JSON ``data``
lists in ``protos.json_codec``.

The hot path (``validate_raw``, ``split_rows``, ``concat_rows``) works on
bytes and memoryviews only; numpy appears only where values must be read.
Raw fixed-size tensors are little-endian, as in Triton.

Every problem with a client's tensor raises :class:`CodecError`, an
``InvalidArgument``, with a message that names the tensor and the fix.
"""

from __future__ import annotations

import operator
import struct
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from protos.errors import InvalidArgument

try:
    import ml_dtypes

    _BF16: np.dtype | None = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # BF16 then still validates, splits and joins as raw bytes.
    _BF16 = None

Buffer = bytes | bytearray | memoryview

_U32 = struct.Struct("<I")
_MAX_ELEMENT_BYTES = 0xFFFFFFFF
# Triton sizes tensors in int64: a shape whose byte size passes it is refused.
MAX_TENSOR_BYTES = 2**63 - 1


class CodecError(InvalidArgument):
    """A tensor does not match its datatype, shape or wire form."""


# Bytes per element of each fixed-size datatype; the hot path needs only this.
_ITEMSIZE: dict[str, int] = {
    "BOOL": 1,
    "UINT8": 1, "UINT16": 2, "UINT32": 4, "UINT64": 8,
    "INT8": 1, "INT16": 2, "INT32": 4, "INT64": 8,
    "FP16": 2, "FP32": 4, "FP64": 8, "BF16": 2,
}  # fmt: skip

# Explicit little-endian dtypes: the wire byte order whatever the host's.
DATATYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype("<u1"), "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"), "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"), "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"), "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"), "FP32": np.dtype("<f4"), "FP64": np.dtype("<f8"),
    "BYTES": np.dtype(np.object_),
}  # fmt: skip
if _BF16 is not None:
    DATATYPES["BF16"] = _BF16

_KNOWN = tuple(_ITEMSIZE) + ("BYTES",)
_BY_KIND_SIZE: dict[tuple[str, int], str] = {
    (dt.kind, dt.itemsize): name for name, dt in DATATYPES.items() if dt.kind in "buif"
}


def _label(name: str | None, role: str) -> str:
    return f"{role} '{name}'" if name is not None else "tensor"


def _fmt_shape(shape: Sequence[int]) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


def _check_datatype(datatype: str) -> None:
    if datatype not in _ITEMSIZE and datatype != "BYTES":
        raise CodecError(f"unknown datatype {datatype!r}; expected one of {', '.join(_KNOWN)}")


def numpy_dtype(datatype: str) -> np.dtype:
    """The numpy dtype of a KServe datatype (``object`` for BYTES)."""
    dtype = DATATYPES.get(datatype)
    if dtype is None:
        _check_datatype(datatype)
        raise CodecError("datatype BF16 needs the ml_dtypes package, which is not installed")
    return dtype


def datatype_of(dtype: Any) -> str:
    """The KServe datatype of a numpy dtype; object, bytes and str arrays are BYTES."""
    dt = np.dtype(dtype)
    if dt.kind in "OSU":
        return "BYTES"
    if _BF16 is not None and dt == _BF16:
        return "BF16"
    name = _BY_KIND_SIZE.get((dt.kind, dt.itemsize))
    if name is None:
        raise CodecError(f"numpy dtype {dt} has no KServe datatype")
    return name


def element_count(shape: Sequence[int]) -> int:
    """Number of elements of a shape; every dim must be a non-negative integer."""
    count = 1
    for dim in shape:
        try:
            dim = operator.index(dim)
        except TypeError:
            raise CodecError(f"shape {list(shape)} has a non-integer dim {dim!r}") from None
        if dim < 0:
            raise CodecError(f"shape {_fmt_shape(shape)} has a negative dim; give the actual size")
        count *= dim
    return count


def checked_element_count(
    datatype: str, shape: Sequence[int], *, name: str | None = None, role: str = "input", model: str | None = None
) -> int:
    """``element_count`` of a tensor's shape, refusing what passes int64 as Triton does.

    Checked in Triton's order, before anything counts the tensor's data: the
    element count first ("... causes total element count to exceed maximum
    size of ..."), then the byte size ("byte size overflow for input ...").
    """
    count = element_count(shape)
    what = _label(name, role)
    for_model = f" for model '{model}'" if model else ""
    if count > MAX_TENSOR_BYTES:
        raise CodecError(
            f"{what}{for_model}: shape {_fmt_shape(shape)} causes total element count to exceed maximum size of "
            f"{MAX_TENSOR_BYTES}"
        )
    if datatype != "BYTES" and _ITEMSIZE[datatype] * count > MAX_TENSOR_BYTES:
        raise CodecError(
            f"byte size overflow for {what}{for_model}: {datatype} {_fmt_shape(shape)} would take "
            f"{_ITEMSIZE[datatype] * count} bytes, more than the {MAX_TENSOR_BYTES} a tensor may hold"
        )
    return count


def byte_size(datatype: str, shape: Sequence[int]) -> int | None:
    """Raw size in bytes of a fixed-size tensor; None for BYTES (variable size)."""
    _check_datatype(datatype)
    if datatype == "BYTES":
        element_count(shape)
        return None
    return _ITEMSIZE[datatype] * element_count(shape)


# --- BYTES ------------------------------------------------------------------


def serialize_bytes_tensor(arr: np.ndarray) -> bytes:
    """Length-prefixed row-major form of a tensor of bytes or str (str as UTF-8).

    Like tritonclient, numpy ``bytes_`` arrays lose trailing NULs (numpy strips
    them); use object arrays to keep them.
    """
    return _serialize_items(np.asarray(arr).reshape(-1, order="C").tolist())


def _serialize_items(items: Iterable[Any]) -> bytes:
    parts: list[bytes | bytearray] = []
    for index, item in enumerate(items):
        if isinstance(item, str):
            item = item.encode("utf-8")
        elif isinstance(item, memoryview):
            item = item.tobytes()
        elif not isinstance(item, (bytes, bytearray)):
            raise CodecError(
                f"BYTES element {index} is {type(item).__name__}; elements must be bytes or str"
            )
        if len(item) > _MAX_ELEMENT_BYTES:
            raise CodecError(f"BYTES element {index} is over 4 GiB")
        parts.append(_U32.pack(len(item)))
        parts.append(item)
    return b"".join(parts)


def _walk_bytes(mv: memoryview, start: int, count: int, what: str) -> int:
    """Offset just past ``count`` length-prefixed elements starting at ``start``."""
    end = len(mv)
    offset = start
    unpack = _U32.unpack_from
    for index in range(count):
        if offset + 4 > end:
            if offset == end:
                raise CodecError(f"{what}: BYTES data ends after {index} of {count} elements")
            raise CodecError(f"{what}: BYTES data is truncated inside a length prefix at byte {offset}")
        length = unpack(mv, offset)[0]
        if offset + 4 + length > end:
            raise CodecError(
                f"{what}: BYTES element at byte {offset} claims {length} bytes "
                f"but only {end - offset - 4} remain"
            )
        offset += 4 + length
    return offset


def _bytes_view(raw: Buffer) -> memoryview:
    mv = memoryview(raw)
    if mv.ndim != 1 or mv.itemsize != 1:
        mv = mv.cast("B")
    return mv


def deserialize_bytes_tensor(raw: Buffer, count: int | None = None) -> np.ndarray:
    """Flat object array of the bytes elements in ``raw``.

    With ``count``, exactly that many elements must fill ``raw`` exactly.
    """
    mv = _bytes_view(raw)
    end = len(mv)
    items: list[bytes] = []
    offset = 0
    unpack = _U32.unpack_from
    while (offset < end) if count is None else (len(items) < count):
        if offset + 4 > end:
            if count is not None and offset == end:
                raise CodecError(f"BYTES data holds {len(items)} elements, expected {count}")
            raise CodecError(f"BYTES data is truncated inside a length prefix at byte {offset}")
        length = unpack(mv, offset)[0]
        offset += 4
        if offset + length > end:
            raise CodecError(
                f"BYTES element {len(items)} claims {length} bytes but only {end - offset} remain"
            )
        items.append(mv[offset : offset + length].tobytes())
        offset += length
    if offset != end:
        raise CodecError(f"BYTES data has {end - offset} trailing bytes after {len(items)} elements")
    out = np.empty(len(items), dtype=np.object_)
    out[:] = items
    return out


# --- arrays -----------------------------------------------------------------


def encode(arr: np.ndarray) -> tuple[str, list[int], bytes]:
    """(datatype, shape, raw) of an array; raw is row-major little-endian."""
    arr = np.asarray(arr)
    datatype = datatype_of(arr.dtype)
    shape = list(arr.shape)
    if datatype == "BYTES":
        return datatype, shape, serialize_bytes_tensor(arr)
    wire = DATATYPES[datatype]
    if arr.dtype != wire:  # big-endian input
        arr = arr.astype(wire)
    return datatype, shape, arr.tobytes(order="C")


def validate_raw(
    datatype: str,
    shape: Sequence[int],
    raw: Buffer,
    *,
    name: str | None = None,
    role: str = "input",
    model: str | None = None,
) -> None:
    """Check that ``raw`` is exactly a ``datatype`` tensor of ``shape``.

    A wrong size is worded as Triton words it ("input byte size mismatch for
    input 'X' for model 'M'. Expected N, got M"), then the tensor's datatype
    and shape.
    """
    _check_datatype(datatype)
    count = checked_element_count(datatype, shape, name=name, role=role, model=model)
    what = _label(name, role)
    for_model = f" for model '{model}'" if model else ""
    if datatype == "BYTES":
        mv = _bytes_view(raw)
        end = _walk_bytes(mv, 0, count, what)
        if end != len(mv):
            raise CodecError(
                f"{what}: BYTES {_fmt_shape(shape)} has {len(mv) - end} bytes after its {count} elements"
            )
        return
    size = _ITEMSIZE[datatype] * count
    got = memoryview(raw).nbytes
    if got != size:
        raise CodecError(
            f"{role + ' ' if name is not None else ''}byte size mismatch for {what}{for_model}. Expected {size}, got {got} "
            f"({datatype} {_fmt_shape(shape)} takes {size} bytes)"
        )


def decode(
    datatype: str,
    shape: Sequence[int],
    raw: Buffer,
    *,
    name: str | None = None,
    role: str = "input",
    model: str | None = None,
) -> np.ndarray:
    """Array of ``shape`` over ``raw`` (read-only, zero-copy for fixed-size types)."""
    _check_datatype(datatype)
    count = element_count(shape)
    dims = tuple(operator.index(d) for d in shape)
    if datatype == "BYTES":
        try:
            return deserialize_bytes_tensor(raw, count).reshape(dims)
        except CodecError as exc:
            raise CodecError(f"{_label(name, role)}: {exc.message}") from None
    validate_raw(datatype, dims, raw, name=name, role=role, model=model)
    return np.frombuffer(raw, dtype=numpy_dtype(datatype)).reshape(dims)


# --- batching ---------------------------------------------------------------


def split_rows(
    datatype: str, shape: Sequence[int], raw: Buffer, rows: Sequence[int]
) -> list[memoryview]:
    """Split a batched tensor along dim 0 into parts of ``rows`` rows each.

    The parts are zero-copy views of ``raw``; ``rows`` must sum to ``shape[0]``.
    """
    _check_datatype(datatype)
    if len(shape) == 0:
        raise CodecError("cannot split a scalar tensor by rows")
    per_row = element_count(shape[1:])
    batch = element_count(shape[:1])
    if any(r < 0 for r in rows) or sum(rows) != batch:
        raise CodecError(f"row counts {list(rows)} do not add up to the batch size {batch}")
    mv = _bytes_view(raw)
    parts: list[memoryview] = []
    offset = 0
    if datatype == "BYTES":
        for r in rows:
            end = _walk_bytes(mv, offset, r * per_row, "batched tensor")
            parts.append(mv[offset:end])
            offset = end
        if offset != len(mv):
            raise CodecError(f"batched tensor: BYTES data has {len(mv) - offset} trailing bytes")
        return parts
    validate_raw(datatype, shape, mv)
    row_bytes = _ITEMSIZE[datatype] * per_row
    for r in rows:
        end = offset + r * row_bytes
        parts.append(mv[offset:end])
        offset = end
    return parts


def concat_rows(parts: Sequence[Buffer]) -> bytes:
    """Join row-major tensors with equal non-batch shapes along dim 0."""
    return b"".join(parts)

