"""The HTTP/REST frontend: the KServe v2 REST API with Triton's extensions.

Owns the aiohttp application (routes, the one error middleware, bounded
request reading, response compression) and turns each endpoint into calls on
an ``InferenceCore``. The JSON bodies of the management endpoints
(metadata, config, statistics, repository) in Triton's shape live in
``gateway.frontends.http_json``; the inference body format in
``gateway.frontends.http_codec``; compressed bodies in
``gateway.frontends.http_compression``.

Endpoints: ``/v2/health/live|ready``, ``/v2``, ``/v2/models/stats``,
``/v2/models/{m}[/versions/{v}]`` with ``/ready``, ``/config``, ``/stats``,
``/infer`` (JSON, binary tensor data, or a raw binary body with
``Inference-Header-Content-Length: 0``), Triton's generate extension
``/generate`` and ``/generate_stream`` (``gateway.frontends.http_generate``), and ``/v2/repository/index``,
``/v2/repository/models/{m}/load|unload``, and the shared-memory and logging extensions
endpoints (``gateway.frontends.http_extensions``); and the OpenAI-compatible API
under ``/v1/`` (``gateway.frontends.openai_api``). The statistics endpoints take
``?workers=true`` to add a ``workers`` section: each worker's own statistics
(Triton's or our worker's) beside the gateway's; without it the body is
exactly Triton's.

Request bodies are read whole (at most ``max_request_bytes``, 413 beyond)
and gzip/deflate bodies inflated here, with the same bound on the result;
the app turns aiohttp's own request decompression off.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import Any

import orjson
from aiohttp import hdrs, web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_response import ContentCoding

from gateway.frontends.http_codec import EncodedInfer, decode_infer_request, encode_infer_response, parse_json_object
from gateway.frontends.http_compression import choose_encoding, inflate_bounded
from gateway.frontends.http_errors import error_response
from gateway.frontends.http_extensions import add_extension_routes
from gateway.frontends.http_generate import GenerateApi
from gateway.frontends.http_json import (
    bool_field,
    index_ready,
    load_parameters,
    message_to_json,
    repository_index_to_json,
    worker_statistics_json,
)
from gateway.frontends.http_parse_errors import SERVER_LOG
from gateway.frontends.openai_api import add_openai_routes
from gateway.frontends.openai_errors import OPENAI_PREFIX, guard
from gateway.frontends.log_settings import LogSettings
from gateway.frontends.raw_binary import decode_raw_request
from gateway.limits import TIMEOUT_HEADER, apply_timeout_header
from gateway.observability.tracing import RequestTracing
from gateway.requests.shared_memory import SharedMemoryRegistry, advertise
from gateway.types import InferenceCore
from protos.errors import InferGateError, Internal, InvalidArgument, PayloadTooLarge, Unavailable, Unsupported

log = logging.getLogger(__name__)

INFER_HEADER = "Inference-Header-Content-Length"
# Compressed bodies above this are inflated on a thread, off the event loop.
_INFLATE_IN_THREAD_BYTES = 1 << 20
# Responses above this are written part by part rather than joined into one buffer.
_STREAM_RESPONSE_BYTES = 1 << 20
# Responses below this go uncompressed whatever the client accepts: aiohttp's client
# asks for gzip on every request, and deflating a few hundred bytes costs more
# (a compressor per response) than it saves on the wire.
_COMPRESS_MIN_BYTES = 512
# The id of the inference being served, for error logs. aiohttp serves each
# request in its own task, so the middleware reads what the handler set.
_request_id: ContextVar[str] = ContextVar("infergate_http_request_id", default="")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def create_http_app(
    core: InferenceCore,
    *,
    max_request_bytes: int = 256 * 2**20,
    shm: SharedMemoryRegistry | None = None,
    logs: LogSettings | None = None,
    tracing: RequestTracing | None = None,
) -> web.Application:
    """The REST application serving ``core``; run it with AppRunner/TCPSite.

    ``max_request_bytes`` bounds a request body after decompression. ``shm``
    is the shared-memory region registry and ``logs`` the log settings, both
    shared with the gRPC frontend (fresh ones when not given), as is
    ``tracing`` (the core's request tracing; off when not given). Routes
    added to the returned app later (metrics, dashboard) share its error
    middleware.
    """
    if max_request_bytes <= 0:
        raise ValueError(f"max_request_bytes must be positive, got {max_request_bytes}")
    shm = shm if shm is not None else SharedMemoryRegistry()
    tracing = tracing if tracing is not None else RequestTracing.off()
    api = _HttpApi(core, max_request_bytes, shm, tracing)
    generate = GenerateApi(core, api._read_body, tracing, _request_id.set)
    app = web.Application(
        middlewares=[error_middleware],
        client_max_size=max_request_bytes,
        handler_args={
            # Compressed bodies are inflated here, bounded, not by aiohttp's parser:
            # a truncated deflate body there leaves the handler waiting forever.
            "auto_decompress": False,
            # A client that hangs up cancels its request, so the batcher drops
            # it instead of running it for nobody.
            "handler_cancellation": True,
            # A request the parser refuses is logged in one line, without a traceback.
            "logger": SERVER_LOG,
        },
    )
    add = app.router
    add.add_get("/v2/health/live", api.live)
    add.add_get("/v2/health/ready", api.ready)
    add.add_get("/v2", api.server_metadata)
    add.add_get("/v2/", api.server_metadata)
    add.add_get("/v2/models/stats", api.statistics)
    add.add_post("/v2/repository/index", api.repository_index)
    add.add_post("/v2/repository/models/{model}/load", api.load)
    add.add_post("/v2/repository/models/{model}/unload", api.unload)
    for base in ("/v2/models/{model}", "/v2/models/{model}/versions/{version:[0-9]+}"):
        add.add_get(base, api.model_metadata)
        add.add_get(base + "/ready", api.model_ready)
        add.add_get(base + "/config", api.model_config)
        add.add_get(base + "/stats", api.statistics)
        add.add_post(base + "/infer", api.infer)
        add.add_post(base + "/generate", generate.generate)
        add.add_post(base + "/generate_stream", generate.generate_stream)
    add_extension_routes(app, shm, logs if logs is not None else LogSettings(), tracing.settings)
    add_openai_routes(app, core, api._read_body)
    return app


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The one place raised errors become responses (``gateway.frontends.http_errors``;
    under ``/v1/`` in OpenAI's shape, ``gateway.frontends.openai_errors``)."""
    if request.path.startswith(OPENAI_PREFIX):
        return await guard(request, handler)
    try:
        return await handler(request)
    except InferGateError as exc:
        # Expected outcomes (bad input, overload, deadlines) are the client's to
        # see, and would flood the log under load; Internal ones are ours.
        level = logging.WARNING if isinstance(exc, Internal) else logging.DEBUG
        log.log(level, "%s %s (request id %r) failed with %d: %s", request.method, request.path,
                _request_id.get(), exc.http_status, exc.message)
        retry_after = getattr(exc, "retry_after_s", None)
        return error_response(exc.http_status, exc.message, retry_after_s=retry_after)
    except web.HTTPException as exc:
        # aiohttp's own: no matching route (404), wrong method (405), body too large (413).
        if exc.status < 400:
            raise
        if exc.status == 404:
            message = f"no such endpoint: {request.method} {request.path}"
        elif exc.status == 405:
            message = f"method {request.method} is not allowed on {request.path}"
        else:
            message = exc.reason
        response = error_response(exc.status, message)
        if hdrs.ALLOW in exc.headers:
            response.headers[hdrs.ALLOW] = exc.headers[hdrs.ALLOW]
        return response
    except Exception as exc:  # the error edge: anything else is our bug, never the client's business
        log.exception("unexpected error serving %s %s (request id %r)", request.method, request.path,
                      _request_id.get())
        return error_response(500, Internal.caused_by(f"serving {request.path}", exc, _request_id.get()).message)


def _json(value: Any) -> web.Response:
    return web.Response(body=orjson.dumps(value), content_type="application/json")


class _HttpApi:
    """The endpoint handlers, bound to one core."""

    def __init__(self, core: InferenceCore, max_request_bytes: int, shm: SharedMemoryRegistry,
                 tracing: RequestTracing) -> None:
        self._core = core
        self._tracing = tracing
        self._max_request_bytes = max_request_bytes
        self._shm = shm

    # --- health and metadata ---------------------------------------------

    async def live(self, request: web.Request) -> web.Response:
        if not self._core.server_live():
            raise Unavailable("server is not live")
        return _json({"live": True})

    async def ready(self, request: web.Request) -> web.Response:
        if not self._core.server_ready():
            raise Unavailable("server is not ready")
        return _json({"ready": True})

    async def server_metadata(self, request: web.Request) -> web.Response:
        return _json(message_to_json(advertise(self._core.server_metadata(), self._shm)))

    async def model_metadata(self, request: web.Request) -> web.Response:
        name, version = _model_path(request)
        return _json(message_to_json(self._core.model_metadata(name, version)))

    async def model_ready(self, request: web.Request) -> web.Response:
        name, version = _model_path(request)
        if not self._core.model_ready(name, version):
            # Triton answers 400 for a model (version) that is not ready.
            shown = f"'{name}' version {version}" if version else f"'{name}'"
            raise InvalidArgument(f"model {shown} is not ready")
        return web.Response(status=200)

    async def model_config(self, request: web.Request) -> web.Response:
        name, version = _model_path(request)
        return _json(message_to_json(self._core.model_config(name, version)))

    async def statistics(self, request: web.Request) -> web.Response:
        name, version = _model_path(request)
        stats = await self._core.model_statistics(name, version)
        body = message_to_json(stats, include_unset_messages=True)
        if _query_flag(request, "workers"):
            # An extension of the core beyond InferenceCore: fake cores may lack it.
            read = getattr(self._core, "worker_statistics", None)
            if read is None:
                raise Unsupported("this server has no per-worker statistics")
            body["workers"] = [worker_statistics_json(w) for w in await read(name, version)]
        return _json(body)

    # --- repository --------------------------------------------------------

    async def repository_index(self, request: web.Request) -> web.Response:
        ready_only = index_ready(await self._read_body(request))
        return _json(repository_index_to_json(await self._core.repository_index(ready_only)))

    async def load(self, request: web.Request) -> web.Response:
        doc = parse_json_object(await self._read_body(request), "load request")
        await self._core.load_model(request.match_info["model"], load_parameters(doc))
        return web.Response(status=200)

    async def unload(self, request: web.Request) -> web.Response:
        doc = parse_json_object(await self._read_body(request), "unload request")
        params = doc.get("parameters", {})
        if not isinstance(params, dict):
            raise InvalidArgument("unload request: 'parameters' must be an object")
        dependents = bool_field(params, "unload_dependents", "unload request")
        await self._core.unload_model(request.match_info["model"], unload_dependents=dependents)
        return web.Response(status=200)

    # --- inference ---------------------------------------------------------

    async def infer(self, request: web.Request) -> web.StreamResponse:
        name, version = _model_path(request)
        header_length = _header_length(request)
        now = asyncio.get_running_loop().time()  # the request's `timeout` counts from here
        body = await self._read_body(request)
        if header_length == 0:
            # Triton's raw binary request: the body is the one input's data.
            decoded = decode_raw_request(
                body,
                model=name,
                version=version,
                metadata=self._core.model_metadata(name, version),
                config=self._core.model_config(name, version),
            )
        else:
            decoded = decode_infer_request(body, header_length, model=name, version=version, now=now, shm=self._shm)
        # The HTTP counterpart of a gRPC deadline (Triton defines none): milliseconds from arrival.
        apply_timeout_header(decoded.request, request.headers.get(TIMEOUT_HEADER), now)
        _request_id.set(decoded.request.id)
        # A no-op unless the trace settings take this request (the client's traceparent is its parent).
        with self._tracing.request(decoded.request, request.headers, "HTTP"):
            response = await self._core.infer(decoded.request)
            return await _send_infer(request, encode_infer_response(response, decoded))

    async def _read_body(self, request: web.Request) -> bytes:
        """The request body, decompressed, at most ``max_request_bytes`` long."""
        limit = self._max_request_bytes
        declared = request.content_length
        if declared is not None and declared > limit:
            raise PayloadTooLarge(f"request body of {declared} bytes is over the limit of {limit} bytes")
        chunks: list[bytes] = []
        size = 0
        try:
            while chunk := await request.content.readany():
                size += len(chunk)
                if size > limit:
                    raise PayloadTooLarge(f"request body is over the limit of {limit} bytes")
                chunks.append(chunk)
        except (web.RequestPayloadError, HttpProcessingError) as exc:  # e.g. bad chunked framing
            raise InvalidArgument(f"request body could not be read: {exc}") from None
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        encoding = request.headers.get(hdrs.CONTENT_ENCODING, "identity").strip().lower()
        if encoding in ("identity", ""):
            return body
        if encoding not in ("gzip", "x-gzip", "deflate"):
            raise InvalidArgument(f"unsupported Content-Encoding {encoding!r}; use gzip or deflate")
        if len(body) > _INFLATE_IN_THREAD_BYTES:
            return await asyncio.to_thread(inflate_bounded, body, encoding, limit)
        return inflate_bounded(body, encoding, limit)


def _query_flag(request: web.Request, key: str) -> bool:
    value = request.query.get(key)
    if value is None:
        return False
    if value.lower() in ("", "1", "true", "yes"):
        return True
    if value.lower() in ("0", "false", "no"):
        return False
    raise InvalidArgument(f"query parameter '{key}' must be true or false, got {value!r}")


def _model_path(request: web.Request) -> tuple[str, str]:
    return request.match_info.get("model", ""), request.match_info.get("version", "")


def _header_length(request: web.Request) -> int | None:
    raw = request.headers.get(INFER_HEADER)
    if raw is None:
        return None
    text = raw.strip()
    if not (text.isascii() and text.isdigit()):
        raise InvalidArgument(f"{INFER_HEADER} must be a non-negative integer, got {raw!r}")
    return int(text)


async def _send_infer(request: web.Request, encoded: EncodedInfer) -> web.StreamResponse:
    headers: dict[str, str] = {}
    content_type = "application/json"
    if encoded.header_length is not None:
        headers[INFER_HEADER] = str(encoded.header_length)
        content_type = "application/octet-stream"
    size = encoded.size
    coding = "identity"
    if size >= _COMPRESS_MIN_BYTES:
        coding = choose_encoding(request.headers.get(hdrs.ACCEPT_ENCODING, ""))
    if coding != "identity" or size <= _STREAM_RESPONSE_BYTES:
        body = b"".join((encoded.header, *encoded.parts)) if encoded.parts else encoded.header
        response = web.Response(body=body, headers=headers, content_type=content_type)
        if coding != "identity":
            response.enable_compression(ContentCoding(coding))
        return response
    # Large and uncompressed: hand the output buffers to the transport as they
    # are instead of copying them into one body.
    stream = web.StreamResponse(headers=headers)
    stream.content_type = content_type
    stream.content_length = size
    await stream.prepare(request)
    await stream.write(encoded.header)
    for part in encoded.parts:
        await stream.write(part)
    await stream.write_eof()
    return stream
