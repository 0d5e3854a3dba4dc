"""Many streamed requests on one ``ModelStreamInfer`` call between a gateway and its worker,
their responses packed several to a message.

A gateway in front of an infergate worker carries the streamed requests of
decoupled models (a generation's every token) on one long-lived call per
worker rather than one call per request. It opens that call with the
metadata ``infergate-pack: 1``; on such a call, and only there, the worker:

- may send several responses as one message (:func:`pack`): an
  ``infer_response`` with the parameter ``infergate_packed`` whose
  ``raw_output_contents`` are the serialized ``ModelStreamInferResponse``s,
  in order. A generation batch's decode step answers all its sequences at
  once: on this call that is one gRPC message a step, not one per token;
- takes each request's key on the call from its parameter
  ``infergate_stream_key`` (:func:`with_key`, :func:`take_key`), removed
  before the model sees the request, which keeps the client's own ``id``;
  every response of the request carries the key as its ``id``, and the
  gateway gives it back its client's;
- cancels a running request when a message names its key
  (:func:`cancel_request`: no inputs, the key, the parameter
  ``infergate_cancel``), as cancelling a call of its own would.

Every other call (a Triton client's, the gateway's own to a Triton server)
sees the KServe protocol unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

from tritonclient.grpc import service_pb2

PACK_METADATA = "infergate-pack"
PACKED = "infergate_packed"
CANCEL = "infergate_cancel"
KEY = "infergate_stream_key"


def asks_packing(metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
    """Whether a call's invocation metadata asks for the packed, cancellable stream."""
    return any(key == PACK_METADATA and value in ("1", b"1") for key, value in metadata or ())


def pack(serialized: Sequence[bytes]) -> service_pb2.ModelStreamInferResponse:
    """One message carrying ``serialized`` (each a serialized ``ModelStreamInferResponse``), in order."""
    message = service_pb2.ModelStreamInferResponse()
    response = message.infer_response
    response.parameters[PACKED].bool_param = True
    response.raw_output_contents.extend(serialized)
    return message


def unpack(message: service_pb2.ModelStreamInferResponse) -> list[service_pb2.ModelStreamInferResponse]:
    """The responses a message carries: those it packs, or itself."""
    response = message.infer_response
    param = response.parameters.get(PACKED)
    if param is None or not param.bool_param:
        return [message]
    parse = service_pb2.ModelStreamInferResponse.FromString
    return [parse(raw) for raw in response.raw_output_contents]


def with_key(request: service_pb2.ModelInferRequest, key: str) -> service_pb2.ModelInferRequest:
    """A copy of ``request`` to send under ``key`` on a packed call; ``request`` is left as it was."""
    message = service_pb2.ModelInferRequest()
    message.CopyFrom(request)
    message.parameters[KEY].string_param = key
    return message


def take_key(request: service_pb2.ModelInferRequest) -> str:
    """The request's key on a packed call, removed from its parameters (its id when it has none)."""
    param = request.parameters.get(KEY)
    if param is None:
        return request.id
    key = param.string_param
    del request.parameters[KEY]
    return key


def cancel_request(key: str) -> service_pb2.ModelInferRequest:
    """The message that cancels the running request ``key`` of a packed call."""
    request = service_pb2.ModelInferRequest(id=key)
    request.parameters[CANCEL].bool_param = True
    return request


def cancels(request: service_pb2.ModelInferRequest) -> bool:
    param = request.parameters.get(CANCEL)
    return param is not None and param.bool_param
