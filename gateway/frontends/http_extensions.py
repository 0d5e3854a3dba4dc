"""HTTP endpoints of Triton's shared-memory and logging extensions.

- ``GET /v2/systemsharedmemory[/region/{name}]/status``: the registered
  regions, ``[{"name", "key", "offset", "byte_size"}]``;
- ``POST /v2/systemsharedmemory/region/{name}/register`` with
  ``{"key", "offset", "byte_size"}`` (without ``/region/{name}``: refused,
  "'region name' is necessary ...", a check Triton makes over HTTP only);
- ``POST /v2/systemsharedmemory[/region/{name}]/unregister``;
- the same three under ``/v2/cudasharedmemory``, status
  ``[{"name", "device_id", "byte_size"}]``, register with
  ``{"raw_handle": {"b64": ...}, "device_id", "byte_size"}`` (refused with
  a clear message where this process has no usable GPU);
- ``GET|POST /v2/logging``: the log settings, and their update
  (``gateway.frontends.log_settings``);
- ``GET|POST /v2/trace/setting`` and ``/v2/models/{model}/trace/setting``:
  the global and per-model trace settings, and their update
  (``gateway.observability.trace_settings``).

The region registry and the log settings are shared with the gRPC frontend;
errors go through the application's one error middleware.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import orjson
from aiohttp import web

from gateway.frontends.http_codec import parse_json_object
from gateway.frontends.log_settings import LogSettings
from gateway.observability.trace_settings import TraceSettings, normalize_json
from gateway.requests.cuda_ipc import IPC_HANDLE_BYTES
from gateway.requests.shared_memory import CUDA_NAME_NECESSARY, SYSTEM_NAME_NECESSARY, SharedMemoryRegistry
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


def parse_cuda_register(doc: dict[str, Any]) -> tuple[bytes, int, int]:
    """(raw handle, device id, byte size) of a CUDA register request body, in Triton's words where it has them."""
    handle = doc.get("raw_handle")
    if not isinstance(handle, dict) or not isinstance(handle.get("b64"), str):
        raise InvalidArgument(
            "Shared memory register request needs 'raw_handle': {\"b64\": <base64 of the cudaIpcMemHandle_t>}"
        )
    device_id = _uint(doc, "device_id", required=True)
    byte_size = _uint(doc, "byte_size", required=True)
    try:
        raw = base64.b64decode(handle["b64"], validate=True)
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) != IPC_HANDLE_BYTES:
        raise InvalidArgument("'raw_handle' must be a valid base64 encoded cudaIpcMemHandle_t")
    return raw, device_id, byte_size


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
        name = request.match_info.get("name", "")
        if not name:  # Triton's HTTP frontend checks this before the body
            raise InvalidArgument(SYSTEM_NAME_NECESSARY)
        doc = parse_json_object(await request.read(), "shared memory register request")
        if "key" not in doc:
            raise InvalidArgument("Shared memory register request has no 'key' field")
        key = doc["key"]
        if not isinstance(key, str):
            raise InvalidArgument(f"Shared memory register request: 'key' must be a string, got {key!r}")
        offset = _uint(doc, "offset", required=False)
        byte_size = _uint(doc, "byte_size", required=True)
        await self._shm.apply_register(name, key, offset, byte_size)
        return web.Response(status=200)

    async def system_unregister(self, request: web.Request) -> web.Response:
        await self._shm.apply_unregister(request.match_info.get("name", ""))
        return web.Response(status=200)

    # -- CUDA shared memory (refused, status empty, where this process has no usable GPU)

    async def cuda_status(self, request: web.Request) -> web.Response:
        regions = self._shm.cuda_status(request.match_info.get("name", ""))
        return _json([{"name": r.name, "device_id": r.device_id, "byte_size": r.byte_size} for r in regions])

    async def cuda_register(self, request: web.Request) -> web.Response:
        name = request.match_info.get("name", "")
        if not name:  # Triton's HTTP frontend checks this first; its gRPC one leaves it to the manager
            raise InvalidArgument(CUDA_NAME_NECESSARY)
        self._shm.require_cuda(name)  # refused next, whatever the body, where there is no GPU
        doc = parse_json_object(await request.read(), "shared memory register request")
        raw_handle, device_id, byte_size = parse_cuda_register(doc)
        await self._shm.apply_register_cuda(name, raw_handle, device_id, byte_size)
        return web.Response(status=200)

    async def cuda_unregister(self, request: web.Request) -> web.Response:
        await self._shm.apply_unregister_cuda(request.match_info.get("name", ""))
        return web.Response(status=200)

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
        add.add_post(base + "/register", register)  # no region name: refused in Triton's words
        add.add_post(base + "/region/{name}/register", register)
        add.add_post(base + "/unregister", unregister)
        add.add_post(base + "/region/{name}/unregister", unregister)
    add.add_get("/v2/logging", ext.logging_get)
    add.add_post("/v2/logging", ext.logging_update)
    for path in ("/v2/trace/setting", "/v2/models/{model}/trace/setting"):
        add.add_get(path, ext.trace_get)
        add.add_post(path, ext.trace_update)
