"""The gRPC frontend's one error edge: our errors become gRPC statuses here.

Owns how a failed RPC ends: an ``InferGateError`` aborts with its gRPC code,
its message and its retry hint; anything unexpected becomes an ``Internal``
naming its cause, logged with its traceback; a cancel of the RPC itself
passes through. Unary handlers wear :func:`unary_edge`; the inference
stream answers a failed request in-stream with :func:`stream_error`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn, TypeVar

import grpc
from tritonclient.grpc import service_pb2

from protos.errors import Cancelled, InferGateError, Internal, retry_metadata

_log = logging.getLogger(__name__)

_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")


def as_error(exc: Exception, request_id: str = "") -> InferGateError:
    """Our error for ``exc``; anything unexpected becomes an Internal naming its cause, logged with its traceback."""
    if isinstance(exc, InferGateError):
        return exc
    _log.error("unexpected error in gRPC request id=%r", request_id, exc_info=exc)
    return Internal.caused_by("in the gateway", exc, request_id)


async def abort(context: grpc.aio.ServicerContext, exc: Exception, request_id: str = "") -> NoReturn:
    """End the RPC with the status of ``exc`` (raises, as ``context.abort`` does)."""
    err = as_error(exc, request_id)
    # A refusal (a full queue, a spent quota) carries its retry hint, as HTTP's Retry-After.
    await context.abort(err.grpc_code, err.message, trailing_metadata=retry_metadata(err))
    raise AssertionError("unreachable: context.abort returned")  # pragma: no cover


def rpc_cancelled(context: grpc.aio.ServicerContext) -> bool:
    """Whether the RPC's own task is being cancelled, rather than something it awaited."""
    task = asyncio.current_task()
    return bool(task.cancelling()) if task is not None else context.done()


def unary_edge(
    method: Callable[[Any, _Req, grpc.aio.ServicerContext], Awaitable[_Resp]],
) -> Callable[[Any, _Req, grpc.aio.ServicerContext], Awaitable[_Resp]]:
    """Route every exception of a unary handler through :func:`abort`.

    A cancel of the RPC itself (client cancel, deadline, server stop) passes
    through untouched. A CancelledError raised from below while the RPC goes
    on (a future the core awaited was cancelled) must still answer: grpc.aio
    would otherwise leave the client waiting for its deadline.
    """

    @functools.wraps(method)
    async def handler(self: Any, request: _Req, context: grpc.aio.ServicerContext) -> _Resp:
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except asyncio.CancelledError:
            if rpc_cancelled(context):
                raise
            await abort(context, Cancelled("the request was cancelled"), getattr(request, "id", ""))
        except Exception as exc:  # the error-mapping edge
            await abort(context, exc, getattr(request, "id", ""))

    return handler


def stream_error(pb: service_pb2.ModelInferRequest, err: InferGateError) -> service_pb2.ModelStreamInferResponse:
    # The id rides along so raw-stub clients can match the error to its request.
    echo = service_pb2.ModelInferResponse(model_name=pb.model_name, model_version=pb.model_version, id=pb.id)
    return service_pb2.ModelStreamInferResponse(error_message=err.message, infer_response=echo)
