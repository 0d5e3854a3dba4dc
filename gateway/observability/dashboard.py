"""The dashboard page at ``/dashboard``: plain HTML, CSS and JavaScript shipped
in ``gateway/observability/static`` (no build step, nothing fetched from elsewhere: it works
offline). The page polls ``/v2/cluster`` and ``/v2/cluster/stats`` and draws
its own charts.

The files are read once, when the routes are mounted, and served from memory.
A Content-Security-Policy keeps the page to this origin.
"""

from __future__ import annotations

from importlib import resources

from aiohttp import web

_ASSETS = {
    "dashboard.js": "text/javascript",
    "dashboard.css": "text/css",
}
_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": (
        "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
        "connect-src 'self'; frame-ancestors 'none'"
    ),
}


def _read(name: str) -> bytes:
    return (resources.files("gateway.observability") / "static" / name).read_bytes()


def add_dashboard_routes(app: web.Application) -> None:
    """Mount ``/dashboard`` and its assets (before the app is set up)."""
    page = _read("dashboard.html")
    assets = {name: (_read(name), content_type) for name, content_type in _ASSETS.items()}

    async def dashboard(_request: web.Request) -> web.Response:
        return web.Response(body=page, content_type="text/html", charset="utf-8", headers=_HEADERS)

    async def asset(request: web.Request) -> web.Response:
        found = assets.get(request.match_info["name"])
        if found is None:
            raise web.HTTPNotFound()
        body, content_type = found
        return web.Response(body=body, content_type=content_type, charset="utf-8", headers=_HEADERS)

    async def slash(_request: web.Request) -> web.Response:
        # The page's links are relative to /dashboard; send /dashboard/ there.
        raise web.HTTPFound("../dashboard")

    app.router.add_get("/dashboard", dashboard)
    app.router.add_get("/dashboard/", slash)
    app.router.add_get("/dashboard/{name}", asset)
