"""Validation of a decoded request against the model's metadata and config.

Runs once per request at the gateway, before it is queued, so a bad request
never reaches a batch (one bad row must not fail its batch-mates). Messages
follow Triton's wording where Triton has one, so clients see the same text
whether they talk to Triton or to infergate.

What a request is checked against is read out of the model's protobufs once
per metadata/config pair (:class:`_ModelTables`), not on every request:
protobuf field reads are most of what validating a small request costs.
"""

from __future__ import annotations

from dataclasses import dataclass

from tritonclient.grpc import model_config_pb2, service_pb2

from gateway.types import InferRequest
from protos import codec
from protos.errors import InvalidArgument, Unsupported


def _fmt(shape: "tuple[int, ...] | list[int]") -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


@dataclass(frozen=True, slots=True)
class _ModelTables:
    inputs: dict[str, tuple[str, tuple[int, ...]]]  # name -> (datatype, shape), in the model's order
    optional: frozenset[str]
    outputs: frozenset[str]
    order: dict[str, int]  # input name -> position in the model's order
    max_batch: int


# The cluster swaps in new metadata/config objects when a model changes and keeps
# them otherwise, so their identity is the cache key; entries hold the objects, so
# an id is never reused while cached. Bounded: cleared when full.
_TABLES: dict[tuple[int, int], tuple[object, object, _ModelTables]] = {}
_TABLES_MAX = 256


def _tables(metadata: service_pb2.ModelMetadataResponse, config: model_config_pb2.ModelConfig) -> _ModelTables:
    key = (id(metadata), id(config))
    hit = _TABLES.get(key)
    if hit is not None and hit[0] is metadata and hit[1] is config:
        return hit[2]
    inputs = {t.name: (t.datatype, tuple(t.shape)) for t in metadata.inputs}
    tables = _ModelTables(
        inputs=inputs,
        optional=frozenset(i.name for i in config.input if i.optional),
        outputs=frozenset(t.name for t in metadata.outputs),
        order={name: i for i, name in enumerate(inputs)},
        max_batch=config.max_batch_size,
    )
    if len(_TABLES) >= _TABLES_MAX:
        _TABLES.clear()
    _TABLES[key] = (metadata, config, tables)
    return tables


def validate_request(
    request: InferRequest,
    metadata: service_pb2.ModelMetadataResponse,
    config: model_config_pb2.ModelConfig,
) -> int:
    """Check names, datatypes, shapes and byte sizes; return the request's row count.

    Inputs are reordered to the model's input order, so requests of one model
    concatenate input by input without name lookups on the hot path.
    """
    model = request.model
    tables = _tables(metadata, config)
    max_batch = tables.max_batch
    expected = tables.inputs
    optional = tables.optional

    seen: dict[str, int] = {}
    for index, tensor in enumerate(request.inputs):
        if tensor.name in seen:
            raise InvalidArgument(f"input '{tensor.name}' given more than once for model '{model}'")
        seen[tensor.name] = index
        if tensor.name not in expected:
            raise InvalidArgument(f"unexpected inference input '{tensor.name}' for model '{model}'")

    if len(seen) < len(expected):
        missing = [name for name in expected if name not in seen and name not in optional]
        if missing:
            raise InvalidArgument(
                f"expected {len(expected)} inputs but got {len(request.inputs)} inputs for model '{model}'; "
                f"missing: {', '.join(repr(m) for m in missing)}"
            )

    rows = 1
    batch_dims: set[int] = set()
    for tensor in request.inputs:
        datatype, want = expected[tensor.name]
        if tensor.datatype != datatype:
            raise InvalidArgument(
                f"inference input '{tensor.name}' data-type is '{tensor.datatype}', "
                f"but model '{model}' expects '{datatype}'"
            )
        got = tensor.shape
        if any(d < 0 for d in got):
            raise InvalidArgument(f"input '{tensor.name}' has a negative dimension in shape {_fmt(got)}")
        if max_batch > 0:
            if not got:
                raise InvalidArgument(
                    f"input '{tensor.name}' for model '{model}' needs a batch dimension: expected {_fmt(want)}, got []"
                )
            batch_dims.add(got[0])
        if len(got) != len(want) or any(w >= 0 and w != g for w, g in zip(want, got)):
            # With batching the metadata's first dim is -1 and matches any batch size.
            raise InvalidArgument(
                f"unexpected shape for input '{tensor.name}' for model '{model}'. "
                f"Expected {_fmt(want)}, got {_fmt(got)}"
            )
        codec.validate_raw(tensor.datatype, tensor.shape, tensor.data, name=tensor.name, model=model)

    if max_batch > 0 and batch_dims:
        if len(batch_dims) > 1:
            raise InvalidArgument(
                f"inputs of a request to model '{model}' must share the batch size; got {sorted(batch_dims)}"
            )
        rows = batch_dims.pop()
        if rows < 1:
            raise InvalidArgument(f"inference request batch-size must be >= 1 for '{model}'")
        if rows > max_batch:
            raise InvalidArgument(f"inference request batch-size must be <= {max_batch} for '{model}'")

    for out in request.outputs:
        if out.name not in tables.outputs:
            raise InvalidArgument(f"unexpected inference output '{out.name}' for model '{model}'")
        if "classification" in out.parameters:
            raise Unsupported("the classification extension is not supported by infergate")

    if len(request.inputs) > 1:
        order = tables.order
        request.inputs.sort(key=lambda t: order[t.name])
    return rows
