"""The fleet's admin endpoints on the REST app: draining a worker and the
placement controller's view.

``POST /v2/cluster/workers/{address}/drain[?timeout_s=S&force=true]``,
``POST /v2/cluster/workers/{address}/undrain`` and
``GET /v2/cluster/placement``. Being under ``/v2/cluster/`` they need the
admin key when keys are on (``gateway.security.frontend_auth``), as the
repository routes of ``gateway.frontends.http_api`` and the observability
routes do.

The routes only parse and answer; the answers come from a :class:`Drains`:
``gateway.fleet.drain.LocalDrains`` in a gateway of one process, the
group's views (``gateway.multiproc.routes``) among several. A drain that
leaves models stranded answers 409 with the whole result document (the
stranded models included); other refusals answer ``{"error": message}``.

May import: ``gateway.frontends.http_errors``; nothing of the fleet itself.
"""

from __future__ import annotations

from typing import Any, Protocol

import orjson
from aiohttp import web

from gateway.frontends.http_errors import error_response

_TRUE = ("1", "true", "yes")


class Drains(Protocol):
    """Who answers the drain endpoints: (HTTP status, result document) each."""

    async def drain(self, address: str, timeout_s: float, force: bool) -> tuple[int, dict[str, Any]]: ...

    async def undrain(self, address: str) -> tuple[int, dict[str, Any]]: ...

    async def placement(self) -> dict[str, Any]: ...


def _json(payload: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(payload), content_type="application/json",
                        headers={"Cache-Control": "no-store"})


def _answer(status: int, body: dict[str, Any]) -> web.Response:
    # 409 carries the stranded models, which the operator needs to decide on force.
    if status >= 400 and status != 409:
        return error_response(status, str(body.get("error", "")))
    return _json(body, status)


def add_drain_routes(app: web.Application, drains: Drains, *, default_timeout_s: float) -> None:
    """Mount the drain, undrain and placement endpoints (before the app is set up);
    ``default_timeout_s`` is a drain's timeout when the request names none."""

    async def drain(request: web.Request) -> web.Response:
        try:
            timeout_s = float(request.query.get("timeout_s", default_timeout_s))
        except ValueError:
            return error_response(400, "timeout_s must be a number of seconds")
        force = request.query.get("force", "").lower() in _TRUE
        return _answer(*await drains.drain(request.match_info["address"], timeout_s, force))

    async def undrain(request: web.Request) -> web.Response:
        return _answer(*await drains.undrain(request.match_info["address"]))

    async def placement(_request: web.Request) -> web.Response:
        return _json(await drains.placement())

    app.router.add_post("/v2/cluster/workers/{address}/drain", drain)
    app.router.add_post("/v2/cluster/workers/{address}/undrain", undrain)
    app.router.add_get("/v2/cluster/placement", placement)
