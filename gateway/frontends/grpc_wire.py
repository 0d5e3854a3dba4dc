"""The gRPC wire form of inference requests and responses: KServe v2
``ModelInferRequest`` -> :class:`InferRequest` (raw or typed contents, request
parameters, requested outputs) and :class:`InferResponse` ->
``ModelInferResponse`` (outputs always in ``raw_output_contents``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import grpc
from tritonclient.grpc import service_pb2

from gateway.requests.classification import PARAMETER as CLASSIFICATION
from gateway.requests.classification import class_count
from gateway.requests.shared_memory import SHM_KEYS, SharedMemoryRegistry, take_slice, write_output
from gateway.types import InferRequest, InferResponse, RelayCall, RequestedOutput, Tensor
from protos import contents_codec, wire
from protos.errors import InvalidArgument, Unsupported

# Request parameters the frontend consumes itself rather than passing on.
_PRIORITY = "priority"
_TIMEOUT = "timeout"
_IGNORED_PARAMETERS = frozenset({"binary_data_output"})  # HTTP-only; gRPC outputs are always raw
_RESERVED_PREFIX = "triton_"
SHM_MESSAGE = (
    "shared memory is not supported by this server; send tensors in the request "
    "(raw_input_contents) instead"
)


# ---- parameters ---------------------------------------------------------------


def param_value(param: service_pb2.InferParameter) -> Any:
    which = param.WhichOneof("parameter_choice")
    return None if which is None else getattr(param, which)


def _set_param(param: service_pb2.InferParameter, value: Any) -> None:
    if isinstance(value, bool):  # before int: bool is an int
        param.bool_param = value
    elif isinstance(value, int):
        if value >= 2**63:
            param.uint64_param = value
        else:
            param.int64_param = value
    elif isinstance(value, float):
        param.double_param = value
    else:
        param.string_param = str(value)


def _non_negative_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgument(f"request parameter '{key}' must be a non-negative integer, got {value!r}")
    return value


def _tensor_parameters(
    params: Any, kind: str, name: str, shm: SharedMemoryRegistry | None
) -> tuple[dict[str, Any], Any]:
    """A tensor's parameters, and its shared-memory window (None when it names no region)."""
    if not params:  # the usual case, and the cheap test on a protobuf map
        return {}, None
    out = {key: param_value(p) for key, p in params.items()}
    if not any(key in out for key in SHM_KEYS):
        return out, None
    if shm is None:
        raise Unsupported(f"{kind} '{name}': {SHM_MESSAGE}")
    return out, take_slice(out, name, shm)


# ---- decode / encode ----------------------------------------------------------


def decode_infer_request(
    pb: service_pb2.ModelInferRequest,
    *,
    raw: Sequence[bytes | memoryview] | None = None,
    allowed_reserved: frozenset[str] = frozenset(),
    shm: SharedMemoryRegistry | None = None,
) -> InferRequest:
    """The ``InferRequest`` of a ``ModelInferRequest`` (no deadline yet).

    Inputs come from a registered shared-memory region (``shm``), from
    ``raw_input_contents`` (in order, one entry per input not in shared
    memory) or else from each input's typed ``contents``. Byte sizes of raw
    inputs are checked by the core against the model; typed contents are
    converted (and counted) here. ``raw`` stands in for the message's own
    ``raw_input_contents`` when a large message kept them aside
    (``protos.wire.RawInferRequest``): the tensors then stay views of the
    received bytes.
    """
    if raw is None:
        raw = pb.raw_input_contents
    # Per request: protobuf field reads are the cost here, so each is read once.
    decoded = [_tensor_parameters(t.parameters, "input", t.name, shm) for t in pb.inputs]
    in_body = sum(1 for _, window in decoded if window is None)
    if raw:
        # Triton checks each input before the entry count: a typed `contents` beside raw contents is named first.
        for tensor, (_, window) in zip(pb.inputs, decoded):
            if window is None and tensor.HasField("contents"):
                raise InvalidArgument(
                    f"contents field must not be specified when using raw_input_contents for '{tensor.name}' "
                    f"for model '{pb.model_name}'"
                )
    if raw and len(raw) != in_body:
        raise InvalidArgument(
            f"raw_input_contents has {len(raw)} entries for {in_body} inputs; when "
            "raw_input_contents is used it must hold every input not in shared memory, in the order of 'inputs'"
        )
    inputs: list[Tensor] = []
    index = 0
    for tensor, (params, window) in zip(pb.inputs, decoded):
        name = tensor.name
        shape = tuple(tensor.shape)  # int64 fields: already Python ints
        if window is not None:
            inputs.append(Tensor(name, tensor.datatype, shape, window.read(), params))
            continue
        if raw:
            data: bytes | memoryview = raw[index]
            index += 1
        else:
            data = contents_codec.contents_to_raw(tensor.datatype, shape, tensor.contents, name=name)
        inputs.append(Tensor(name, tensor.datatype, shape, data, params))

    outputs: list[RequestedOutput] = []
    seen: set[str] = set()
    for o in pb.outputs:
        if o.name in seen:  # as over HTTP, and as Triton refuses it
            raise InvalidArgument(f"output '{o.name}' already exists in request")
        seen.add(o.name)
        out_params, window = _tensor_parameters(o.parameters, "output", o.name, shm)
        out_params.pop("binary_data", None)  # HTTP-only
        classes = class_count(out_params.pop(CLASSIFICATION), o.name) if CLASSIFICATION in out_params else 0
        if classes and window is not None:
            raise InvalidArgument("Output can't set both 'shared_memory_region' and 'classification'")
        outputs.append(RequestedOutput(o.name, parameters=out_params, region=window, classification=classes))

    parameters: dict[str, Any] = {}
    priority = 0
    timeout_us = 0
    for key, param in (pb.parameters.items() if pb.parameters else ()):
        value = param_value(param)
        if key == _PRIORITY:
            priority = _non_negative_int(key, value)
        elif key == _TIMEOUT:
            timeout_us = _non_negative_int(key, value)
        elif key in _IGNORED_PARAMETERS or key in allowed_reserved:
            continue
        elif key.startswith(_RESERVED_PREFIX):
            raise InvalidArgument(
                f"request parameter '{key}': keys starting with '{_RESERVED_PREFIX}' are reserved "
                "and must not be sent"
            )
        else:
            parameters[key] = value

    return InferRequest(
        model=pb.model_name,
        version=pb.model_version,
        id=pb.id,
        inputs=inputs,
        outputs=outputs,
        parameters=parameters,
        priority=priority,
        timeout_us=timeout_us,
    )


# Request parameters a route reads (a sequence's); the rest stay in the bytes for the backend.
_ROUTE_PARAMETERS = frozenset({"sequence_id", "sequence_start", "sequence_end"})


def relay_call(received: wire.ReceivedInferRequest) -> RelayCall | None:
    """The call as the relay lane takes it, or None when the gateway must read it.

    Read: an input or output in a shared-memory region (the client's, known
    only here), an output asking for classification, and parameters the
    gateway consumes or refuses itself (``triton_`` keys, ``binary_data_output``);
    such a call takes the full path, which answers it as ever. A ``priority`` or
    ``timeout`` that is not a non-negative integer is refused here, as there.
    """
    pb = received.header
    for tensors in (pb.inputs, pb.outputs):
        for tensor in tensors:
            if tensor.parameters:  # the usual case, and the cheap test on a protobuf map
                if any(key in tensor.parameters for key in SHM_KEYS) or CLASSIFICATION in tensor.parameters:
                    return None
    parameters: dict[str, Any] = {}
    priority = timeout_us = 0
    for key, param in (pb.parameters.items() if pb.parameters else ()):
        if key in _ROUTE_PARAMETERS:
            parameters[key] = param_value(param)
        elif key == _PRIORITY:
            priority = _non_negative_int(key, param_value(param))
        elif key == _TIMEOUT:
            timeout_us = _non_negative_int(key, param_value(param))
        elif key in _IGNORED_PARAMETERS or key.startswith(_RESERVED_PREFIX):
            return None
    inputs = pb.inputs
    batch_dim = inputs[0].shape[0] if inputs and inputs[0].shape else 1
    data = received.data
    return RelayCall(model=pb.model_name, version=pb.model_version, id=pb.id, data=data, nbytes=len(data),
                     batch_dim=batch_dim, parameters=parameters, priority=priority, timeout_us=timeout_us)


def encode_infer_response(
    resp: InferResponse, request: InferRequest, *, raw_aside: bool = False
) -> service_pb2.ModelInferResponse | wire.RawInferResponse:
    """The ``ModelInferResponse`` of ``resp``: every output in raw_output_contents, id echoed.

    An output requested into a shared-memory region is written there and its
    raw_output_contents entry is empty, as Triton's. With ``raw_aside``,
    outputs of :data:`protos.wire.SPLIT_MIN_BYTES` or more together stay out
    of the message (``protos.wire.RawInferResponse``, for a serializer that
    takes one): large tensors are then not copied into protobuf first.
    """
    regions = {o.name: o.region for o in request.outputs if o.region is not None}
    pb = service_pb2.ModelInferResponse(
        model_name=resp.model or request.model, model_version=resp.version, id=request.id
    )
    if resp.parameters:
        for key, value in resp.parameters.items():
            if not key.startswith("_"):  # underscore keys are the gateway's own bookkeeping
                _set_param(pb.parameters[key], value)
    raws: list[bytes | memoryview] = []
    for tensor in resp.outputs:
        out = pb.outputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
        if tensor.parameters:
            for key, value in tensor.parameters.items():
                _set_param(out.parameters[key], value)
        data = tensor.data
        window = regions.get(tensor.name) if regions else None
        if window is not None:
            write_output(window, tensor.name, data)
            raws.append(b"")
            continue
        raws.append(data)
    if raw_aside and sum(memoryview(r).nbytes for r in raws) >= wire.SPLIT_MIN_BYTES:
        return wire.RawInferResponse(pb, raws)
    pb.raw_output_contents.extend(r if isinstance(r, bytes) else bytes(r) for r in raws)
    return pb


def apply_client_deadline(request: InferRequest | RelayCall, context: grpc.aio.ServicerContext) -> None:
    """Tighten the request's deadline to the client's gRPC deadline, on the loop clock."""
    remaining = context.time_remaining()
    if remaining is None:
        return
    if request.timeout_us and request.timeout_us / 1e6 <= remaining:
        return  # the request's own timeout is tighter; the core applies it
    request.deadline = asyncio.get_running_loop().time() + max(0.0, remaining)
