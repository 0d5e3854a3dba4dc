"""A decoupled model's request on ``ModelStreamInfer``: each response the model
sends goes out at once as a ``ModelStreamInferResponse``, as Triton sends it.

- Every response carries the request's ``id``, the model's name and version,
  its outputs, and the parameter ``triton_final_response`` (false on all but
  the last).
- A response may carry parameters of the model's (a generation's
  ``finish_reason`` and token counts on its final response); a final
  response with parameters always goes out.
- When the model ends with a bare final flag (no data), one response with no
  outputs and ``triton_final_response: true`` goes out only if the request
  set ``triton_enable_empty_final_response: true``; otherwise nothing marks
  the end (Triton's behaviour).
- An error raises out of :func:`serve_decoupled`: the caller (the service's
  stream handler) reports it in-stream (:func:`stream_error_response`), and
  the request ends there. Triton's in-stream error is its message alone; ours
  also names the error's gRPC status in the parameter
  ``infergate_error_code``, so a gateway answers a request's fault (a prompt
  longer than the model's context) as the client's, not as its worker's
  (:func:`stream_error_code`).
- The caller's task cancelled (the stream call cancelled) closes the model's
  response iterator, which cancels the request (``LoadedModel.stream``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable

import grpc
from tritonclient.grpc import service_pb2

from execution.backends.base import StreamEvent
from execution.model import LoadedModel
from execution.tensors import encode_response
from protos import codec
from protos.errors import InferGateError
from protos.triton_words import asks_empty_final, set_final

ERROR_CODE = "infergate_error_code"

Write = Callable[[service_pb2.ModelStreamInferResponse], Awaitable[None]]


def stream_error_response(request: service_pb2.ModelInferRequest, error: InferGateError
                          ) -> service_pb2.ModelStreamInferResponse:  # fmt: skip
    """The in-stream answer to a request that failed: its message, the request's id, and the error's status."""
    response = service_pb2.ModelInferResponse(model_name=request.model_name, model_version=request.model_version,
                                              id=request.id)
    response.parameters[ERROR_CODE].string_param = error.grpc_code.name
    return service_pb2.ModelStreamInferResponse(error_message=error.message, infer_response=response)


def stream_error_code(message: service_pb2.ModelStreamInferResponse) -> grpc.StatusCode | None:
    """The status an in-stream error names (our servers'), or None (Triton's, or a name not known)."""
    param = message.infer_response.parameters.get(ERROR_CODE)
    if param is None:
        return None
    return grpc.StatusCode.__members__.get(param.string_param)


def set_parameter(param: service_pb2.InferParameter, value: object) -> None:
    if isinstance(value, bool):
        param.bool_param = value
    elif isinstance(value, int):
        param.int64_param = value
    elif isinstance(value, float):
        param.double_param = value
    else:
        param.string_param = str(value)


async def serve_decoupled(model: LoadedModel, request: service_pb2.ModelInferRequest, write: Write) -> int:
    """Forward the responses of one request as the model sends them; returns how many went out."""
    empty_final = asks_empty_final(request)
    sent = 0
    # The last plain response (no parameters, not final) and its outputs' shapes: a response of the same
    # shapes (a generation's every token) is a copy of it with new contents, about half the encoding's cost.
    plain: tuple[service_pb2.ModelStreamInferResponse, tuple[tuple[str, str, tuple[int, ...]], ...]] | None = None
    async with contextlib.aclosing(model.stream(request)) as events:
        async for event in events:
            if not event.outputs and not event.parameters and event.final and not empty_final:
                continue
            if event.parameters or event.final:
                message = _message(model, request, event)
            else:
                message = _plain_message(event, plain)
                if message is None:
                    message = _message(model, request, event)
                    plain = (message, _shapes(message.infer_response))
            await write(message)
            sent += 1
    return sent


def _message(model: LoadedModel, request: service_pb2.ModelInferRequest, event: StreamEvent
             ) -> service_pb2.ModelStreamInferResponse:
    response = encode_response(request, model.version_str, event.outputs, list(event.outputs))
    for key, value in event.parameters.items():
        set_parameter(response.parameters[key], value)
    set_final(response, event.final)
    return service_pb2.ModelStreamInferResponse(infer_response=response)


def _shapes(response: service_pb2.ModelInferResponse) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
    return tuple((o.name, o.datatype, tuple(o.shape)) for o in response.outputs)


def _plain_message(event: StreamEvent,
                   last: tuple[service_pb2.ModelStreamInferResponse, tuple[tuple[str, str, tuple[int, ...]], ...]] | None,
                   ) -> service_pb2.ModelStreamInferResponse | None:
    """``event``'s message as a copy of the last plain one with its own contents; None if its outputs differ."""
    if last is None or len(event.outputs) != len(last[1]):
        return None
    encoded = [codec.encode(event.outputs[name]) for name, _, _ in last[1] if name in event.outputs]
    if len(encoded) != len(last[1]) or any((d, tuple(s)) != (kd, ks) for (d, s, _), (_, kd, ks) in zip(encoded, last[1])):
        return None
    message = service_pb2.ModelStreamInferResponse()
    message.CopyFrom(last[0])
    raws = message.infer_response.raw_output_contents
    for index, (_, _, raw) in enumerate(encoded):
        raws[index] = raw
    return message
