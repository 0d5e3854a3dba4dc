"""Worker-to-worker traffic of the collective protocol: the links this worker
sends on (one long-lived ``Exchange`` stream per peer, plus unary ``Run``
calls for pipeline hand-offs) and the mailbox that holds the parts peers sent
until the batch step that reads them.

Keys: a part is addressed by (group, epoch, batch, step, part, source
rank, target rank) -- one worker may hold two ranks of a group, and a ring
collective sends several parts per step. The
gateway gives every batch of a group its own id, so parts of concurrent
batches never mix; a part that arrives before its receiver reaches the step
(or before the gateway's call reaches this rank at all) waits in the mailbox.

Failure: a send on a broken stream raises ``PeerUnavailable`` at once (the
link is rebuilt on the next send); a stream from a peer that ends fails the
waits for that peer's parts; every wait has the batch's deadline. Whichever
comes first fails the rank's batch, and the gateway reruns it elsewhere.

Access: peers are called with this worker's own credentials -- the worker
token it requires of callers (a cluster shares one) and, with TLS, its
certificate as the client certificate and its client CA as the trust root.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import grpc

from protos.collective_pb2 import ExchangeResponse, PeerMessage, RunRequest, RunResponse, Tensor
from protos.collective_pb2_grpc import CollectiveStub
from protos.errors import DeadlineExceeded, Unavailable, from_grpc_code

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 2**31 - 1
# Batches remembered as finished, so late parts of a failed batch are dropped, not kept.
FINISHED_MEMORY = 4096

BatchKey = tuple[str, int, int]  # (group, epoch, batch)


class PeerUnavailable(Unavailable):
    """A peer of a group cannot be reached, or its stream ended mid-batch."""


@dataclass(frozen=True, slots=True)
class PeerAccess:
    """How this worker calls its peers: channel credentials and call metadata."""

    credentials: grpc.ChannelCredentials | None = None
    metadata: tuple[tuple[str, str], ...] = field(default=(), repr=False)


class Mailbox:
    """Parts received from peers, one future per (batch, step, part, source rank, target rank)."""

    def __init__(self) -> None:
        self._batches: dict[BatchKey, dict[tuple[int, int, int, int], asyncio.Future[Tensor]]] = {}
        self._finished: OrderedDict[tuple[str, int, int, int], None] = OrderedDict()
        self._gone: set[tuple[str, int, int]] = set()  # (group, epoch, rank) whose stream ended

    def _slot(self, key: BatchKey, step: int, part: int, source: int, target: int) -> asyncio.Future[Tensor]:
        slots = self._batches.setdefault(key, {})
        future = slots.get((step, part, source, target))
        if future is None:
            future = slots[(step, part, source, target)] = asyncio.get_running_loop().create_future()
        return future

    def deliver(self, message: PeerMessage) -> None:
        key = (message.group_id, message.epoch, message.batch_id)
        if key + (message.target_rank,) in self._finished:
            return
        future = self._slot(key, message.step, message.part, message.source_rank, message.target_rank)
        if not future.done():
            future.set_result(message.tensor)

    async def receive(self, key: BatchKey, step: int, part: int, source: int, target: int, timeout_s: float) -> Tensor:
        if (key[0], key[1], source) in self._gone:
            raise PeerUnavailable(f"group {key[0]}: rank {source} is gone")
        future = self._slot(key, step, part, source, target)
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout_s)
        except asyncio.TimeoutError:
            raise DeadlineExceeded(f"group {key[0]}: no part from rank {source} within the batch's deadline") from None

    def finish(self, key: BatchKey, target: int) -> None:
        """The batch is over on rank ``target``: drop its parts, and any that arrive later."""
        slots = self._batches.get(key, {})
        for slot in [s for s in slots if s[3] == target]:
            future = slots.pop(slot)
            if not future.done():
                future.cancel()
        if not slots:
            self._batches.pop(key, None)
        self._finished[key + (target,)] = None
        while len(self._finished) > FINISHED_MEMORY:
            self._finished.popitem(last=False)

    def source_gone(self, group: str, epoch: int, rank: int) -> None:
        """A peer's stream ended: its pending and future parts for this epoch will not come."""
        self._gone.add((group, epoch, rank))
        for (g, e, _), slots in self._batches.items():
            if (g, e) != (group, epoch):
                continue
            for (_, _, source, _), future in slots.items():
                if source == rank and not future.done():
                    future.set_exception(PeerUnavailable(f"group {group}: rank {rank}'s stream ended"))

    def drop_group(self, group: str) -> None:
        for key in [k for k in self._batches if k[0] == group]:
            for future in self._batches.pop(key).values():
                if not future.done():
                    future.cancel()
        self._gone = {g for g in self._gone if g[0] != group}


class _Link:
    """One peer: a channel, and an ``Exchange`` stream opened on first send."""

    def __init__(self, address: str, access: PeerAccess) -> None:
        options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000)]
        if access.credentials is None:
            self.channel = grpc.aio.insecure_channel(address, options=options)
        else:
            self.channel = grpc.aio.secure_channel(address, access.credentials, options=options)
        self.stub = CollectiveStub(self.channel)
        self.address = address
        self._metadata = access.metadata
        # With TLS a peer that refuses the handshake looks like a closed socket: say what it checks.
        self._hint = "" if access.credentials is None else (
            " (peers must accept this worker's certificate as a client certificate: signed by their"
            " --tls-client-ca, extended key usage clientAuth)")
        self._stream: grpc.aio.StreamUnaryCall[PeerMessage, ExchangeResponse] | None = None
        self._lock = asyncio.Lock()  # one write at a time on the stream

    async def send(self, message: PeerMessage) -> None:
        async with self._lock:
            if self._stream is None or self._stream.done():
                self._stream = self.stub.Exchange(metadata=self._metadata)
            try:
                await self._stream.write(message)
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as e:
                stream, self._stream = self._stream, None
                stream.cancel()
                raise PeerUnavailable(f"peer {self.address} unreachable: {_details(e)}{self._hint}") from None

    async def run(self, request: RunRequest, timeout_s: float) -> RunResponse:
        try:
            return await self.stub.Run(request, timeout=timeout_s, metadata=self._metadata)
        except grpc.aio.AioRpcError as e:
            if e.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                raise DeadlineExceeded(f"peer {self.address}: {e.details()}") from None
            if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN):
                raise PeerUnavailable(f"peer {self.address}: {e.details()}{self._hint}") from None
            raise _from_status(e) from None

    async def close(self) -> None:
        if self._stream is not None:
            self._stream.cancel()
        await self.channel.close()


def _details(e: BaseException) -> str:
    return (e.details() or e.code().name) if isinstance(e, grpc.aio.AioRpcError) else str(e) or type(e).__name__


def _from_status(e: grpc.aio.AioRpcError) -> Exception:
    return from_grpc_code(e.code(), e.details() or e.code().name)


class PeerLinks:
    """Every peer this worker talks to, by address (links outlive groups)."""

    def __init__(self, access: PeerAccess) -> None:
        self._access = access
        self._links: dict[str, _Link] = {}

    def _link(self, address: str) -> _Link:
        link = self._links.get(address)
        if link is None:
            link = self._links[address] = _Link(address, self._access)
        return link

    async def send(self, address: str, message: PeerMessage) -> None:
        await self._link(address).send(message)

    async def run(self, address: str, request: RunRequest, timeout_s: float) -> RunResponse:
        return await self._link(address).run(request, timeout_s)

    async def close(self) -> None:
        links, self._links = list(self._links.values()), {}
        await asyncio.gather(*(link.close() for link in links), return_exceptions=True)
