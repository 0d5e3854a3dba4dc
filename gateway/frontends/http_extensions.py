"""HTTP endpoints of Triton's shared-memory and logging extensions.

- ``GET /v2/systemsharedmemory[/region/{name}]/status``: the registered
  regions, ``[{"name", "key", "offset", "byte_size"}]``;
- ``POST /v2/systemsharedmemory/region/{name}/register`` with
  ``{"key", "offset", "byte_size"}``;
- ``POST /v2/systemsharedmemory[/region/{name}]/unregister``;
- the same three under ``/v2/cudasharedmemory`` (no region can be
  registered: this server has no GPU to share; the status lists none);
- ``GET|POST /v2/logging``: the log settings, and their update
  (``gateway.frontends.log_settings``);
- ``GET|POST /v2/trace/setting`` and ``/v2/models/{model}/trace/setting``:
  the global and per-model trace settings, and their update
  (``gateway.observability.trace_settings``).

The region registry and the log settings are shared with the gRPC frontend;
errors go through the application's one error middleware.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from gateway.frontends.http_codec import parse_json_object
from gateway.frontends.log_settings import LogSettings
from gateway.frontends.shared_memory import SharedMemoryRegistry, cuda_register_error, cuda_status_error
from gateway.observability.trace_settings import TraceSettings, normalize_json
from protos.errors import InvalidArgument

_SYSTEM = "/v2/systemsharedmemory"
_CUDA = "/v2/cudasharedmemory"


def _json(value: Any) -> web.Response:
    return web.Response(body=orjson.dumps(value), content_type="application/json")


def _uint(doc: dict[str, Any], key: str, *, required: bool) -> int:
    if key not in doc:
        if required:
            raise InvalidArgument(f"Shared memory register request has no '{key}' field")
        return 0
    value = doc[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgument(f"Shared memory register request: '{key}' must be a non-negative integer, got {value!r}")
    return value


class _Extensions:
    def __init__(self, shm: SharedMemoryRegistry, logs: LogSettings, traces: TraceSettings) -> None:
        self._shm = shm
        self._logs = logs
        self._traces = traces

    # -- system shared memory

    async def system_status(self, request: web.Request) -> web.Response:
        regions = self._shm.status(request.match_info.get("name", ""))
        return _json([{"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size} for r in regions])

    async def system_register(self, request: web.Request) -> web.Response:
        doc = parse_json_object(await request.read(), "shared memory register request")
        if "key" not in doc:
            raise InvalidArgument("Shared memory register request has no 'key' field")
        key = doc["key"]
        if not isinstance(key, str):
            raise InvalidArgument(f"Shared memory register request: 'key' must be a string, got {key!r}")
        offset = _uint(doc, "offset", required=False)
        byte_size = _uint(doc, "byte_size", required=True)
        await self._shm.apply_register(request.match_info["name"], key, offset, byte_size)
        return web.Response(status=200)

    async def system_unregister(self, request: web.Request) -> web.Response:
        await self._shm.apply_unregister(request.match_info.get("name", ""))
        return web.Response(status=200)

    # -- CUDA shared memory: nothing to register on this server

    async def cuda_status(self, request: web.Request) -> web.Response:
        name = request.match_info.get("name", "")
        if name:
            raise cuda_status_error(name)
        return _json([])

    async def cuda_register(self, request: web.Request) -> web.Response:
        raise cuda_register_error(request.match_info.get("name", ""))

    async def cuda_unregister(self, request: web.Request) -> web.Response:
        return web.Response(status=200)  # nothing is registered; Triton answers success for unknown names

    # -- logging

    async def logging_get(self, request: web.Request) -> web.Response:
        return _json(self._logs.current())

    async def logging_update(self, request: web.Request) -> web.Response:
        doc = parse_json_object(await request.read(), "log settings request")
        return _json(await self._logs.apply(doc))

    # -- trace settings (global, or the model's)

    async def trace_get(self, request: web.Request) -> web.Response:
        return _json(self._traces.current(request.match_info.get("model", "")))

    async def trace_update(self, request: web.Request) -> web.Response:
        doc = parse_json_object(await request.read(), "trace setting request")
        return _json(await self._traces.apply(request.match_info.get("model", ""), normalize_json(doc)))


def add_extension_routes(
    app: web.Application, shm: SharedMemoryRegistry, logs: LogSettings, traces: TraceSettings
) -> None:
    ext = _Extensions(shm, logs, traces)
    add = app.router
    for base, status, register, unregister in (
        (_SYSTEM, ext.system_status, ext.system_register, ext.system_unregister),
        (_CUDA, ext.cuda_status, ext.cuda_register, ext.cuda_unregister),
    ):
        add.add_get(base + "/status", status)
        add.add_get(base + "/region/{name}/status", status)
        add.add_post(base + "/region/{name}/register", register)
        add.add_post(base + "/unregister", unregister)
        add.add_post(base + "/region/{name}/unregister", unregister)
    add.add_get("/v2/logging", ext.logging_get)
    add.add_post("/v2/logging", ext.logging_update)
    for path in ("/v2/trace/setting", "/v2/models/{model}/trace/setting"):
        add.add_get(path, ext.trace_get)
        add.add_post(path, ext.trace_update)
