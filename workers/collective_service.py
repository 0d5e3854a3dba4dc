"""The worker's ``Collective`` gRPC service (``protos/collective.proto``), on
the same server and port as its KServe service: group setup and teardown
from the gateway, one ``Run`` per rank per batch, and the ``Exchange``
streams its peers send parts on.

Like ``service``, this is an error edge: handlers raise ``InferGateError``
subclasses and the wrapper turns them into gRPC statuses. ``Run`` counts as
a request in progress, so a graceful stop lets running batches finish;
``Exchange`` streams are idle between batches and are cancelled at stop.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from protos.collective_pb2 import (
    ExchangeResponse,
    PeerMessage,
    RunRequest,
    RunResponse,
    SetupGroupRequest,
    SetupGroupResponse,
    TeardownGroupRequest,
    TeardownGroupResponse,
)
from protos.collective_pb2_grpc import CollectiveServicer
from workers.groups import Groups
from workers.peers import Mailbox
from workers.service import InferenceService, as_error

log = logging.getLogger(__name__)

_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")
_Handler = Callable[[Any, _Req, grpc.aio.ServicerContext], Awaitable[_Resp]]


def _rpc(handler: _Handler[_Req, _Resp]) -> _Handler[_Req, _Resp]:
    @functools.wraps(handler)
    async def wrapper(self: CollectiveService, request: _Req, context: grpc.aio.ServicerContext) -> _Resp:
        self._requests.begin_request()
        try:
            return await handler(self, request, context)
        except Exception as exc:
            error = as_error(exc, handler.__name__)
        finally:
            self._requests.end_request()
        await context.abort(error.grpc_code, error.message)
        raise AssertionError("unreachable: abort raises")

    return wrapper


class CollectiveService(CollectiveServicer):
    def __init__(self, groups: Groups, mailbox: Mailbox, requests: InferenceService) -> None:
        self._groups = groups
        self._mailbox = mailbox
        self._requests = requests  # shares the in-progress count that shutdown waits on

    @_rpc
    async def SetupGroup(self, request: SetupGroupRequest, context: Any) -> SetupGroupResponse:
        self._groups.setup(request)
        return SetupGroupResponse()

    @_rpc
    async def TeardownGroup(self, request: TeardownGroupRequest, context: Any) -> TeardownGroupResponse:
        return TeardownGroupResponse(known=self._groups.teardown(request.group_id, request.epoch))

    @_rpc
    async def Run(self, request: RunRequest, context: grpc.aio.ServicerContext) -> RunResponse:
        return await self._groups.run(request, context.time_remaining())

    async def Exchange(self, request_iterator: AsyncIterator[PeerMessage], context: grpc.aio.ServicerContext) -> ExchangeResponse:
        seen: set[tuple[str, int, int]] = set()
        try:
            async for message in request_iterator:
                seen.add((message.group_id, message.epoch, message.source_rank))
                self._mailbox.deliver(message)
        except grpc.aio.AioRpcError as e:
            log.info("peer stream from %s ended: %s", context.peer(), e.code().name)
        finally:
            # Whatever ended the stream, the parts it would have carried will not come.
            for group, epoch, rank in seen:
                self._mailbox.source_gone(group, epoch, rank)
        return ExchangeResponse()
