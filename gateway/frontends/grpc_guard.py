"""Undecodable gRPC request messages get INVALID_ARGUMENT, like any other bad input.

grpcio decodes a request before any handler code runs; bytes that are not a
valid protobuf message (corrupt wire format, a string field that is not
UTF-8) make it answer UNKNOWN with the parser's exception text. This
interceptor swaps each method's request decoder for one that keeps a decode
failure as a value, and answers it with INVALID_ARGUMENT before the
handler (or any other interceptor) sees it. In a stream, a malformed message
ends the stream with that status.

Install it first in the server's interceptor list, so it wraps the others.
A wrapper is reused while the inner handler of its method stays the same
object; interceptors that build a handler per call (carrying that call's
credentials) get a fresh wrapper each time, never another call's.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

log = logging.getLogger(__name__)


class _Malformed:
    """What the decoder returns for bytes that are no valid message."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _message(malformed: _Malformed) -> str:
    return f"the request is not a valid protobuf message: {malformed.reason}"


class MalformedRequestGuard(grpc.aio.ServerInterceptor):
    def __init__(self) -> None:
        # method -> (the inner handler, its wrapper)
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        cached = self._wrapped.get(details.method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = _guard(handler)
        self._wrapped[details.method] = (handler, wrapped)
        return wrapped


def _guard(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    decode = handler.request_deserializer

    def safe_decode(data: bytes) -> Any:
        try:
            return decode(data)
        except (DecodeError, UnicodeDecodeError, ValueError) as e:
            return _Malformed(str(e) or type(e).__name__)

    changes: dict[str, Any] = {"request_deserializer": safe_decode}
    if handler.unary_unary is not None:
        changes["unary_unary"] = _unary(handler.unary_unary)
    elif handler.unary_stream is not None:
        changes["unary_stream"] = _unary_stream(handler.unary_stream)
    elif handler.stream_unary is not None:
        changes["stream_unary"] = _stream_unary(handler.stream_unary)
    elif handler.stream_stream is not None:
        changes["stream_stream"] = _stream_stream(handler.stream_stream)
    return handler._replace(**changes)


async def _refuse(context: grpc.aio.ServicerContext, malformed: _Malformed) -> None:
    log.debug("refused a malformed gRPC request: %s", malformed.reason)
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _message(malformed))


def _checked(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
    async def messages() -> AsyncIterator[Any]:
        async for request in requests:
            if isinstance(request, _Malformed):
                await _refuse(context, request)
            yield request

    return messages()


def _unary(inner: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    # Per call, only the isinstance test: whether ``inner`` is a coroutine
    # function is decided once, here, not by inspecting each result.
    if inspect.iscoroutinefunction(inner):
        async def coroutine(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Malformed):
                await _refuse(context, request)
            return await inner(request, context)

        return coroutine

    async def behavior(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Malformed):
            await _refuse(context, request)
        result = inner(request, context)
        return await result if inspect.isawaitable(result) else result

    return behavior


def _unary_stream(inner: Callable[..., Any]) -> Callable[..., Any]:
    # A streaming handler is either an async generator or a coroutine that
    # writes through the context (the health Watch); the wrapper keeps its shape.
    if not inspect.isasyncgenfunction(inner):
        async def writer(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Malformed):
                await _refuse(context, request)
            return await inner(request, context)

        return writer

    async def generator(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if isinstance(request, _Malformed):
            await _refuse(context, request)
        async for response in inner(request, context):
            yield response

    return generator


def _stream_unary(inner: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def behavior(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
        return await inner(_checked(requests, context), context)

    return behavior


def _stream_stream(inner: Callable[..., Any]) -> Callable[..., Any]:
    if not inspect.isasyncgenfunction(inner):
        async def writer(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
            return await inner(_checked(requests, context), context)

        return writer

    async def generator(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async for response in inner(_checked(requests, context), context):
            yield response

    return generator
