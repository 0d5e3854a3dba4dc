"""Triton's words for streamed responses, written once: the parameter names a
decoupled model's stream speaks in, and the helpers that read and set them.

- ``triton_final_response`` (:data:`FINAL_RESPONSE`): a bool parameter on a
  streamed response, true on the request's last one (which may carry no
  outputs: an "empty final response");
- ``triton_enable_empty_final_response`` (:data:`ENABLE_EMPTY_FINAL`): a bool
  parameter on a streamed request, asking for that empty final response, so
  that the end of every stream is marked even when the model's last response
  had outputs.

Every package that writes or reads these (the servers in ``execution``, the
gateway's frontends and replicas, the load tester, the benchmarks) takes
them from here.
"""

from __future__ import annotations

from tritonclient.grpc import service_pb2

FINAL_RESPONSE = "triton_final_response"
ENABLE_EMPTY_FINAL = "triton_enable_empty_final_response"


def is_final(response: service_pb2.ModelInferResponse) -> bool:
    """Whether ``response`` is its request's last (a parameter set as anything but a bool reads False)."""
    param = response.parameters.get(FINAL_RESPONSE)
    return param is not None and param.WhichOneof("parameter_choice") == "bool_param" and param.bool_param


def set_final(response: service_pb2.ModelInferResponse, final: bool) -> None:
    """Mark ``response`` as its request's last (``final``) or not."""
    response.parameters[FINAL_RESPONSE].bool_param = final


def asks_empty_final(request: service_pb2.ModelInferRequest) -> bool:
    """Whether ``request`` asked for an empty final response (set as a bool, true)."""
    param = request.parameters.get(ENABLE_EMPTY_FINAL)
    return param is not None and param.WhichOneof("parameter_choice") == "bool_param" and param.bool_param


def ask_empty_final(request: service_pb2.ModelInferRequest) -> None:
    """Ask for the empty final response on ``request``, so its stream's end is always marked."""
    request.parameters[ENABLE_EMPTY_FINAL].bool_param = True
