"""gRPC typed tensor contents of the KServe v2 protocol: a request's
``InferTensorContents`` (``int_contents``, ``fp32_contents``, ...) to raw
bytes, and raw bytes back to typed contents (for clients and tests).

Built on the codec (``protos.codec``: datatypes, BYTES encoding). Each
datatype has one contents field, whose values are wider than the datatype for
the small integers (checked for range); FP16 and BF16 have none and travel
only as raw contents. Problems raise :class:`~protos.codec.CodecError`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from tritonclient.grpc import service_pb2

from protos.codec import (
    _ITEMSIZE,
    DATATYPES,
    Buffer,
    CodecError,
    _check_datatype,
    _fmt_shape,
    _label,
    _serialize_items,
    checked_element_count,
    deserialize_bytes_tensor,
)

# Typed contents field of each datatype, and the numpy dtype its values have.
# FP16 and BF16 have none: they travel only as raw contents.
_CONTENTS: dict[str, tuple[str, np.dtype]] = {
    datatype: (field, np.dtype(wire))
    for field, wire, datatypes in (
        ("bool_contents", np.bool_, ("BOOL",)),
        ("int_contents", np.int32, ("INT8", "INT16", "INT32")),
        ("int64_contents", np.int64, ("INT64",)),
        ("uint_contents", np.uint32, ("UINT8", "UINT16", "UINT32")),
        ("uint64_contents", np.uint64, ("UINT64",)),
        ("fp32_contents", np.float32, ("FP32",)),
        ("fp64_contents", np.float64, ("FP64",)),
        ("bytes_contents", np.object_, ("BYTES",)),
    )
    for datatype in datatypes
}


def contents_to_raw(
    datatype: str,
    shape: Sequence[int],
    contents: service_pb2.InferTensorContents,
    *,
    name: str | None = None,
) -> bytes:
    """Raw bytes of a tensor sent in the typed ``contents`` fields."""
    _check_datatype(datatype)
    what = _label(name, "input")
    if datatype not in _CONTENTS:
        raise CodecError(f"{what}: {datatype} has no typed contents field; send it in raw_input_contents")
    field, wire = _CONTENTS[datatype]
    values = getattr(contents, field)
    count = checked_element_count(datatype, shape, name=name)  # Triton's overflow checks come before the count
    if len(values) != count:
        used = [f.name for f, _ in contents.ListFields()]
        hint = f" (data found in {', '.join(used)})" if used and field not in used else ""
        raise CodecError(
            f"{what}: expected {count} values in {field} for {datatype} {_fmt_shape(shape)}, "
            f"got {len(values)}{hint}"
        )
    if datatype == "BYTES":
        return _serialize_items(values)
    arr = np.fromiter(values, dtype=wire, count=count)
    target = DATATYPES[datatype]
    if target.kind in "iu" and target.itemsize < wire.itemsize and count:
        info = np.iinfo(target)
        if arr.min() < info.min or arr.max() > info.max:
            raise CodecError(f"{what}: a value in {field} is out of range for {datatype}")
    return arr.astype(target, copy=False).tobytes()


def raw_to_contents(datatype: str, raw: Buffer) -> service_pb2.InferTensorContents:
    """Typed contents holding the tensor in ``raw`` (for clients and tests)."""
    _check_datatype(datatype)
    if datatype not in _CONTENTS:
        raise CodecError(f"{datatype} has no typed contents field; use raw contents")
    field, wire = _CONTENTS[datatype]
    contents = service_pb2.InferTensorContents()
    if datatype == "BYTES":
        contents.bytes_contents.extend(deserialize_bytes_tensor(raw).tolist())
        return contents
    size = memoryview(raw).nbytes
    if size % _ITEMSIZE[datatype]:
        raise CodecError(f"{size} bytes is not a whole number of {datatype} elements")
    arr = np.frombuffer(raw, dtype=DATATYPES[datatype]).astype(wire)
    getattr(contents, field).extend(arr.tolist())
    return contents
