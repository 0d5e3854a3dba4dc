"""HTTP JSON tensors of the KServe v2 protocol: a request's ``data`` list
(flat or nested, BYTES as strings, BOOL as true/false) to raw bytes, and raw
bytes back to a flat ``data`` list for JSON responses.

Built on the codec (``protos.codec``: datatypes, BYTES encoding); values are
checked strictly: wrong JSON types and out-of-range integers raise
:class:`~protos.codec.CodecError`.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from protos.codec import (
    DATATYPES,
    Buffer,
    CodecError,
    _check_datatype,
    _fmt_shape,
    _label,
    _serialize_items,
    decode,
    element_count,
    numpy_dtype,
)


def _flatten(data: Any, out: list[Any]) -> None:
    for item in data:
        if isinstance(item, list):
            _flatten(item, out)
        else:
            out.append(item)


def json_to_raw(
    datatype: str, shape: Sequence[int], data: Any, *, name: str | None = None
) -> bytes:
    """Raw bytes of an HTTP JSON tensor's ``data`` (flat or nested, row-major).

    Numbers must fit the datatype exactly: no floats or booleans in integer
    tensors, no strings in numeric ones; BYTES elements are strings (UTF-8).
    """
    _check_datatype(datatype)
    what = _label(name, "input")
    count = element_count(shape)
    if not isinstance(data, list):
        raise CodecError(f"{what}: 'data' must be a list, got {type(data).__name__}")
    if datatype == "BYTES":
        flat: list[Any] = []
        _flatten(data, flat)
        if len(flat) != count:
            raise CodecError(f"{what}: expected {count} elements for BYTES {_fmt_shape(shape)}, got {len(flat)}")
        for index, item in enumerate(flat):
            if not isinstance(item, (str, bytes)):
                raise CodecError(f"{what}: BYTES element {index} must be a string, got {type(item).__name__}")
        return _serialize_items(flat)
    target = numpy_dtype(datatype)
    try:
        arr = np.array(data)
    except ValueError:
        raise CodecError(f"{what}: 'data' is a ragged nested list; give a flat or rectangular list") from None
    if arr.size != count:
        raise CodecError(f"{what}: expected {count} elements for {datatype} {_fmt_shape(shape)}, got {arr.size}")
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
