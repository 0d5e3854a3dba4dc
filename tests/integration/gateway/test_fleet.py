"""Fleet management end to end, with real gateway and worker processes:
workers that register (``--gateway``) appear and serve; a killed one drops
out after its missed heartbeats and its models are re-placed; a worker found
through DNS serves; two gateways given the same workers place the same way;
an idle model is unloaded after its TTL; a memory cap evicts the least
recently used model; a drain under load loses no request; a worker registers
again when its gateway restarts.

Heartbeats, probes and placement rounds run every few tenths of a second
here (the config), so each test waits on conditions, polled with deadlines,
for well under a minute.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcclient_aio
import tritonclient.http as httpclient

from gateway.fleet.rendezvous import rendezvous_order
from tests.harness import ROOT, Proc, infergate_cmd, start, start_worker, worker_url

pytestmark = pytest.mark.timeout(180)

WAIT_S = 60.0
FAST = """\
membership: {heartbeat_interval_s: 0.3, heartbeat_misses_to_down: 3}
probe: {interval_s: 0.5}
"""
FAST_PLACEMENT = {"interval_s": 0.3}


# ---- processes ---------------------------------------------------------------------


class Fleet:
    """The gateways and workers of one test; teardown stops the live ones and checks clean exits."""

    def __init__(self, repo: Path, tmp: Path) -> None:
        self.repo = repo
        self.tmp = tmp
        self.gateways: list[Proc] = []
        self.workers: list[Proc] = []
        self.gone: set[int] = set()

    def gateway(self, config: str, placement: dict[str, Any] | None = None) -> Proc:
        path = self.tmp / f"gateway{len(self.gateways)}.yaml"
        path.write_text(FAST + config + f"placement: {json.dumps({**FAST_PLACEMENT, **(placement or {})})}\n")
        proc = start(["gateway", "--http-port", "0", "--grpc-port", "0", "--config", str(path),
                      "--model-repository", str(self.repo)])
        self.gateways.append(proc)
        return proc

    def register(self, n: int, *gateways: Proc) -> list[Proc]:
        """``n`` workers that register with ``gateways`` (nothing loaded at start)."""
        flags = [arg for g in gateways for arg in ("--gateway", f"127.0.0.1:{g.ready['grpc_port']}")]
        with ThreadPoolExecutor(n) as pool:
            procs = list(pool.map(lambda _: start_worker(self.repo, "--model-control-mode", "explicit",
                                                         "--heartbeat-interval", "0.3", *flags), range(n)))
        self.workers.extend(procs)
        return procs

    def kill(self, proc: Proc) -> None:
        proc.kill(signal.SIGKILL)
        self.gone.add(proc.pid)

    def stop(self, proc: Proc) -> None:
        proc.stop()
        self.gone.add(proc.pid)

    def close(self) -> None:
        for proc in self.workers + self.gateways:
            if proc.pid not in self.gone:
                proc.stop()


@pytest.fixture
def fleet(model_repo: Path, tmp_path: Path) -> Iterator[Fleet]:
    group = Fleet(model_repo, tmp_path)
    try:
        yield group
    finally:
        group.close()


def get_json(gateway: Proc, path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{gateway.ready['http_port']}{path}", timeout=10) as response:
        return json.loads(response.read())


def placement(gateway: Proc) -> dict[str, Any]:
    return get_json(gateway, "/v2/cluster/placement")


def models(gateway: Proc) -> dict[str, dict[str, Any]]:
    return {m["name"]: m for m in placement(gateway)["models"]}


def until(condition: Callable[[], Any], what: str, timeout_s: float = WAIT_S) -> Any:
    """Poll a condition the fleet makes true (heartbeats, placement rounds), with a deadline."""
    end = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def settled(gateway: Proc, addresses: Iterable[str], wanted: dict[str, int]) -> dict[str, list[str]] | None:
    """The placement once every worker has registered: each model on the first ``wanted[model]`` workers
    of its rendezvous order (no memory limits here), and served exactly there."""
    addresses = sorted(addresses)
    view = placement(gateway)
    if sorted(w["address"] for w in view["workers"] if w["registered"] and w["state"] == "ready") != addresses:
        return None
    targets = {m["name"]: m["targets"] for m in view["models"]}
    ready = {m["name"]: m["ready"] for m in view["models"]}
    for model, n in wanted.items():
        if targets.get(model) != rendezvous_order(model, addresses)[:n] or ready[model] != sorted(targets[model]):
            return None
    return targets


def worker_index(proc: Proc) -> dict[str, str]:
    """The worker's own repository index: model -> state ("" when never loaded)."""
    with grpcclient.InferenceServerClient(worker_url(proc)) as client:
        index = client.get_model_repository_index(as_json=True)
    return {m["name"]: m.get("state", "") for m in index.get("models", [])}


def worker_inferences(proc: Proc, model: str) -> int:
    with grpcclient.InferenceServerClient(worker_url(proc)) as client:
        stats = client.get_inference_statistics(model, as_json=True)
    return sum(int(s.get("inference_count", 0)) for s in stats.get("model_stats", []))


def file_bytes(repo: Path, model: str) -> int:
    return sum(f.stat().st_size for f in (repo / model / "1").rglob("*") if f.is_file())


def infer_mlp(gateway: Proc, x: np.ndarray) -> np.ndarray:
    client = httpclient.InferenceServerClient(f"127.0.0.1:{gateway.ready['http_port']}")
    tensor = httpclient.InferInput("INPUT", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    return client.infer("mlp", [tensor]).as_numpy("OUTPUT")


def infer(gateway: Proc, model: str) -> None:
    """One request with zeros of the right shape: the answer's shape is checked."""
    shapes = {"mlp": ("INPUT", [1, 64], "FP32", "OUTPUT"), "cnn": ("IMAGE", [1, 3, 32, 32], "FP32", "PROBS"),
              "encoder": ("TOKENS", [1, 16], "INT64", "HIDDEN"), "simple": ("INPUT0", [1, 16], "INT32", "OUTPUT0")}
    name, shape, dtype, output = shapes[model]
    client = httpclient.InferenceServerClient(f"127.0.0.1:{gateway.ready['http_port']}")
    inputs = []
    for input_name in ([name, "INPUT1"] if model == "simple" else [name]):
        tensor = httpclient.InferInput(input_name, shape, dtype)
        tensor.set_data_from_numpy(np.zeros(shape, dtype=np.dtype(dtype.lower().replace("fp", "float"))))
        inputs.append(tensor)
    result = client.infer(model, inputs)
    assert result.as_numpy(output) is not None and result.as_numpy(output).shape[0] == 1


@pytest.fixture(scope="module")
def mlp_reference(model_repo: Path) -> Callable[[np.ndarray], np.ndarray]:
    session = ort.InferenceSession(str(model_repo / "mlp" / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    return lambda x: session.run(["OUTPUT"], {"INPUT": x})[0]


# ---- registration and re-placement -----------------------------------------------------


def test_registered_workers_serve_and_a_killed_one_is_replaced(
    fleet: Fleet, mlp_reference: Callable[[np.ndarray], np.ndarray]
) -> None:
    gateway = fleet.gateway("models:\n  mlp: {replicas: 1}\n  cnn: {replicas: 1}\n")
    workers = fleet.register(2, gateway)
    addresses = {worker_url(p): p for p in workers}
    until(lambda: settled(gateway, addresses, {"mlp": 1, "cnn": 1}), "both workers registered and both models placed")
    x = np.random.default_rng(1).standard_normal((3, 64), dtype=np.float32)
    np.testing.assert_allclose(infer_mlp(gateway, x), mlp_reference(x), rtol=1e-4, atol=1e-4)
    infer(gateway, "cnn")

    def report() -> dict[str, Any]:
        (host,) = models(gateway)["mlp"]["ready"]
        return next(w["report"] for w in placement(gateway)["workers"] if w["address"] == host)

    until(lambda: "mlp" in report()["models"], "a heartbeat reporting mlp")
    assert report()["devices"] and report()["devices"][-1]["memory_total_bytes"] > 0
    assert report()["models"]["mlp"]["memory_bytes"] == file_bytes(fleet.repo, "mlp")

    (host,) = models(gateway)["mlp"]["ready"]
    (survivor,) = set(addresses) - {host}
    fleet.kill(addresses[host])
    until(lambda: host not in {w["address"] for w in get_json(gateway, "/v2/cluster")["workers"]},
          "the killed worker to drop out after its missed heartbeats")
    until(lambda: models(gateway)["mlp"]["ready"] == [survivor], "mlp re-placed on the surviving worker")
    np.testing.assert_allclose(infer_mlp(gateway, x), mlp_reference(x), rtol=1e-4, atol=1e-4)
    assert placement(gateway)["counters"]["moves"] >= 1
    with urllib.request.urlopen(f"http://127.0.0.1:{gateway.ready['http_port']}/metrics", timeout=10) as response:
        metrics = response.read().decode()
    moves = next(line for line in metrics.splitlines() if line.startswith("infergate_placement_moves_total"))
    assert float(moves.split()[-1]) >= 1


def test_dns_discovery_with_the_system_resolver(fleet: Fleet, mlp_reference: Callable[[np.ndarray], np.ndarray]) -> None:
    worker = start_worker(fleet.repo)  # not registering; loads every model at start
    fleet.workers.append(worker)
    # A numeric name resolves to itself: the real resolver path, with no DNS server needed.
    gateway = fleet.gateway(f"worker_dns: ['127.0.0.1:{worker.ready['grpc_port']}']\n")
    view = get_json(gateway, "/v2/cluster")
    assert [w["address"] for w in view["workers"]] == [worker_url(worker)]
    x = np.ones((1, 64), dtype=np.float32)
    np.testing.assert_allclose(infer_mlp(gateway, x), mlp_reference(x), rtol=1e-4, atol=1e-4)


def test_two_gateways_compute_the_same_placement(fleet: Fleet) -> None:
    config = "models:\n" + "".join(f"  {m}: {{replicas: {r}}}\n" for m, r in
                                   (("mlp", 2), ("cnn", 1), ("encoder", 1), ("simple", 2)))
    gateways = [fleet.gateway(config), fleet.gateway(config)]
    workers = fleet.register(3, *gateways)
    addresses = [worker_url(p) for p in workers]
    wanted = {"mlp": 2, "cnn": 1, "encoder": 1, "simple": 2}
    # Each gateway reaches the rendezvous placement on its own: equal, with no shared store.
    first, second = (until(lambda g=g: settled(g, addresses, wanted), "placement to settle") for g in gateways)
    assert first == second
    assert first == {m: rendezvous_order(m, addresses)[:n] for m, n in wanted.items()}
    # Each worker holds exactly the replicas placed on it, whichever gateway loaded them.
    for proc, address in zip(workers, addresses):
        held = {m for m, state in worker_index(proc).items() if state == "READY"}
        assert held == {m for m, t in first.items() if address in t}


# ---- lifecycle: idle TTL and LRU under a memory cap ----------------------------------------


def test_idle_ttl_and_lru_eviction(fleet: Fleet, model_repo: Path) -> None:
    sizes = {m: file_bytes(model_repo, m) for m in ("mlp", "cnn", "encoder", "simple")}
    # Any two of the three large models fit; all three do not.
    cap = sizes["cnn"] + sizes["encoder"] + sizes["simple"] + 1000
    assert sizes["mlp"] + sizes["cnn"] + sizes["encoder"] > cap
    gateway = fleet.gateway("models:\n  simple: {idle_ttl_s: 1.0}\n",
                            placement={"load_on_demand": True, "worker_memory_cap_bytes": cap})
    (worker,) = fleet.register(1, gateway)
    until(lambda: placement(gateway)["workers"], "the worker to register")

    def loaded() -> set[str]:
        return {m for m, state in worker_index(worker).items() if state == "READY"}

    def reported() -> dict[str, Any]:
        (w,) = placement(gateway)["workers"]
        return w["report"]["models"]

    # Idle TTL: loaded on its first request, unloaded after a second without one.
    infer(gateway, "simple")
    assert loaded() == {"simple"}
    until(lambda: "simple" in reported(), "the worker to report simple")
    assert reported()["simple"]["memory_bytes"] == sizes["simple"]
    until(lambda: "simple" not in loaded(), "simple to be unloaded after its idle TTL", timeout_s=30)
    assert worker_index(worker)["simple"] == "UNAVAILABLE"
    until(lambda: "simple" not in reported(), "the worker to stop reporting simple's memory")
    assert placement(gateway)["counters"]["idle_unloads"] == 1

    # LRU: mlp and cnn fit; encoder pushes out the least recently used (mlp).
    for model in ("mlp", "cnn"):
        infer(gateway, model)
    assert loaded() == {"mlp", "cnn"}
    infer(gateway, "encoder")
    assert loaded() == {"cnn", "encoder"}
    # Use cnn, then ask for mlp again: encoder is now the least recently used.
    infer(gateway, "cnn")
    infer(gateway, "mlp")
    assert loaded() == {"cnn", "mlp"}
    counters = placement(gateway)["counters"]
    assert counters["evictions"] == 2 and counters["load_failures"] == 0
    until(lambda: set(reported()) == {"cnn", "mlp"}, "reports to follow the evictions")
    assert sum(m["memory_bytes"] for m in reported().values()) <= cap


# ---- draining ----------------------------------------------------------------------


class Load:
    """Clients sending mlp requests through the gateway in a loop, on their own thread and loop."""

    def __init__(self, gateway: Proc, clients: int = 4) -> None:
        self.url = f"127.0.0.1:{gateway.ready['grpc_port']}"
        self.clients = clients
        self.ok = 0
        self.errors: list[str] = []
        self.running = True
        self.pool = ThreadPoolExecutor(1)
        self.future = self.pool.submit(asyncio.run, self._run())

    async def _run(self) -> None:
        client = grpcclient_aio.InferenceServerClient(self.url)
        x = np.ones((2, 64), dtype=np.float32)

        async def one() -> None:
            while self.running:
                tensor = grpcclient.InferInput("INPUT", [2, 64], "FP32")
                tensor.set_data_from_numpy(x)
                try:
                    result = await client.infer("mlp", [tensor], client_timeout=30)
                    assert result.as_numpy("OUTPUT").shape == (2, 10)
                    self.ok += 1
                except Exception as e:  # noqa: BLE001 - every failure is recorded and asserted on
                    self.errors.append(repr(e))

        try:
            await asyncio.gather(*(one() for _ in range(self.clients)))
        finally:
            await client.close()

    def more(self, n: int, what: str) -> None:
        target = self.ok + n
        until(lambda: self.ok >= target or self.errors, what)

    def stop(self) -> None:
        self.running = False
        self.future.result(timeout=60)
        self.pool.shutdown()


def test_drain_under_load_loses_no_request(fleet: Fleet) -> None:
    gateway = fleet.gateway("models:\n  mlp: {replicas: 1}\n")
    workers = fleet.register(2, gateway)
    by_address = {worker_url(p): p for p in workers}
    (host,) = until(lambda: settled(gateway, by_address, {"mlp": 1}), "both workers registered and mlp placed")["mlp"]
    drained = by_address[host]
    (other,) = [p for a, p in by_address.items() if a != host]

    load = Load(gateway)
    try:
        load.more(30, "traffic before the drain")
        drain = subprocess.run(infergate_cmd("drain", host, "-u", f"http://127.0.0.1:{gateway.ready['http_port']}",
                                             "--timeout", "60"), cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
        assert drain.returncode == 0, drain.stdout + drain.stderr
        answer = json.loads(drain.stdout.splitlines()[-1])
        assert answer["state"] == "drained" and answer["moved"] == ["mlp"] and answer["inflight"] == 0
        served_before = worker_inferences(drained, "mlp")
        load.more(30, "traffic after the drain")
        # Nothing new reached the drained worker; the other one serves.
        assert worker_inferences(drained, "mlp") == served_before
        assert worker_inferences(other, "mlp") > 0
        fleet.stop(drained)  # a clean stop: it deregisters
        until(lambda: host not in {w["address"] for w in get_json(gateway, "/v2/cluster")["workers"]},
              "the drained worker to leave")
        load.more(30, "traffic after the worker stopped")
    finally:
        load.stop()
    assert load.errors == [], load.errors[:5]
    assert load.ok >= 90


# ---- re-registration (in process: the gateway's registry and the worker's client) -------------


class NoModels:
    """The worker's model manager, with nothing loaded."""

    def loaded(self) -> list[Any]:
        return []

    def source_dir(self, name: str) -> None:
        return None


async def test_a_worker_registers_again_when_the_gateway_restarts() -> None:
    import grpc

    from gateway.fleet.cluster import Cluster
    from gateway.fleet.membership import Membership
    from gateway.fleet.registry import Registry, add_registry_service
    from tests.unit.gateway.fleet.test_placement import Fakes
    from workers.registration import Registration, RegistrationConfig, WorkerReporter

    async def serve(port: int) -> tuple[grpc.aio.Server, Registry, Cluster, int]:
        cluster = Cluster(probe_interval_s=3600, client_factory=Fakes())  # type: ignore[arg-type]
        registry = Registry(Membership(cluster), heartbeat_interval_s=0.1)
        server = grpc.aio.server()
        add_registry_service(server, registry)
        bound = server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        return server, registry, cluster, bound

    async def until_async(condition: Callable[[], bool], what: str) -> None:
        end = time.monotonic() + 30
        while not condition():
            assert time.monotonic() < end, f"timed out waiting for {what}"
            await asyncio.sleep(0.02)

    address = "10.1.2.3:8001"
    server, registry, cluster, port = await serve(0)
    registration = Registration(
        RegistrationConfig(gateways=(f"127.0.0.1:{port}",), address=address, backend="onnx", heartbeat_interval_s=0.1),
        WorkerReporter(NoModels(), use_gpus=False))  # type: ignore[arg-type]
    try:
        await registration.start()
        await until_async(lambda: registry.report(address) is not None, "the first registration")
        assert cluster.worker(address) is not None
        report = registry.report(address)
        assert report is not None and any(d.kind == "host" and d.memory_total_bytes > 0 for d in report.devices)
        first_seen = report.last_seen
        await until_async(lambda: registry.report(address).last_seen > first_seen, "a heartbeat")  # type: ignore[union-attr]

        # The gateway restarts (same port, empty registry): the next heartbeat is unknown, so the worker registers again.
        await server.stop(None)
        await cluster.stop()
        server, registry, cluster, _ = await serve(port)
        # The registry has the report before the worker reads the answer: wait for both.
        await until_async(lambda: registry.report(address) is not None and registration.registered(f"127.0.0.1:{port}"),
                          "the registration after the restart")

        await registration.stop()
        assert registry.report(address) is None and cluster.worker(address) is None  # a clean stop deregisters
    finally:
        await registration.stop()
        await server.stop(None)
        await cluster.stop()
