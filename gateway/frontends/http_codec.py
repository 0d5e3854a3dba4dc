"""HTTP body codec of the KServe v2 REST protocol: bytes <-> gateway types.

Owns the wire form of the REST inference body (JSON tensors and Triton's
binary tensor data extension, both directions). Compressed bodies are
``gateway.frontends.http_compression``'s.

Nothing here touches aiohttp; ``gateway.frontends.http_api`` moves bytes in and out.
Every problem with a client's body raises ``InvalidArgument`` (or
``Unsupported``) with a message naming the fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.requests.classification import PARAMETER as CLASSIFICATION
from gateway.requests.classification import class_count
from gateway.requests.shared_memory import SHM_KEYS, SharedMemoryRegistry, take_slice, write_output
from gateway.types import InferRequest, InferResponse, RequestedOutput, Tensor
from protos import codec, json_codec
from protos.errors import Internal, InvalidArgument, Unsupported

Buffer = bytes | bytearray | memoryview
ParamValue = bool | int | float | str

# Request-level parameters the frontend consumes instead of passing them on.
_CONSUMED_PARAMETERS = frozenset({"priority", "timeout", "binary_data_output"})
_SHM_HINT = "shared memory is not supported by this server; send the tensor in the request body"


@dataclass(frozen=True, slots=True)
class DecodedInfer:
    """An inference request off the wire, plus how its outputs go back."""

    request: InferRequest
    # Request-level `binary_data_output`: how outputs go back when the request
    # names none (tritonclient sets it then); named outputs say `binary_data` themselves.
    binary_data_output: bool


@dataclass(frozen=True, slots=True)
class EncodedInfer:
    """An inference response ready to send: JSON header, then binary parts in order."""

    header: bytes
    parts: tuple[Buffer, ...]
    # Value of the Inference-Header-Content-Length response header; None when
    # every output is in the JSON (the body is then the JSON alone).
    header_length: int | None

    @property
    def size(self) -> int:
        return len(self.header) + sum(memoryview(p).nbytes for p in self.parts)


# --- requests ---------------------------------------------------------------


def parse_json_object(body: Buffer, what: str) -> dict[str, Any]:
    """The JSON object in ``body``; an empty body is an empty object."""
    if memoryview(body).nbytes == 0:
        return {}
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidArgument(f"{what}: malformed JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidArgument(f"{what}: expected a JSON object, got {_json_type(value)}")
    return value


def decode_infer_request(
    body: Buffer,
    header_length: int | None,
    *,
    model: str,
    version: str = "",
    now: float | None = None,
    shm: SharedMemoryRegistry | None = None,
) -> DecodedInfer:
    """Decode a REST inference body into an ``InferRequest``.

    ``header_length`` is the request's Inference-Header-Content-Length (None
    when absent: the whole body is JSON). Binary tensors become zero-copy
    memoryview slices of ``body``. ``now`` (the event-loop clock) turns the
    request's ``timeout`` parameter into an absolute deadline.
    """
    mv = memoryview(body)
    if mv.ndim != 1 or mv.itemsize != 1:
        mv = mv.cast("B")
    total = len(mv)
    if total == 0:
        raise InvalidArgument("request body is empty; expected a JSON inference request")
    if header_length is None:
        header_length = total
    elif header_length > total:
        raise InvalidArgument(
            f"Inference-Header-Content-Length is {header_length} but the body has only {total} bytes"
        )
    doc = parse_json_object(mv[:header_length], "inference request")
    binary = mv[header_length:]

    request_id = doc.get("id", "")
    if not isinstance(request_id, str):
        raise InvalidArgument(f"'id' must be a string, got {_json_type(request_id)}")
    params = _parameters(doc.get("parameters"), "request")
    for key in params:
        if key.startswith("triton_"):
            raise InvalidArgument(
                f"request parameter '{key}': keys starting with 'triton_' are reserved and must not be set"
            )
    priority = _uint_param(params, "priority")
    timeout_us = _uint_param(params, "timeout")
    binary_out = params.get("binary_data_output", False)
    if not isinstance(binary_out, bool):
        raise InvalidArgument(f"parameter 'binary_data_output' must be true or false, got {binary_out!r}")

    raw_inputs = doc.get("inputs")
    if raw_inputs is None:
        raise InvalidArgument("inference request has no 'inputs'")
    if not isinstance(raw_inputs, list):
        raise InvalidArgument(f"'inputs' must be a list of input tensors, got {_json_type(raw_inputs)}")
    inputs: list[Tensor] = []
    seen: set[str] = set()
    offset = 0
    for index, item in enumerate(raw_inputs):
        tensor, offset = _decode_input(item, index, binary, offset, model, shm)
        if tensor.name in seen:
            raise InvalidArgument(f"input '{tensor.name}' already exists in request")
        seen.add(tensor.name)
        inputs.append(tensor)
    if offset != len(binary):
        raise InvalidArgument(
            f"{len(binary) - offset} bytes of binary data follow the JSON header but no input claims "
            "them; check the inputs' binary_data_size and the Inference-Header-Content-Length header"
        )

    outputs = _decode_outputs(doc.get("outputs"), shm)
    request = InferRequest(
        model=model,
        version=version,
        id=request_id,
        inputs=inputs,
        outputs=outputs,
        parameters={k: v for k, v in params.items() if k not in _CONSUMED_PARAMETERS},
        priority=priority,
        timeout_us=timeout_us,
        deadline=(now + timeout_us / 1e6) if (timeout_us and now is not None) else None,
    )
    return DecodedInfer(request=request, binary_data_output=binary_out)


def _decode_input(
    item: Any, index: int, binary: memoryview, offset: int, model: str, shm: SharedMemoryRegistry | None
) -> tuple[Tensor, int]:
    if not isinstance(item, dict):
        raise InvalidArgument(f"inputs[{index}] must be an object, got {_json_type(item)}")
    name = item.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidArgument(f"inputs[{index}] needs a non-empty string 'name'")
    what = f"input '{name}'"
    datatype = item.get("datatype")
    if not isinstance(datatype, str):
        raise InvalidArgument(f"{what} needs a string 'datatype' such as \"FP32\"")
    shape = _shape(item.get("shape"), what)
    params = _parameters(item.get("parameters"), what)
    has_data = "data" in item
    has_binary = "binary_data_size" in params
    if any(key in params for key in SHM_KEYS):
        if shm is None:
            raise Unsupported(f"{what}: {_SHM_HINT}")
        if has_data or has_binary:
            given = " ".join(f"'{k}'" for k, on in (("data", has_data), ("binary_data_size", has_binary)) if on)
            raise InvalidArgument(
                "Input must set only one of the following fields: 'data', 'binary_data_size' in 'parameters', "
                f"'shared_memory_region' in 'parameters'. But set {given} 'shared_memory_region'"
            )
        window = take_slice(params, name, shm)
        if window is not None:
            data: Buffer = window.read()
            codec.validate_raw(datatype, shape, data, name=name, model=model)
            return Tensor(name=name, datatype=datatype, shape=shape, data=data, parameters=params), offset
    if has_data == has_binary:
        raise InvalidArgument(
            f"{what} must give exactly one of 'data' or parameters.binary_data_size"
            + (", not both" if has_data else "")
        )
    if has_binary:
        size = params.pop("binary_data_size")
        if type(size) is not int or size < 0:
            raise InvalidArgument(f"{what}: binary_data_size must be a non-negative integer, got {size!r}")
        end = offset + size
        if end > len(binary):
            raise InvalidArgument(
                f"{what}: binary_data_size is {size} but only {len(binary) - offset} bytes of binary "
                "data remain after the JSON header (is Inference-Header-Content-Length right?)"
            )
        data = binary[offset:end]
        codec.validate_raw(datatype, shape, data, name=name, model=model)
        offset = end
    else:
        data = _json_to_raw(datatype, shape, item["data"], name)
    return Tensor(name=name, datatype=datatype, shape=shape, data=data, parameters=params), offset


def _json_to_raw(datatype: str, shape: tuple[int, ...], data: Any, name: str) -> bytes:
    try:
        return json_codec.json_to_raw(datatype, shape, data, name=name)
    except (ValueError, TypeError, OverflowError, RecursionError):
        # numpy's own complaints about odd nested values: still the client's data.
        raise InvalidArgument(f"input '{name}': 'data' does not hold {datatype} values of shape "
                              f"{list(shape)}") from None


def _decode_outputs(raw: Any, shm: SharedMemoryRegistry | None) -> list[RequestedOutput]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise InvalidArgument(f"'outputs' must be a list, got {_json_type(raw)}")
    outputs: list[RequestedOutput] = []
    seen: set[str] = set()
    for index, item in enumerate(raw):
        if not isinstance(item, dict):
            raise InvalidArgument(f"outputs[{index}] must be an object, got {_json_type(item)}")
        name = item.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"outputs[{index}] needs a non-empty string 'name'")
        if name in seen:
            raise InvalidArgument(f"output '{name}' already exists in request")
        seen.add(name)
        params = _parameters(item.get("parameters"), f"output '{name}'")
        classes = class_count(params.pop(CLASSIFICATION), name) if CLASSIFICATION in params else 0
        binary = params.pop("binary_data", None)
        if binary is not None and not isinstance(binary, bool):
            raise InvalidArgument(f"output '{name}': binary_data must be true or false, got {binary!r}")
        window = None
        if any(key in params for key in SHM_KEYS):
            if shm is None:
                raise Unsupported(f"output '{name}': {_SHM_HINT}")
            if binary:
                raise InvalidArgument("Output can't set both 'shared_memory_region' and 'binary_data'")
            if classes:
                raise InvalidArgument("Output can't set both 'shared_memory_region' and 'classification'")
            window = take_slice(params, name, shm)
        outputs.append(RequestedOutput(name=name, binary_data=binary, parameters=params, region=window,
                                       classification=classes))
    return outputs


def _shape(raw: Any, what: str) -> tuple[int, ...]:
    if not isinstance(raw, list):
        raise InvalidArgument(f"{what} needs a 'shape' list of non-negative integers")
    for dim in raw:
        if type(dim) is not int or dim < 0:
            raise InvalidArgument(f"{what}: shape {raw} must hold non-negative integers only")
    return tuple(raw)


def _parameters(raw: Any, what: str) -> dict[str, ParamValue]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise InvalidArgument(f"{what}: 'parameters' must be an object, got {_json_type(raw)}")
    for key, value in raw.items():
        if not isinstance(value, (bool, int, float, str)):
            raise InvalidArgument(
                f"{what}: parameter '{key}' must be a string, number or boolean, got {_json_type(value)}"
            )
    return dict(raw)


def _uint_param(params: Mapping[str, Any], key: str) -> int:
    value = params.get(key, 0)
    if type(value) is not int or value < 0:
        raise InvalidArgument(f"parameter '{key}' must be a non-negative integer, got {value!r}")
    return value


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(value), "a number"
    )


# --- responses --------------------------------------------------------------


def encode_infer_response(response: InferResponse, decoded: DecodedInfer) -> EncodedInfer:
    """The REST body of ``response``: outputs as JSON ``data`` or binary parts.

    As in Triton's server: when the request lists outputs, each goes binary
    only when it says ``binary_data: true`` itself; the request-level
    ``binary_data_output`` decides for every output only when none is listed.
    """
    wanted = {o.name: o.binary_data for o in decoded.request.outputs}
    regions = {o.name: o.region for o in decoded.request.outputs if o.region is not None}
    default_binary = decoded.binary_data_output and not wanted
    out_json: list[dict[str, Any]] = []
    parts: list[Buffer] = []
    for tensor in response.outputs:
        _check_output(tensor)
        entry: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape)}
        params = dict(tensor.parameters)
        choice = wanted.get(tensor.name)
        window = regions.get(tensor.name)
        if window is not None:
            # In the client's region: the entry carries only name, datatype and shape, as Triton's.
            write_output(window, tensor.name, tensor.data)
        elif default_binary if choice is None else choice:
            params["binary_data_size"] = memoryview(tensor.data).nbytes
            parts.append(tensor.data)
        else:
            entry["data"] = json_codec.raw_to_json(tensor.datatype, tensor.shape, tensor.data, name=tensor.name)
        if params:
            entry["parameters"] = params
        out_json.append(entry)
    doc: dict[str, Any] = {
        "model_name": response.model or decoded.request.model,
        "model_version": response.version or decoded.request.version,
    }
    request_id = response.id or decoded.request.id
    if request_id:
        doc["id"] = request_id
    if response.parameters:
        doc["parameters"] = response.parameters
    doc["outputs"] = out_json
    header = orjson.dumps(doc)
    return EncodedInfer(header=header, parts=tuple(parts), header_length=len(header) if parts else None)


def _check_output(tensor: Tensor) -> None:
    # A malformed output is the model's fault, not the client's: answer 500.
    try:
        codec.validate_raw(tensor.datatype, tensor.shape, tensor.data, name=tensor.name, role="output")
    except InvalidArgument as exc:
        raise Internal(f"the model returned a malformed output: {exc.message}") from exc
