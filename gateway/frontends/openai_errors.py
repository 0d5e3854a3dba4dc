"""Errors of the OpenAI-compatible API in OpenAI's shape.

Every answer under ``/v1/`` that is an error carries
``{"error": {"message", "type", "param", "code"}}`` (the shape the
``openai`` client parses into its exception classes) with the status the
error class carries, except an unknown model: 404 ``model_not_found``, as
OpenAI answers (the v2 API answers 400 there, in Triton's way), and an
overload (a full queue, a worker's generation capacity): 429, as OpenAI
answers "slow down" (503 on the v2 API). The REST
app's error middleware hands ``/v1/`` requests to :func:`guard`, so the
handlers raise the project's errors like every other route; the access
check answers its 401 through :func:`openai_error_response`.

May import: what ``gateway.frontends`` may import.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable

import orjson
from aiohttp import hdrs, web

from protos.errors import InferGateError, Internal, ModelNotFound, Overloaded

log = logging.getLogger(__name__)

OPENAI_PREFIX = "/v1/"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# status -> (type, code) as OpenAI names them.
_KINDS: dict[int, tuple[str, str | None]] = {
    400: ("invalid_request_error", None),
    401: ("authentication_error", "invalid_api_key"),
    403: ("permission_error", "model_not_allowed"),
    404: ("invalid_request_error", "model_not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
    429: ("rate_limit_error", "rate_limit_exceeded"),  # an overload's code is "overloaded" (body_of)
    501: ("invalid_request_error", "unsupported"),
    503: ("server_error", "service_unavailable"),
    504: ("server_error", "timeout"),
}


def error_body(status: int, message: str, param: str | None = None) -> dict[str, dict[str, str | None]]:
    kind, code = _KINDS.get(status, ("server_error", None))
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def openai_error_response(status: int, message: str, *, param: str | None = None,
                          retry_after_s: float | None = None) -> web.Response:
    response = web.Response(status=status, body=orjson.dumps(error_body(status, message, param)),
                            content_type="application/json")
    if retry_after_s is not None:
        response.headers[hdrs.RETRY_AFTER] = str(max(0, math.ceil(retry_after_s)))
    return response


def status_of(exc: InferGateError) -> int:
    if isinstance(exc, ModelNotFound):
        return 404
    # A full queue or a worker's generation capacity: OpenAI's "slow down", which its clients retry.
    return 429 if isinstance(exc, Overloaded) else exc.http_status


def body_of(exc: InferGateError) -> dict[str, dict[str, str | None]]:
    """The error body of ``exc``; an overload's code is ``overloaded``."""
    body = error_body(status_of(exc), exc.message, getattr(exc, "param", None))
    if isinstance(exc, Overloaded):
        body["error"]["code"] = "overloaded"
    return body


def from_error(exc: InferGateError) -> web.Response:
    response = web.Response(status=status_of(exc), body=orjson.dumps(body_of(exc)), content_type="application/json")
    retry_after_s = getattr(exc, "retry_after_s", None)
    if retry_after_s is not None:
        response.headers[hdrs.RETRY_AFTER] = str(max(0, math.ceil(retry_after_s)))
    return response


async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Run an OpenAI route's ``handler``; whatever it raises answers in OpenAI's shape."""
    try:
        return await handler(request)
    except InferGateError as exc:
        level = logging.WARNING if isinstance(exc, Internal) else logging.DEBUG
        log.log(level, "%s %s failed with %d: %s", request.method, request.path, exc.http_status, exc.message)
        return from_error(exc)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        if exc.status == 404:
            body = error_body(404, f"no such endpoint: {request.method} {request.path}")
            body["error"]["code"] = "unknown_url"
            response = web.Response(status=404, body=orjson.dumps(body), content_type="application/json")
        elif exc.status == 405:
            response = openai_error_response(405, f"method {request.method} is not allowed on {request.path}")
        else:
            response = openai_error_response(exc.status, exc.reason)
        if hdrs.ALLOW in exc.headers:
            response.headers[hdrs.ALLOW] = exc.headers[hdrs.ALLOW]
        return response
    except Exception as exc:  # the error edge of the OpenAI routes: our bug, never the client's business
        log.exception("unexpected error serving %s %s", request.method, request.path)
        return openai_error_response(500, Internal.caused_by(f"serving {request.path}", exc).message)
