"""The standard gRPC health service (``grpc.health.v1``) of the gateway's gRPC
port, with a synchronous ``set`` for the application's start and stop.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


class HealthServicer(health_pb2_grpc.HealthServicer):
    """The health status of each service name, with a synchronous ``set``.

    Runs on the server's event loop only. Invariant for Watch: a watcher takes
    the current ``_changed`` event *before* reading the status, and ``set``
    swaps in a fresh event before firing the old one, so no change between a
    read and the wait is missed.
    """

    def __init__(self, services: tuple[str, ...], status: int) -> None:
        self._status = dict.fromkeys(services, status)
        self._changed = asyncio.Event()

    def set(self, service: str, status: int) -> None:
        self._status[service] = status
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def Check(self, request: health_pb2.HealthCheckRequest, context: Any) -> health_pb2.HealthCheckResponse:
        status = self._status.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service '{request.service}'")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: Any) -> None:
        last = None
        while True:
            changed = self._changed
            status = self._status.get(request.service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
            if status != last:
                await context.write(health_pb2.HealthCheckResponse(status=status))
                last = status
            await changed.wait()
