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
  stream handler) reports it in-stream, and the request ends there.
- The caller's task cancelled (the stream call cancelled) closes the model's
  response iterator, which cancels the request (``LoadedModel.stream``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable

from tritonclient.grpc import service_pb2

from execution.model import LoadedModel
from execution.tensors import encode_response

FINAL_RESPONSE = "triton_final_response"
ENABLE_EMPTY_FINAL = "triton_enable_empty_final_response"

Write = Callable[[service_pb2.ModelStreamInferResponse], Awaitable[None]]


def wants_empty_final(request: service_pb2.ModelInferRequest) -> bool:
    param = request.parameters.get(ENABLE_EMPTY_FINAL)
    return param is not None and param.WhichOneof("parameter_choice") == "bool_param" and param.bool_param


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
    empty_final = wants_empty_final(request)
    sent = 0
    async with contextlib.aclosing(model.stream(request)) as events:
        async for event in events:
            if not event.outputs and not event.parameters and event.final and not empty_final:
                continue
            response = encode_response(request, model.version_str, event.outputs, list(event.outputs))
            for key, value in event.parameters.items():
                set_parameter(response.parameters[key], value)
            response.parameters[FINAL_RESPONSE].bool_param = event.final
            await write(service_pb2.ModelStreamInferResponse(infer_response=response))
            sent += 1
    return sent
