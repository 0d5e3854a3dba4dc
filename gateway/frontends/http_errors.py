"""How an error becomes an HTTP answer: the one helper every HTTP route uses.

The body is KServe v2's error shape, ``{"error": message}``, with the
error's status; an overload that knows when to come back adds
``Retry-After`` (whole seconds, rounded up). The REST app's error middleware,
the access-check middleware and the admin routes all answer through
:func:`error_response`, so a client sees one shape whatever refused it.

May import: aiohttp and orjson only, so any HTTP route of the gateway can
use it.
"""

from __future__ import annotations

import math

import orjson
from aiohttp import hdrs, web


def error_response(status: int, message: str, *, retry_after_s: float | None = None) -> web.Response:
    """``{"error": message}`` with ``status``, and ``Retry-After`` when given."""
    response = web.Response(status=status, body=orjson.dumps({"error": message}), content_type="application/json")
    if retry_after_s is not None:
        response.headers[hdrs.RETRY_AFTER] = str(max(0, math.ceil(retry_after_s)))
    return response
