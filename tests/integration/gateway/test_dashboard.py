"""The dashboard in a real headless Chromium, driven over the DevTools protocol.

- Against ``infergate up`` (two workers): the page loads with no console
  error, fetches nothing from anywhere but the gateway, lists the workers
  (with their host memory, read from the workers' metrics) and the models,
  and its numbers move while load runs. A screenshot goes to a temporary
  directory (its path is printed); set INFERGATE_DASHBOARD_PNG to a path to
  keep a copy (the README's picture was made that way).
- At scale (a stand-in cluster API with 50 workers and 200 models, served
  with the real dashboard routes): every row is listed, rows are updated in
  place rather than rebuilt, and sorting and filtering work.

Chromium comes from the distribution (``apt-get install -y chromium``); the
tests skip, saying so, when it is missing.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gateway.observability.dashboard import add_dashboard_routes
from models.build import example_names
from tests.harness import Proc, start

pytestmark = pytest.mark.timeout(180)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage", "--hide-scrollbars", "--window-size=1400,1200",
    "--remote-debugging-port=0",
]
WAIT_S = 45.0

needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="Chromium is not installed (Debian: apt-get install -y chromium); the dashboard test needs it"
)


# ---- a small DevTools protocol client -------------------------------------------------


class Page:
    """One browser tab over a flattened DevTools session; records every console error."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse, session_id: str) -> None:
        self._ws = ws
        self.session_id = session_id
        self.errors: list[str] = []
        self.requests: list[str] = []
        self.loaded = asyncio.Event()

    def on_event(self, method: str, params: dict[str, Any]) -> None:
        if method == "Runtime.consoleAPICalled" and params["type"] in ("error", "assert"):
            self.errors.append("console: " + " ".join(str(a.get("value", a.get("description", ""))) for a in params["args"]))
        elif method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            self.errors.append("exception: " + details.get("exception", {}).get("description", details.get("text", "")))
        elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
            self.errors.append("log: " + params["entry"]["text"] + " " + params["entry"].get("url", ""))
        elif method == "Network.requestWillBeSent":
            self.requests.append(params["request"]["url"])
        elif method == "Page.loadEventFired":
            self.loaded.set()


class Browser:
    """A headless Chromium process and one DevTools websocket to it."""

    def __init__(self, proc: subprocess.Popen[bytes], ws: aiohttp.ClientWebSocketResponse, http: aiohttp.ClientSession) -> None:
        self.proc = proc
        self._ws = ws
        self._http = http
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._pages: dict[str, Page] = {}
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for msg in self._ws:
            if msg.type != aiohttp.WSMsgType.TEXT:
                break
            data = json.loads(msg.data)
            if "id" in data:
                future = self._pending.pop(data["id"], None)
                if future is not None and not future.done():
                    future.set_result(data)
            elif data.get("sessionId") in self._pages:
                self._pages[data["sessionId"]].on_event(data["method"], data.get("params", {}))
        for future in self._pending.values():
            if not future.done():
                future.set_exception(ConnectionError("the browser closed the DevTools connection"))

    async def send(self, method: str, params: dict[str, Any] | None = None, session_id: str | None = None) -> dict[str, Any]:
        message: dict[str, Any] = {"id": next(self._ids), "method": method, "params": params or {}}
        if session_id is not None:
            message["sessionId"] = session_id
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[message["id"]] = future
        await self._ws.send_str(json.dumps(message))
        reply = await asyncio.wait_for(future, WAIT_S)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply["result"]

    async def open(self, url: str) -> Page:
        target = await self.send("Target.createTarget", {"url": "about:blank"})
        attached = await self.send("Target.attachToTarget", {"targetId": target["targetId"], "flatten": True})
        page = Page(self._ws, attached["sessionId"])
        self._pages[page.session_id] = page
        for domain in ("Runtime", "Log", "Network", "Page"):
            await self.send(f"{domain}.enable", session_id=page.session_id)
        await self.send("Emulation.setDeviceMetricsOverride",
                        {"width": 1400, "height": 1200, "deviceScaleFactor": 1, "mobile": False}, page.session_id)
        await self.send("Page.navigate", {"url": url}, page.session_id)
        await asyncio.wait_for(page.loaded.wait(), WAIT_S)
        return page

    async def evaluate(self, page: Page, expression: str) -> Any:
        result = await self.send(
            "Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True}, page.session_id
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r} raised: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, page: Page, expression: str, what: str) -> Any:
        """Poll ``expression`` in the page until it is truthy (the page updates itself every second)."""
        deadline = time.monotonic() + WAIT_S
        while True:
            value = await self.evaluate(page, expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; last value {value!r}; page errors {page.errors}")
            await asyncio.sleep(0.1)  # polling a condition in the page, not standing in for readiness

    async def screenshot(self, page: Page) -> bytes:
        result = await self.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True}, page.session_id)
        return base64.b64decode(result["data"])

    async def close(self) -> int:
        try:
            await asyncio.wait_for(self.send("Browser.close"), 10)
        except (RuntimeError, ConnectionError, asyncio.TimeoutError):
            pass
        await self._ws.close()
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)
        await self._http.close()
        try:
            return await asyncio.to_thread(self.proc.wait, 20)
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            return await asyncio.to_thread(self.proc.wait, 10)


def launch(profile: Path) -> subprocess.Popen[bytes]:
    """Chromium on a fresh profile; its (noisy) output goes to a file beside the profile."""
    assert CHROMIUM is not None
    with open(profile.parent / f"{profile.name}.log", "wb") as log:
        return subprocess.Popen(
            [CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "about:blank"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )


@asynccontextmanager
async def chromium() -> AsyncIterator[Browser]:
    profile = Path(tempfile.mkdtemp(prefix="infergate-chromium-"))
    proc = launch(profile)
    browser: Browser | None = None
    try:
        # Chromium writes its DevTools port and path here once it listens.
        active = profile / "DevToolsActivePort"
        deadline = time.monotonic() + WAIT_S
        while not (active.exists() and len(active.read_text().splitlines()) >= 2):
            if proc.poll() is not None:
                raise RuntimeError(f"chromium exited with {proc.returncode} while starting")
            if time.monotonic() > deadline:
                raise RuntimeError("chromium did not open its DevTools port")
            await asyncio.sleep(0.05)
        port, path = active.read_text().splitlines()[:2]
        http = aiohttp.ClientSession()
        ws = await http.ws_connect(f"ws://127.0.0.1:{port}{path}", max_msg_size=0)
        browser = Browser(proc, ws, http)
        yield browser
    finally:
        if browser is not None:
            rc = await browser.close()
        else:
            proc.kill()
            rc = proc.wait()
        shutil.rmtree(profile, ignore_errors=True)
        log = profile.parent / f"{profile.name}.log"
        assert rc == 0, f"chromium exited with {rc}; its output is in {log}"
        log.unlink(missing_ok=True)


def save_screenshot(png: bytes, name: str) -> Path:
    assert png.startswith(b"\x89PNG"), "the screenshot is not a PNG"
    path = Path(tempfile.mkdtemp(prefix="infergate-dashboard-")) / name
    path.write_bytes(png)
    print(f"dashboard screenshot: {path}")
    keep = os.environ.get("INFERGATE_DASHBOARD_PNG")
    if keep:
        Path(keep).parent.mkdir(parents=True, exist_ok=True)
        Path(keep).write_bytes(png)
        print(f"dashboard screenshot kept at {keep}")
    return path


# ---- against a real cluster ---------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(model_repo: Path) -> Iterator[Proc]:
    proc = start(["up", "--workers", "2", "--model-repository", str(model_repo), "--http-port", "0", "--grpc-port", "0"])
    try:
        yield proc
    finally:
        proc.stop()


SIMPLE_BODY = {
    "inputs": [
        {"name": "INPUT0", "datatype": "INT32", "shape": [2, 16], "data": list(range(32))},
        {"name": "INPUT1", "datatype": "INT32", "shape": [2, 16], "data": [1] * 32},
    ]
}
MLP_BODY = {"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [1, 64], "data": [0.5] * 64}]}


async def run_load(base: str, stop: asyncio.Event) -> int:
    """Requests to two models from a few concurrent clients until ``stop``; returns how many succeeded."""
    done = 0

    async def client(model: str, body: dict[str, Any]) -> None:
        nonlocal done
        async with aiohttp.ClientSession() as http:
            while not stop.is_set():
                async with http.post(f"{base}/v2/models/{model}/infer", json=body) as r:
                    assert r.status == 200, await r.text()
                    await r.read()
                done += 1

    await asyncio.gather(*(client(m, b) for m, b in [("simple", SIMPLE_BODY)] * 3 + [("mlp", MLP_BODY)]))
    return done


def cell(table: str, key: str, column: str) -> str:
    """JS: the text of ``column`` (by header label) in ``table``'s row ``key``."""
    return (
        f"(() => {{ const t = document.getElementById({table!r});"
        f" const i = [...t.tHead.rows[0].cells].findIndex(th => th.textContent === {column!r});"
        f" const r = t.querySelector('tbody tr[data-key=\"' + {key!r} + '\"]');"
        f" return r && i >= 0 ? r.cells[i].textContent : null; }})()"
    )


@needs_chromium
async def test_dashboard_shows_the_cluster_and_its_load(cluster: Proc) -> None:
    base = f"http://127.0.0.1:{cluster.ready['http_port']}"
    addresses = sorted(w["address"] for w in cluster.ready["workers"])
    async with chromium() as browser:
        page = await browser.open(f"{base}/dashboard")
        await browser.wait_for(page, "Number(document.body.dataset.clusterUpdates || 0) >= 1", "the first cluster view")
        workers = await browser.evaluate(page, "[...document.querySelectorAll('#workers tbody tr')].map(r => r.dataset.key)")
        assert sorted(workers) == addresses
        models = await browser.evaluate(page, "[...document.querySelectorAll('#models tbody tr')].map(r => r.dataset.key)")
        assert models == sorted(example_names())  # sorted by name
        for address in addresses:
            assert await browser.evaluate(page, cell("workers", address, "State")) == "ready"
        assert await browser.evaluate(page, cell("models", "simple", "Replicas")) == "2"
        # Devices come from the workers' own metrics: on a machine without a GPU, the host's memory.
        await browser.wait_for(
            page, " && ".join(f"/(GPU|host) .+ \\/ .+/.test({cell('workers', a, 'Device memory')})" for a in addresses),
            "device memory of every worker",
        )
        before = await browser.evaluate(page, cell("models", "simple", "Req/s"))
        assert before in ("–", "0.00")

        stop = asyncio.Event()
        load = asyncio.create_task(run_load(base, stop))
        try:
            rate = await browser.wait_for(
                page, f"(() => {{ const v = parseFloat({cell('models', 'simple', 'Req/s')}); return v > 0 ? v : null; }})()",
                "a request rate for model simple",
            )
            p99 = await browser.wait_for(page, f"(() => {{ const v = {cell('models', 'simple', 'p99')}; return v !== '–' && v; }})()",
                                         "a p99 latency for model simple")
            await browser.wait_for(page, "parseFloat(document.getElementById('tile-rps').textContent) > 0", "the cluster request rate")
            batch = await browser.wait_for(page, f"parseFloat({cell('models', 'simple', 'Mean batch')}) >= 2",
                                           "the mean batch size of model simple (2 rows a request)")
            # Click a model: the charts follow it.
            await browser.evaluate(page, "document.querySelector('#models tbody tr[data-key=\"simple\"]').click()")
            assert await browser.evaluate(page, "document.getElementById('chart-scope').textContent") == "simple"
            await browser.wait_for(page, "Number(document.body.dataset.statsUpdates || 0) >= 4", "a few stats polls")
            png = await browser.screenshot(page)
        finally:
            stop.set()
            served = await load
        assert served > 0
        assert rate > 0 and p99.endswith("ms") and batch
        save_screenshot(png, "dashboard.png")
        # Offline: the page asked nothing of any other origin.
        assert page.requests and all(u.startswith((base, "data:")) for u in page.requests), page.requests
        assert page.errors == []


# ---- at scale -------------------------------------------------------------------------------


def fake_cluster(workers: int, models: int) -> web.Application:
    """The real dashboard routes beside a stand-in cluster API with counters that grow each poll."""
    polls = itertools.count(1)
    bounds = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1]
    names = [f"model-{i:03d}" for i in range(models)]
    addresses = [f"10.0.{i // 256}.{i % 256}:8001" for i in range(workers)]
    gib = 2**30

    async def cluster(_request: web.Request) -> web.Response:
        return web.json_response({
            "gateway": {"version": "0.0.0", "ready": True, "time": time.time()},
            "workers": [{
                "address": a, "kind": "infergate", "state": "down" if i % 10 == 9 else "ready",
                "devices": [{"kind": "gpu", "uuid": f"GPU-{i}", "name": "Test GPU", "index": 0,
                             "memory_total_bytes": 80 * gib, "memory_used_bytes": (i % 80) * gib, "utilization": 0.5}],
                "models": names[i::workers], "load": {"inflight_batches": i % 4, "batches_sent": 0, "failures": 0, "retries": 0},
                "consecutive_probe_failures": 0, "last_error": "",
                "generation": {"tiny_lm": {"running": i, "waiting": 1, "cache_bytes": i * 2**20,
                                           "cache_reserved_bytes": 64 * 2**20}} if i % 10 == 0 else {},
            } for i, a in enumerate(addresses)],
            "models": [{"name": n, "state": "ready", "versions": ["1"], "replicas": addresses[: 1 + i % 3],
                        "max_batch_size": 8, "platform": "onnxruntime_onnx", "queue_depth": 0} for i, n in enumerate(names)],
            "gateway_generation": {"split_lm": {"running": 2, "waiting": 0, "cache_bytes": 4096,
                                                "cache_reserved_bytes": 8192}},
        })

    async def stats(_request: web.Request) -> web.Response:
        k = next(polls)
        return web.json_response({
            "time": time.time(),
            "latency_bounds_s": bounds,
            # Model i has served k * (i + 1) requests: its rate grows with its index.
            "models": [{"model": n, "version": "1", "success": k * (i + 1), "failure": 0, "inferences": k * (i + 1),
                        "executions": k, "batch_rows": k * (i + 1), "queue_depth": i % 5,
                        "latency_counts": [0, k * (i + 1), 0, 0, 0, 0, 0, 0], "latency_sum_s": 0.0015 * k * (i + 1)}
                       for i, n in enumerate(names)],
            "workers": [{"address": a, "state": "ready", "inflight": 1, "sent": k * 10, "failures": 0, "retries": 0}
                        for a in addresses],
        })

    app = web.Application()
    app.router.add_get("/v2/cluster", cluster)
    app.router.add_get("/v2/cluster/stats", stats)
    add_dashboard_routes(app)
    return app


@needs_chromium
async def test_dashboard_with_50_workers_and_200_models() -> None:
    runner = web.AppRunner(fake_cluster(50, 200), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    base = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        async with chromium() as browser:
            page = await browser.open(f"{base}/dashboard")
            await browser.wait_for(page, "Number(document.body.dataset.statsUpdates || 0) >= 2", "two stats polls")
            assert await browser.evaluate(page, "document.querySelectorAll('#workers tbody tr').length") == 50
            assert await browser.evaluate(page, "document.querySelectorAll('#models tbody tr').length") == 200
            assert await browser.evaluate(page, "document.getElementById('tile-workers').textContent") == "45 / 50"
            assert await browser.evaluate(page, "document.getElementById('models-count').textContent") == "(200)"
            # Generation: a row per (worker, model) that generates, the gateway's own split decoders as "gateway".
            assert await browser.evaluate(page, "document.getElementById('generation-panel').hidden") is False
            assert await browser.evaluate(page, "document.querySelectorAll('#generation tbody tr').length") == 6
            assert await browser.evaluate(page, cell("generation", "10.0.0.20:8001 tiny_lm", "Running")) == "20"
            assert await browser.evaluate(page, cell("generation", "gateway split_lm", "Running")) == "2"

            # Rows are updated in place: the same element, new numbers.
            await browser.evaluate(page, "window.probe = document.querySelector('#models tbody tr[data-key=\"model-007\"]');"
                                         " window.probeUpdates = Number(document.body.dataset.statsUpdates); true")
            await browser.wait_for(page, "Number(document.body.dataset.statsUpdates) >= window.probeUpdates + 2", "two more polls")
            assert await browser.evaluate(
                page, "document.querySelector('#models tbody tr[data-key=\"model-007\"]') === window.probe && window.probe.isConnected"
            )
            assert float(await browser.evaluate(page, cell("models", "model-007", "Req/s"))) > 0

            # Sort by request rate, highest first: the busiest model leads.
            await browser.evaluate(page, "[...document.querySelectorAll('#models th')].find(th => th.textContent === 'Req/s').click()")
            assert await browser.evaluate(page, "document.querySelector('#models tbody tr').dataset.key") == "model-199"
            # Sort by name, descending (two clicks).
            await browser.evaluate(page, "const th = [...document.querySelectorAll('#models th')].find(t => t.textContent === 'Model');"
                                         " th.click(); th.click(); true")
            assert await browser.evaluate(page, "document.querySelector('#models tbody tr').dataset.key") == "model-199"
            await browser.evaluate(page, "document.querySelector('#models th').click()")
            assert await browser.evaluate(page, "document.querySelector('#models tbody tr').dataset.key") == "model-000"

            # Filter: only the matching rows stay visible.
            await browser.evaluate(page, "const f = document.getElementById('models-filter'); f.value = 'model-01';"
                                         " f.dispatchEvent(new Event('input')); true")
            visible = await browser.evaluate(page, "[...document.querySelectorAll('#models tbody tr')].filter(r => !r.hidden).map(r => r.dataset.key)")
            assert visible == [f"model-01{i}" for i in range(10)]
            assert await browser.evaluate(page, "document.getElementById('models-count').textContent") == "(10 of 200)"
            save_screenshot(await browser.screenshot(page), "dashboard-scale.png")
            assert page.errors == []
    finally:
        await runner.cleanup()
