"""HTTP routes of a gateway process among several.

Public (on the shared HTTP port, in place of the single-process ones):
``/metrics``, ``/v2/cluster``, ``/v2/cluster/stats`` (which the dashboard
polls), drain, undrain and ``/v2/cluster/placement``, each the whole
gateway's answer: counters gathered from every process and summed, drains
and the placement view from the leader. Every public response carries
``X-Infergate-Process`` (the index of the process that answered).

Internal (:func:`internal_app`, on the process's own loopback peer port,
nothing else served there): this process's own counters, the leader's
decisions on behalf of the others, changes of the extension state
(``gateway.multiproc.replicated``) and workers' registration calls
(``gateway.multiproc.registrations``). Each call must carry the group's secret.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

import orjson
from aiohttp import web
from prometheus_client.process_collector import ProcessCollector
from tritonclient.grpc import service_pb2

from gateway.fleet.cluster import Cluster
from gateway.fleet.drain import drain_worker, undrain_worker
from gateway.replicas.local import LocalReplica
from gateway.fleet.manager import Fleet
from gateway.frontends.admin_routes import add_drain_routes
from gateway.multiproc.group import LOCAL_ACTION
from gateway.multiproc.merge import merge_cluster_stats, merge_cluster_view, merge_metrics
from gateway.multiproc.peers import PEER_PREFIX, ProcessGroup, error_body
from gateway.multiproc.registrations import registry_routes
from gateway.multiproc.replicated import Replicator
from gateway.observability.cluster_api import DeviceMonitor, cluster_stats, cluster_view
from gateway.observability.generation_usage import GenerationUsagePoller
from gateway.observability.metrics import GatewayCollector
from gateway.observability.observed import ObservedGateway
from gateway.routing.sequences import SequenceRoutes
from protos.errors import InferGateError, InvalidArgument, NotFound
from serverkit.prometheus import CONTENT_TYPE, render_text

Handler = Callable[[web.Request], Awaitable[web.Response]]
PROCESS_HEADER = "X-Infergate-Process"
INFLIGHT_POLL_S = 0.05


def _json(payload: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(payload), content_type="application/json",
                        headers={"Cache-Control": "no-store"})


def _float(request: web.Request, name: str, default: float) -> float:
    try:
        return float(request.query.get(name, default))
    except ValueError:
        raise InvalidArgument(f"{name} must be a number of seconds") from None


class GroupMember(ObservedGateway, Protocol):
    """The gateway of this process as these routes read it (besides what the observers read)."""

    fleet: Fleet
    sequences: SequenceRoutes

    @property
    def cluster(self) -> Cluster: ...

    async def local_statistics(self, name: str = "", version: str = "") -> service_pb2.ModelStatisticsResponse: ...

    async def load_model(self, name: str, parameters: dict[str, service_pb2.ModelRepositoryParameter]) -> None: ...

    async def unload_model(self, name: str, unload_dependents: bool = False) -> None: ...

    async def reread(self, name: str) -> None: ...

    def placement_view(self) -> dict[str, Any]: ...


class GroupViews:
    """This process's own documents, and the whole gateway's built from every process's."""

    def __init__(self, gateway: GroupMember, group: ProcessGroup, replicator: Replicator,
                 worker_metrics_urls: Mapping[str, str] | None, local: LocalReplica | None = None, *,
                 default_timeout_s: float, drain_timeout_s: float) -> None:
        """``default_timeout_s``: how long a placement asked for without a timeout may take;
        ``drain_timeout_s``: the same for a drain (the config's ``placement.drain_timeout_s``)."""
        self.gateway = gateway
        self.default_timeout_s = default_timeout_s
        self.drain_timeout_s = drain_timeout_s
        self.local = local  # this process's own copy of the repository's models (local execution)
        self.group = group
        self.replicator = replicator
        self.devices = DeviceMonitor(worker_metrics_urls)
        # Each process reads the workers' generation figures itself (one statistics call per
        # generation model a second): the merge takes them once (merge.VIEW_GAUGES), not N times.
        self.generation = GenerationUsagePoller(gateway)
        self._collectors = [GatewayCollector(gateway, self.generation), ProcessCollector(registry=None)]

    async def mirror_local(self, name: str, action: str, body: bytes) -> None:
        """Do with this process's copy of ``name`` what the leader did with its own."""
        assert self.local is not None
        if action == "load":
            request = service_pb2.RepositoryModelLoadRequest.FromString(body)
            await self.local.load(name, dict(request.parameters))
        elif self.local.serves(name):
            await self.local.unload(name)

    def local_metrics(self) -> bytes:
        return render_text(self._collectors)

    async def _in_index_order(self, local: Any, path: str, decode: Callable[[bytes], Any]) -> list[Any]:
        others = iter(await self.group.gather("GET", path))
        return [local if i == self.group.index else decode(next(others)) for i in range(self.group.size)]

    async def metrics(self) -> bytes:
        texts = await self._in_index_order(self.local_metrics().decode(), "metrics", bytes.decode)
        return merge_metrics(texts)

    async def cluster(self) -> dict[str, Any]:
        await self.devices.refresh(w.address for w in self.gateway.cluster.workers())
        local = cluster_view(self.gateway, self.devices, self.generation)
        return merge_cluster_view(await self._in_index_order(local, "cluster", orjson.loads))

    async def cluster_stats(self) -> dict[str, Any]:
        return merge_cluster_stats(await self._in_index_order(cluster_stats(self.gateway), "cluster_stats",
                                                              orjson.loads))

    # ---- drain: the leader moves the models, then every process stops using the worker ----

    async def drain(self, address: str, timeout_s: float, force: bool) -> tuple[int, dict[str, Any]]:
        if not self.group.is_leader:
            doc = orjson.loads(await self.group.call(0, "POST", "drain", params={
                "address": address, "timeout_s": str(timeout_s), "force": str(force).lower()}, timeout_s=timeout_s + 10))
            return doc["status"], doc["body"]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        status, body = await drain_worker(self.gateway, address, timeout_s=timeout_s, force=force)
        if status != 200:
            return status, body
        left = max(0.0, deadline - loop.time())
        for raw in await self.group.gather("POST", "drain_local", params={"address": address, "timeout_s": str(left)},
                                           timeout_s=left + 10):
            doc = orjson.loads(raw)
            body["inflight"] += doc["inflight"]
            body["open_sequences"] += doc["open_sequences"]
        body["state"] = "drained" if body["inflight"] == 0 and body["open_sequences"] == 0 else "draining"
        return status, body

    async def drain_local(self, address: str, timeout_s: float) -> dict[str, Any]:
        """A follower's part: re-read the workers (the moved replicas), stop sending there, wait for ours."""
        gateway = self.gateway
        if gateway.cluster.worker(address) is None:
            raise NotFound(f"no worker {address}")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        await gateway.cluster.refresh()
        worker = gateway.cluster.worker(address)
        if worker is None:
            raise NotFound(f"no worker {address}")
        if not worker.draining:
            gateway.cluster.set_draining(address, True)
        # Polling a condition (this process's in-flight batches there), bounded by the deadline.
        while (worker.inflight > 0 or gateway.sequences.open_on(address) > 0) and loop.time() < deadline:
            await asyncio.sleep(INFLIGHT_POLL_S)
        return {"inflight": worker.inflight, "open_sequences": gateway.sequences.open_on(address)}

    async def undrain(self, address: str) -> tuple[int, dict[str, Any]]:
        if not self.group.is_leader:
            doc = orjson.loads(await self.group.call(0, "POST", "undrain", params={"address": address}))
            return doc["status"], doc["body"]
        status, body = undrain_worker(self.gateway, address)
        if status == 200:
            await self.group.gather("POST", "undrain_local", params={"address": address})
        return status, body

    def undrain_local(self, address: str) -> None:
        worker = self.gateway.cluster.worker(address)
        if worker is not None and worker.draining:
            self.gateway.cluster.set_draining(address, False)

    async def placement(self) -> dict[str, Any]:
        if self.group.is_leader:
            return self.gateway.placement_view()
        return orjson.loads(await self.group.call(0, "GET", "placement"))


def add_group_routes(app: web.Application, views: GroupViews) -> None:
    """The whole-gateway observability and drain routes (before the app is set up);
    the drain routes are the single-process ones (``gateway.frontends.admin_routes``)
    answered by ``views``."""
    index = str(views.group.index)

    async def stamp(_request: web.Request, response: web.StreamResponse) -> None:
        response.headers[PROCESS_HEADER] = index

    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(body=await views.metrics(), headers={"Content-Type": CONTENT_TYPE})

    async def cluster(_request: web.Request) -> web.Response:
        return _json(await views.cluster())

    async def stats(_request: web.Request) -> web.Response:
        return _json(await views.cluster_stats())

    async def begin(_app: web.Application) -> None:
        views.generation.start()

    async def close(_app: web.Application) -> None:
        await views.generation.stop()
        await views.devices.close()

    app.on_response_prepare.append(stamp)
    app.on_startup.append(begin)
    app.on_cleanup.append(close)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v2/cluster", cluster)
    app.router.add_get("/v2/cluster/stats", stats)
    add_drain_routes(app, views, default_timeout_s=views.drain_timeout_s)


def _internal(views: GroupViews, handler: Handler) -> Handler:
    async def guarded(request: web.Request) -> web.Response:
        if not views.group.authorized(request.headers):
            return web.Response(status=404)
        try:
            return await handler(request)
        except InferGateError as e:
            return web.Response(status=e.http_status, body=error_body(e), content_type="application/json")
    return guarded


def internal_app(views: GroupViews) -> web.Application:
    """The peer endpoint: what the other processes of the group ask this one."""
    gateway, q = views.gateway, (lambda r, name: r.query.get(name, ""))

    async def stats(r: web.Request) -> web.Response:
        response = await gateway.local_statistics(q(r, "name"), q(r, "version"))
        return web.Response(body=response.SerializeToString())

    async def metrics(_r: web.Request) -> web.Response:
        return web.Response(body=views.local_metrics())

    async def cluster(_r: web.Request) -> web.Response:
        # Any process's view may be the merged document's base: its devices are read as fresh.
        await views.devices.refresh(w.address for w in gateway.cluster.workers())
        return _json(cluster_view(gateway, views.devices, views.generation))

    async def stats_doc(_r: web.Request) -> web.Response:
        return _json(cluster_stats(gateway))

    async def touch(r: web.Request) -> web.Response:
        for name, rows in orjson.loads(await r.read()).items():
            gateway.fleet.placement.touch(name, int(rows))
        return _json({})

    async def ensure(r: web.Request) -> web.Response:
        await gateway.fleet.placement.ensure(q(r, "name"), _float(r, "timeout_s", views.default_timeout_s))
        return _json({})

    async def load(r: web.Request) -> web.Response:
        request = service_pb2.RepositoryModelLoadRequest.FromString(await r.read())
        await gateway.load_model(request.model_name, dict(request.parameters))
        return _json({})

    async def unload(r: web.Request) -> web.Response:
        await gateway.unload_model(q(r, "name"), q(r, "unload_dependents") == "true")
        return _json({})

    async def reread(r: web.Request) -> web.Response:
        action = q(r, LOCAL_ACTION)
        if action and views.local is not None:
            await views.mirror_local(q(r, "name"), action, await r.read())
        await gateway.reread(q(r, "name"))
        return _json({})

    async def drain(r: web.Request) -> web.Response:
        timeout_s = _float(r, "timeout_s", views.drain_timeout_s)
        status, body = await views.drain(q(r, "address"), timeout_s,
                                         q(r, "force") == "true")
        return _json({"status": status, "body": body})

    async def drain_local(r: web.Request) -> web.Response:
        timeout_s = _float(r, "timeout_s", views.drain_timeout_s)
        return _json(await views.drain_local(q(r, "address"), timeout_s))

    async def undrain(r: web.Request) -> web.Response:
        status, body = await views.undrain(q(r, "address"))
        return _json({"status": status, "body": body})

    async def undrain_local(r: web.Request) -> web.Response:
        views.undrain_local(q(r, "address"))
        return _json({})

    async def placement(_r: web.Request) -> web.Response:
        return _json(gateway.placement_view())

    async def change(r: web.Request) -> web.Response:
        await views.replicator.change(q(r, "kind"), orjson.loads(await r.read()))
        return _json({})

    async def change_local(r: web.Request) -> web.Response:
        views.replicator.apply_local(q(r, "kind"), orjson.loads(await r.read()))
        return _json({})

    app = web.Application(client_max_size=2**31 - 1)
    for method, path, handler in (
        ("GET", "stats", stats), ("GET", "metrics", metrics), ("GET", "cluster", cluster),
        ("GET", "cluster_stats", stats_doc), ("POST", "touch", touch), ("POST", "ensure", ensure),
        ("POST", "load", load), ("POST", "unload", unload), ("POST", "reread", reread), ("POST", "drain", drain),
        ("POST", "drain_local", drain_local), ("POST", "undrain", undrain), ("POST", "undrain_local", undrain_local),
        ("GET", "placement", placement), ("POST", "change", change), ("POST", "change_local", change_local),
        *registry_routes(gateway.fleet.registry),
    ):
        app.router.add_route(method, f"{PEER_PREFIX}/{path}", _internal(views, handler))
    return app
