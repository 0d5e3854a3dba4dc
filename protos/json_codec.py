"""HTTP JSON tensors of the KServe v2 protocol: a request's ``data`` list
(flat or nested, BYTES as strings, BOOL as true/false) to raw bytes, and raw
bytes back to a flat ``data`` list for JSON responses.

Built on the codec (``protos.codec``: datatypes, BYTES encoding); values are
checked strictly: wrong JSON types and out-of-range integers raise
:class:`~protos.codec.CodecError`.

Nesting, as in Triton: ``data`` may be flat or nested lists of any shape
(only the element count must match the tensor's shape, in row-major order)
up to :data:`MAX_JSON_DEPTH` levels of lists, ``data`` itself counting as
one; deeper nesting is refused in Triton's words. Rectangular lists up to
numpy's 32 dimensions take numpy's fast path; the rest are flattened here.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from protos.codec import (
    DATATYPES,
    Buffer,
    CodecError,
    _check_datatype,
    _label,
    _serialize_items,
    checked_element_count,
    decode,
    numpy_dtype,
)


MAX_JSON_DEPTH = 100
DEPTH_MESSAGE = f"JSON nesting depth exceeds maximum allowed limit ({MAX_JSON_DEPTH})"
_NUMPY_MAX_DIMS = 32


def _flatten(data: list[Any], what: str) -> list[Any]:
    """The leaves of nested lists in row-major order; at most MAX_JSON_DEPTH levels."""
    out: list[Any] = []
    # Iterative, so no depth of client input can reach Python's recursion limit.
    stack: list[tuple[list[Any], int, int]] = [(data, 0, 1)]
    while stack:
        items, index, depth = stack.pop()
        while index < len(items):
            item = items[index]
            index += 1
            if isinstance(item, list):
                if depth + 1 > MAX_JSON_DEPTH:
                    raise CodecError(f"{what}: {DEPTH_MESSAGE}")
                stack.append((items, index, depth))
                items, index, depth = item, 0, depth + 1
            else:
                out.append(item)
    return out


def _first_branch_depth(data: list[Any]) -> int:
    depth = 1
    while data and isinstance(data[0], list) and depth <= _NUMPY_MAX_DIMS:
        data = data[0]
        depth += 1
    return depth


# Triton's words, whole, for too many and too few elements alike.
COUNT_MESSAGE = "Unable to parse 'data': Shape does not match true shape of 'data' field"


def _count_error() -> CodecError:
    return CodecError(COUNT_MESSAGE)


def json_to_raw(
    datatype: str, shape: Sequence[int], data: Any, *, name: str | None = None
) -> bytes:
    """Raw bytes of an HTTP JSON tensor's ``data`` (flat or nested, row-major).

    Numbers must fit the datatype exactly: no floats or booleans in integer
    tensors, no strings in numeric ones; BYTES elements are strings (UTF-8).
    """
    _check_datatype(datatype)
    what = _label(name, "input")
    count = checked_element_count(datatype, shape, name=name)
    if not isinstance(data, list):
        raise CodecError(f"{what}: 'data' must be a list, got {type(data).__name__}")
    if datatype == "BYTES":
        flat = _flatten(data, what)
        if len(flat) != count:
            raise _count_error()
        for index, item in enumerate(flat):
            if not isinstance(item, (str, bytes)):
                raise CodecError(f"{what}: BYTES element {index} must be a string, got {type(item).__name__}")
        return _serialize_items(flat)
    target = numpy_dtype(datatype)
    arr = None
    if _first_branch_depth(data) <= _NUMPY_MAX_DIMS:
        try:
            arr = np.array(data)
        except ValueError:  # ragged: flattened below
            arr = None
    if arr is None or arr.dtype == np.object_:
        data = _flatten(data, what)
        arr = np.array(data)
    if arr.size != count:
        raise _count_error()
    if count == 0:
        return b""
    kind = arr.dtype.kind
    if target.kind == "b":
        ok = kind == "b"
        expected = "true or false"
    elif target.kind in "iu":
        if kind in "fO":
            # numpy promotes int64 mixed with values past 2**63 to float64 (or
            # object), losing digits: check those lists on exact Python ints.
            arr = _exact_integers(data, arr, datatype, what)
            kind = arr.dtype.kind
        ok = kind in "iu"
        expected = f"integers that fit {datatype}"
    else:
        ok = kind in "iuf"
        expected = "numbers"
    if not ok:
        raise CodecError(f"{what}: {datatype} data must be {expected}")
    if target.kind in "iu":
        info = np.iinfo(target)
        if int(arr.min()) < info.min or int(arr.max()) > info.max:
            raise CodecError(f"{what}: a value is out of range for {datatype}")
    with np.errstate(over="ignore"):  # floats past FP16/FP32 range become inf, as in a C cast
        return arr.astype(target).tobytes()


def _exact_integers(data: list[Any], arr: np.ndarray, datatype: str, what: str) -> np.ndarray:
    """``data`` as ``datatype`` when it holds only ints; else ``arr`` unchanged."""
    values = np.array(data, dtype=np.object_).reshape(-1).tolist()
    if not all(type(v) is int for v in values):
        return arr  # holds floats, bools or other types: rejected by the caller
    info = np.iinfo(DATATYPES[datatype])
    if min(values) < info.min or max(values) > info.max:
        raise CodecError(f"{what}: a value is out of range for {datatype}")
    return np.array(values, dtype=DATATYPES[datatype])


def raw_to_json(
    datatype: str,
    shape: Sequence[int],
    raw: Buffer,
    *,
    name: str | None = None,
    errors: str = "strict",
) -> list[Any]:
    """Flat list of a tensor's values for an HTTP JSON response.

    FP16 and BF16 come out as floats. BYTES elements are decoded as UTF-8
    strings; with the default ``errors="strict"`` an element that is not
    valid UTF-8 raises CodecError telling the client to ask for the output
    as binary data, because a JSON string cannot carry arbitrary bytes
    losslessly. Pass ``errors="replace"`` to substitute U+FFFD instead.
    """
    arr = decode(datatype, shape, raw, name=name, role="output").reshape(-1)
    if datatype == "BYTES":
        try:
            return [item.decode("utf-8", errors) for item in arr.tolist()]
        except UnicodeDecodeError:
            raise CodecError(
                f"{_label(name, 'output')}: BYTES data is not valid UTF-8; request it as binary data"
            ) from None
    if datatype == "BF16":
        return arr.astype(np.float32).tolist()
    return arr.tolist()
