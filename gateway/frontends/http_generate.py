"""Triton's generate extension on the REST frontend: ``/generate`` and ``/generate_stream``.

``POST /v2/models/{m}[/versions/{v}]/generate`` answers one JSON object;
``.../generate_stream`` answers Server-Sent Events, one ``data: {json}``
event per response of the model, each written as it arrives, the body
closed after the last. Both take the same flat JSON body, mapped as
Triton's server maps it (src/http_server.cc, ``HandleGenerate``):

- each top-level key that names one of the model's inputs becomes that
  input: a scalar is one element, a list its elements; the datatype comes
  from the model's metadata and the shape from the metadata's, its fixed
  dims taken as they are and the innermost variable dim given what is left
  (the other variable dims 1);
- ``parameters`` is an object whose keys map the same way (input or
  parameter); ``id`` is the request id; every other key is a request
  parameter (string, integer, boolean or number);
- a response is one object: ``model_name``, ``model_version``, ``id`` when
  the request had one, each response parameter by name, and each output by
  name, a single element as a scalar, more as a flat list; keys in byte
  order, as Triton's map of them.

An ordinary model runs through ``InferenceCore.infer`` (one response, one
event); a decoupled one through ``InferenceCore.stream``. ``/generate`` on
a decoupled model answers its one response, and refuses a model that sends
none or several with Triton's words. Errors before the first response are
ordinary JSON error answers (the app's error middleware); an error after
the event stream has begun is one ``data: {"error": ...}`` event, the last.
A client that goes away mid-stream cancels the stream, which cancels the
model's request on its worker.

The mapping and the framing are pure functions (``generate_request``,
``generate_response_json``, ``sse_event``), tested without sockets.

May import: what ``gateway.frontends`` may import.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import aclosing
from typing import Any

import numpy as np
import orjson
from aiohttp import hdrs, web
from aiohttp.web_response import ContentCoding

from gateway.frontends.http_compression import choose_encoding
from gateway.limits import TIMEOUT_HEADER, apply_timeout_header
from gateway.observability.tracing import RequestTracing
from gateway.types import InferenceCore, InferRequest, InferResponse, Tensor
from protos import json_codec
from protos.codec import DATATYPES, serialize_bytes_tensor
from protos.errors import InferGateError, Internal, InvalidArgument, Unsupported
from protos.triton_words import FINAL_RESPONSE

log = logging.getLogger(__name__)

SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"
# Triton's words for /generate on a model that sent no response or several.
NOT_ONE_RESPONSE = ("generate expects model to produce exactly 1 response, use generate stream for model that "
                    "generates various number of responses")
# The flag a decoupled model's responses carry: the stream's business, not the client's JSON.
_PARAMETERS = "parameters"
# Responses below this go uncompressed (as on /infer).
_COMPRESS_MIN_BYTES = 512

InputSpec = tuple[str, Sequence[int]]  # an input's datatype and its shape in the model's metadata
ReadBody = Callable[[web.Request], Awaitable[bytes]]


# --- the request body -> an InferRequest ---------------------------------------------


def parse_generate_body(body: bytes) -> dict[str, Any]:
    """The body's JSON object, refused in Triton's words when it is not one."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        reason = "The document is empty." if not body.strip() else exc.msg
        raise InvalidArgument(f"failed to parse the request JSON buffer: {reason} at {exc.pos}") from None
    if not isinstance(doc, dict):
        raise InvalidArgument("attempt to get members for non-object")
    return doc


def generate_request(doc: Mapping[str, Any], *, model: str, version: str,
                     inputs: Mapping[str, InputSpec]) -> InferRequest:
    """The inference ``doc`` asks of ``model``, whose inputs are ``inputs`` (name -> spec)."""
    request_id = doc.get("id", "")
    if not isinstance(request_id, str):
        raise InvalidArgument("Unable to parse 'id': attempt to access JSON non-string as string")
    tensors: dict[str, Tensor] = {}
    parameters: dict[str, Any] = {}
    for key, value in doc.items():
        if key == _PARAMETERS:
            if key in inputs:
                raise InvalidArgument("Keyword 'parameters' for nested schema also given as input tensor name")
            if not isinstance(value, dict):
                raise InvalidArgument("Expected JSON object for keyword: 'parameters': "
                                      "attempt to access JSON non-object as object")
            try:
                for name, nested in value.items():
                    _map_member(name, nested, inputs, tensors, parameters)
            except InvalidArgument as exc:
                raise InvalidArgument(f"Converting keyword: 'parameters': {exc.message}") from None
        elif key == "id" and key not in inputs:
            continue
        else:
            _map_member(key, value, inputs, tensors, parameters)
    return InferRequest(model=model, version=version, id=request_id, inputs=list(tensors.values()),
                        outputs=[], parameters=parameters)


def _map_member(key: str, value: Any, inputs: Mapping[str, InputSpec], tensors: dict[str, Tensor],
                parameters: dict[str, Any]) -> None:
    spec = inputs.get(key)
    if spec is None:
        # Triton sets any non-input key as a request parameter (no 'triton_' check on this endpoint).
        if isinstance(value, (str, bool, int, float)):
            parameters[key] = value
            return
        raise InvalidArgument(f"parameter '{key}' has invalid type. It should be either 'int', 'bool', or 'string'.")
    datatype, shape = spec
    tensors[key] = input_tensor(key, datatype, shape, value)


def input_tensor(name: str, datatype: str, model_shape: Sequence[int], value: Any) -> Tensor:
    """The input ``name`` from a JSON scalar or flat list, shaped from the model's ``model_shape``."""
    values = value if isinstance(value, list) else [value]
    shape = fit_shape(name, model_shape, len(values))
    if datatype in ("FP16", "BF16"):
        raise InvalidArgument(f"receiving {datatype} data via JSON is not supported. Please use the binary data "
                              f"format for input {name}")
    if any(isinstance(v, (list, dict)) for v in values):
        raise InvalidArgument("Unable to parse 'data': Shape does not match true shape of 'data' field")
    if datatype == "BYTES":
        if not all(isinstance(v, str) for v in values):
            raise InvalidArgument("Unable to parse JSON bytes array: attempt to access JSON non-string as string")
        data = serialize_bytes_tensor(np.array([v.encode("utf-8") for v in values], dtype=np.object_))
        return Tensor(name=name, datatype=datatype, shape=shape, data=data)
    dtype = DATATYPES.get(datatype)
    if dtype is None:
        raise InvalidArgument(f"invalid datatype for input {name}")
    return Tensor(name=name, datatype=datatype, shape=shape, data=_numbers(name, datatype, dtype, values))


def _numbers(name: str, datatype: str, dtype: np.dtype, values: list[Any]) -> bytes:
    def bad(what: str) -> InvalidArgument:
        return InvalidArgument(f"Unable to parse 'data': attempt to access JSON {what}")

    if dtype.kind == "b":
        if not all(isinstance(v, bool) for v in values):
            raise bad("non-boolean as boolean")
    elif dtype.kind in "iu":
        signed = dtype.kind == "i"
        if not all(isinstance(v, int) and not isinstance(v, bool) and (signed or v >= 0) for v in values):
            raise bad("non-signed-integer as signed-integer" if signed else
                      "non-unsigned-integer as unsigned-integer")
        info = np.iinfo(dtype)
        if values and (min(values) < info.min or max(values) > info.max):
            # Triton casts silently (a FIXME in its server); a wrapped value would be a wrong answer.
            raise InvalidArgument(f"Unable to parse 'data': a value of input '{name}' is out of range for {datatype}")
    elif not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        raise bad("non-number as double")
    with np.errstate(over="ignore"):  # past FP32's range becomes inf, as Triton's C cast
        return np.array(values, dtype=np.float64 if dtype.kind == "f" else None).astype(dtype).tobytes()


def fit_shape(name: str, model_shape: Sequence[int], count: int) -> tuple[int, ...]:
    """Triton's two passes: fixed dims divide ``count``; the innermost variable dim takes the rest, others 1."""
    dims = list(model_shape)
    left = count
    for dim in reversed(dims):
        if dim != -1:
            if dim == 0 or left % dim:
                raise InvalidArgument(f"The schema can not convert input '{name}' to tensor with proper shape")
            left //= dim
    for index in range(len(dims) - 1, -1, -1):
        if dims[index] == -1:
            dims[index] = left
            left = 1
    if left != 1:
        raise InvalidArgument(f"The schema can not convert input '{name}' to tensor with proper shape")
    return tuple(dims)


# --- a response -> JSON, and the event framing ----------------------------------------


def generate_response_json(response: InferResponse, request: InferRequest) -> dict[str, Any]:
    """One response as Triton's generate object (keys in byte order; reserved names first come, first kept)."""
    fields: dict[str, Any] = {}
    request_id = response.id or request.id
    if request_id:
        fields["id"] = request_id
    fields["model_name"] = response.model or request.model
    fields["model_version"] = response.version or request.version
    for key, value in response.parameters.items():
        if key == FINAL_RESPONSE or key in fields:
            continue
        if not isinstance(value, (str, bool, int, float)):
            raise Unsupported(f"Response parameter '{key}' has type 'TRITONSERVER_PARAMETER_BYTES' which is "
                              "not currently supported")
        fields[key] = value
    for tensor in response.outputs:
        if tensor.name in fields:
            continue
        try:
            values = json_codec.raw_to_json(tensor.datatype, tensor.shape, tensor.data, name=tensor.name,
                                            errors="replace")
        except InferGateError as exc:
            raise Internal(f"the model returned a malformed output: {exc.message}") from exc
        fields[tensor.name] = values[0] if len(values) == 1 else values
    return {key: fields[key] for key in sorted(fields, key=lambda k: k.encode("utf-8"))}


def sse_event(doc: Mapping[str, Any]) -> bytes:
    """One Server-Sent Event carrying ``doc``: ``data: {json}`` and a blank line."""
    return b"data: " + orjson.dumps(doc) + b"\n\n"


def sse_error(message: str) -> bytes:
    """The event of an error after the stream has begun."""
    return sse_event({"error": message})


def input_specs(metadata: Any) -> dict[str, InputSpec]:
    """Name -> (datatype, shape) of each input in a ``ModelMetadataResponse``."""
    return {tensor.name: (tensor.datatype, tuple(tensor.shape)) for tensor in metadata.inputs}


# --- the endpoints ---------------------------------------------------------------------


class GenerateApi:
    """The two endpoints, bound to one core; the app's ``read_body`` bounds and inflates bodies,
    and ``name_request`` hears each request's id (the error middleware logs it)."""

    def __init__(self, core: InferenceCore, read_body: ReadBody, tracing: RequestTracing,
                 name_request: Callable[[str], object] = lambda request_id: None) -> None:
        self._core = core
        self._read_body = read_body
        self._tracing = tracing
        self._name_request = name_request

    async def generate(self, request: web.Request) -> web.StreamResponse:
        infer = await self._decode(request)
        with self._tracing.request(infer, request.headers, "HTTP"):
            if self._decoupled(infer):
                response = await self._only_response(infer)
            else:
                response = await self._core.infer(infer)
            body = orjson.dumps(generate_response_json(response, infer))
        answer = web.Response(body=body, content_type="application/json")
        if len(body) >= _COMPRESS_MIN_BYTES:
            coding = choose_encoding(request.headers.get(hdrs.ACCEPT_ENCODING, ""))
            if coding != "identity":
                answer.enable_compression(ContentCoding(coding))
        return answer

    async def generate_stream(self, request: web.Request) -> web.StreamResponse:
        infer = await self._decode(request)
        with self._tracing.request(infer, request.headers, "HTTP"):
            if not self._decoupled(infer):
                response = await self._core.infer(infer)
                return await _send_events(request, infer, response, _no_more(), self._core.stream_written)
            async with aclosing(self._core.stream(infer)) as responses:
                # An error before the first response is an ordinary error answer.
                first = await anext(responses, None)
                return await _send_events(request, infer, first, responses, self._core.stream_written)

    async def _decode(self, request: web.Request) -> InferRequest:
        name = request.match_info.get("model", "")
        version = request.match_info.get("version", "")
        now = asyncio.get_running_loop().time()
        # Triton reads the model's metadata before the body: an unknown model is named first.
        specs = input_specs(self._core.model_metadata(name, version))
        doc = parse_generate_body(await self._read_body(request))
        infer = generate_request(doc, model=name, version=version, inputs=specs)
        infer.arrival = now
        self._name_request(infer.id)
        apply_timeout_header(infer, request.headers.get(TIMEOUT_HEADER), now)
        return infer

    def _decoupled(self, infer: InferRequest) -> bool:
        config = self._core.model_config(infer.model, infer.version)
        return bool(config.model_transaction_policy.decoupled)


    async def _only_response(self, infer: InferRequest) -> InferResponse:
        """A decoupled model's one response; none or a second one is Triton's refusal."""
        only: InferResponse | None = None
        async with aclosing(self._core.stream(infer)) as responses:
            async for response in responses:
                if only is not None:
                    # Leaving the loop closes the stream: the model's request is cancelled.
                    raise InvalidArgument(NOT_ONE_RESPONSE)
                only = response
        if only is None:
            raise InvalidArgument(NOT_ONE_RESPONSE)
        return only


async def _no_more() -> AsyncIterator[InferResponse]:
    return
    yield  # an async generator with nothing in it


async def _send_events(request: web.Request, infer: InferRequest, first: InferResponse | None,
                       rest: AsyncIterator[InferResponse], written: Callable[[InferResponse], None],
                       ) -> web.StreamResponse:
    """The event stream: ``first`` (None when the model sent nothing) and then ``rest`` as they come.

    ``written`` hears of each response once its event is written (the core measures the gap).
    """
    stream = web.StreamResponse(status=200, headers={hdrs.CACHE_CONTROL: "no-cache"})
    stream.content_type = "text/event-stream"
    stream.charset = "utf-8"
    await stream.prepare(request)
    try:
        if first is not None:
            await stream.write(sse_event(generate_response_json(first, infer)))
            written(first)
            async for response in rest:
                await stream.write(sse_event(generate_response_json(response, infer)))
                written(response)
    except InferGateError as exc:
        # The status has gone out: the error is the stream's last event.
        log.debug("stream of %s (request id %r) ended with %d: %s", infer.model, infer.id, exc.http_status,
                  exc.message)
        await _write_last(stream, sse_error(exc.message))
        return stream
    except ConnectionResetError:
        # The client went away (a write found the connection gone; while waiting for the
        # model, aiohttp cancels the handler instead): the caller's ``aclosing`` closes
        # the stream, which cancels the model's request on its worker.
        log.debug("client left the stream of %s (request id %r)", infer.model, infer.id)
        return stream
    except Exception as exc:  # the error edge of a stream already begun
        log.exception("unexpected error streaming %s (request id %r)", infer.model, infer.id)
        await _write_last(stream, sse_error(Internal.caused_by(f"streaming {request.path}", exc, infer.id).message))
        return stream
    await stream.write_eof()
    return stream


async def _write_last(stream: web.StreamResponse, event: bytes) -> None:
    try:
        await stream.write(event)
        await stream.write_eof()
    except ConnectionResetError:
        pass  # nobody left to tell
