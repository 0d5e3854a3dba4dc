"""Self-registering workers with several gateway processes: every process knows them.

A worker started with ``--gateway`` keeps one channel to the gateway's gRPC
port, so its Register, Heartbeats and Deregister land on whichever process
that connection reached (another one after a reconnect). That process
answers as a single gateway does (``gateway.fleet.registry``; the worker
token is checked there) and, before answering, makes the same call in every
other process (``PEER_PREFIX/registry/<call>``, the request's bytes):

- Register: when it returns, every process has the worker in its cluster,
  probed, so a request landing on any process can use it; a process that
  did not take it fails the registration, and the worker registers again;
- Heartbeat: keeps the worker's report fresh in every process's registry;
  when some process does not know the worker, the answer is ``known:
  false``, so the worker registers again, with every process;
- Deregister: takes the worker out of every process.

Whether a worker's heartbeats stopped is decided once, by the process they
reach, and passed on as a deregistration. The others hold a relayed
worker for several windows more (``gateway.fleet.registry.RELAYED_WINDOWS``)
before they drop it on their own: judged each on its own clock, a relayed
heartbeat late by a fraction of a second on a loaded machine (0.6 s windows
in the tests) dropped the worker from one process while another still
served it -- "unknown model" there right after "ready" here, until the
worker registered again.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import grpc
from aiohttp import web
from google.protobuf.message import Message

from gateway.fleet.registry import Registry, RegistryService
from gateway.multiproc.peers import ProcessGroup
from protos import cluster_pb2, cluster_pb2_grpc
from protos.errors import Unavailable

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.Response]]


class GroupRegistryService(RegistryService):
    """The registration service of one process among several: each call made in every process."""

    def __init__(self, registry: Registry, group: ProcessGroup) -> None:
        super().__init__(registry)
        self._group = group
        registry.on_expired = self._expired

    async def _expired(self, address: str, worker_id: str) -> None:
        """This process dropped a worker whose heartbeats stopped: so do the others."""
        try:
            await self._in_the_others("deregister", cluster_pb2.DeregisterRequest(address=address, worker_id=worker_id))
        except Unavailable as e:  # they drop it on their own, later
            log.warning("expiry of worker %s not passed on: %s", address, e)

    async def _in_the_others(self, call: str, request: Message) -> list[bytes]:
        return await self._group.gather("POST", f"registry/{call}", body=request.SerializeToString())

    async def Register(self, request: cluster_pb2.RegisterRequest, context: grpc.aio.ServicerContext
                       ) -> cluster_pb2.RegisterResponse:
        async def call() -> cluster_pb2.RegisterResponse:
            response = await self._registry.register(request)
            await self._in_the_others("register", request)
            return response

        return await self._guard(context, call)

    async def Heartbeat(self, request: cluster_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
                        ) -> cluster_pb2.HeartbeatResponse:
        async def call() -> cluster_pb2.HeartbeatResponse:
            response = self._registry.heartbeat(request)
            if not response.known:
                return response  # the worker registers again, with every process
            try:
                answers = await self._in_the_others("heartbeat", request)
            except Unavailable as e:  # that process's copy ages; the next heartbeat tries again
                log.warning("heartbeat of worker %s not passed on: %s", request.address, e)
                return response
            if not all(cluster_pb2.HeartbeatResponse.FromString(a).known for a in answers):
                response.known = False
            return response

        return await self._guard(context, call)

    async def Deregister(self, request: cluster_pb2.DeregisterRequest, context: grpc.aio.ServicerContext
                         ) -> cluster_pb2.DeregisterResponse:
        async def call() -> cluster_pb2.DeregisterResponse:
            response = await self._registry.deregister(request)
            answers = await self._in_the_others("deregister", request)
            known = response.known or any(cluster_pb2.DeregisterResponse.FromString(a).known for a in answers)
            return cluster_pb2.DeregisterResponse(known=known)

        return await self._guard(context, call)


def add_group_registry_service(server: grpc.aio.Server, registry: Registry, group: ProcessGroup) -> None:
    cluster_pb2_grpc.add_ClusterMembershipServicer_to_server(GroupRegistryService(registry, group), server)


def registry_routes(registry: Registry) -> list[tuple[str, str, Handler]]:
    """The internal routes: another process's registration call, made in this one."""

    async def register(r: web.Request) -> web.Response:
        response = await registry.register(cluster_pb2.RegisterRequest.FromString(await r.read()), relayed=True)
        return web.Response(body=response.SerializeToString())

    async def heartbeat(r: web.Request) -> web.Response:
        response = registry.heartbeat(cluster_pb2.HeartbeatRequest.FromString(await r.read()), relayed=True)
        return web.Response(body=response.SerializeToString())

    async def deregister(r: web.Request) -> web.Response:
        response = await registry.deregister(cluster_pb2.DeregisterRequest.FromString(await r.read()))
        return web.Response(body=response.SerializeToString())

    return [("POST", "registry/register", register), ("POST", "registry/heartbeat", heartbeat),
            ("POST", "registry/deregister", deregister)]
