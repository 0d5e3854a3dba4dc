"""Tests for gateway/frontends/admin_routes.py: the drain, undrain and placement
endpoints parse their query and answer what their ``Drains`` decides, refusals
through the one error answer (handlers called directly, no sockets).
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from gateway.frontends.admin_routes import add_drain_routes


class FakeDrains:
    def __init__(self, status: int = 200, body: dict[str, Any] | None = None) -> None:
        self.status, self.body = status, body if body is not None else {"state": "drained"}
        self.calls: list[tuple[Any, ...]] = []

    async def drain(self, address: str, timeout_s: float, force: bool) -> tuple[int, dict[str, Any]]:
        self.calls.append(("drain", address, timeout_s, force))
        return self.status, self.body

    async def undrain(self, address: str) -> tuple[int, dict[str, Any]]:
        self.calls.append(("undrain", address))
        return self.status, self.body

    async def placement(self) -> dict[str, Any]:
        return {"models": {}}


async def call(drains: FakeDrains, method: str, path: str) -> web.Response:
    app = web.Application()
    add_drain_routes(app, drains, default_timeout_s=42.0)
    match = await app.router.resolve(make_mocked_request(method, path, app=app))
    response = await match.handler(make_mocked_request(method, path, app=app, match_info=dict(match)))
    assert isinstance(response, web.Response)
    return response


def body(response: web.Response) -> Any:
    assert isinstance(response.body, bytes)
    return orjson.loads(response.body)


async def test_drain_takes_its_timeout_and_force_from_the_query() -> None:
    drains = FakeDrains()
    response = await call(drains, "POST", "/v2/cluster/workers/10.0.0.1:8001/drain")
    assert response.status == 200 and body(response) == {"state": "drained"}
    response = await call(drains, "POST", "/v2/cluster/workers/10.0.0.1:8001/drain?timeout_s=3&force=true")
    assert drains.calls == [("drain", "10.0.0.1:8001", 42.0, False), ("drain", "10.0.0.1:8001", 3.0, True)]


async def test_a_bad_timeout_is_refused_before_any_drain() -> None:
    drains = FakeDrains()
    response = await call(drains, "POST", "/v2/cluster/workers/w:1/drain?timeout_s=soon")
    assert response.status == 400 and body(response) == {"error": "timeout_s must be a number of seconds"}
    assert drains.calls == []


async def test_stranded_models_come_back_whole_and_other_refusals_as_errors() -> None:
    stranded = {"error": "models m have no replica", "address": "w:1", "stranded": ["m"]}
    response = await call(FakeDrains(409, stranded), "POST", "/v2/cluster/workers/w:1/drain")
    assert response.status == 409 and body(response) == stranded
    response = await call(FakeDrains(404, {"error": "no worker w:1"}), "POST", "/v2/cluster/workers/w:1/undrain")
    assert response.status == 404 and body(response) == {"error": "no worker w:1"}


async def test_placement_is_never_cached() -> None:
    response = await call(FakeDrains(), "GET", "/v2/cluster/placement")
    assert body(response) == {"models": {}} and response.headers["Cache-Control"] == "no-store"
