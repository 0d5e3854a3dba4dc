"""Tests for gateway/frontends/grpc_guard.py: bytes that are no protobuf message get
INVALID_ARGUMENT before any handler sees them, for every handler shape."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, NamedTuple

import grpc
import pytest
from tritonclient.grpc import service_pb2

from gateway.frontends.grpc_guard import MalformedRequestGuard


class CallDetails(NamedTuple):
    method: str
    invocation_metadata: tuple[tuple[str, str], ...]


class Aborted(Exception):
    pass


class FakeContext:
    def __init__(self) -> None:
        self.aborted: tuple[grpc.StatusCode, str] | None = None

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.aborted = (code, details)
        raise Aborted(details)


def decode(data: bytes) -> service_pb2.ModelInferRequest:
    return service_pb2.ModelInferRequest.FromString(data)


GOOD = service_pb2.ModelInferRequest(model_name="mlp").SerializeToString()
BAD = b"\x0a\x05ab"  # a length-delimited field cut short


async def guarded(handler: grpc.RpcMethodHandler, method: str = "/svc/M") -> grpc.RpcMethodHandler:
    async def continuation(details: Any) -> grpc.RpcMethodHandler:
        return handler

    details = CallDetails(method, ())
    wrapped = await MalformedRequestGuard().intercept_service(continuation, details)
    assert wrapped is not None
    return wrapped


async def test_unary_malformed_is_invalid_argument_and_good_passes() -> None:
    seen: list[str] = []

    async def behavior(request: service_pb2.ModelInferRequest, context: Any) -> str:
        seen.append(request.model_name)
        return "ok"

    handler = await guarded(grpc.unary_unary_rpc_method_handler(behavior, request_deserializer=decode))
    context = FakeContext()
    assert await handler.unary_unary(handler.request_deserializer(GOOD), context) == "ok"
    with pytest.raises(Aborted, match="not a valid protobuf message"):
        await handler.unary_unary(handler.request_deserializer(BAD), context)
    assert context.aborted is not None and context.aborted[0] is grpc.StatusCode.INVALID_ARGUMENT
    assert seen == ["mlp"]  # the handler never saw the malformed one


async def test_streams_end_at_the_malformed_message() -> None:
    async def echo(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[str]:
        async for request in requests:
            yield request.model_name

    async def writer(request: Any, context: Any) -> None:  # a coroutine-style streaming handler
        context.written = request.model_name

    stream = await guarded(grpc.stream_stream_rpc_method_handler(echo, request_deserializer=decode))

    async def messages() -> AsyncIterator[Any]:
        for raw in (GOOD, BAD, GOOD):
            yield stream.request_deserializer(raw)

    context = FakeContext()
    out: list[str] = []
    with pytest.raises(Aborted):
        async for item in stream.stream_stream(messages(), context):
            out.append(item)
    assert out == ["mlp"] and context.aborted is not None

    watch = await guarded(grpc.unary_stream_rpc_method_handler(writer, request_deserializer=decode))
    context = FakeContext()
    await watch.unary_stream(watch.request_deserializer(GOOD), context)
    assert context.written == "mlp"  # type: ignore[attr-defined]
    with pytest.raises(Aborted):
        await watch.unary_stream(watch.request_deserializer(BAD), context)
