"""Cluster and router against real worker processes: discovery, spreading
batches over replicas, surviving a worker killed mid-stream, and taking a
restarted worker back (same port through probing, new port through add_worker).
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from tritonclient.grpc import service_pb2

from gateway.fleet.cluster import Cluster, WorkerStatus
from gateway.routing.router import Router
from gateway.settings import WorkerSpec
from protos.errors import InferGateError
from tests.harness import Proc, start_worker, worker_url

pytestmark = pytest.mark.timeout(240)

WAIT_S = 60.0


class Workers:
    """Worker processes of one test; teardown stops the live ones and checks a clean exit."""

    def __init__(self, repo: Path) -> None:
        self.repo = repo
        self.procs: list[Proc] = []
        self.killed: set[int] = set()

    def start(self, n: int = 1, *extra: str) -> list[Proc]:
        with ThreadPoolExecutor(n) as pool:
            procs = list(pool.map(lambda _: start_worker(self.repo, *extra), range(n)))
        self.procs.extend(procs)
        return procs

    def kill(self, proc: Proc) -> None:
        proc.kill(signal.SIGKILL)
        self.killed.add(proc.pid)

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.pid not in self.killed:
                proc.stop()


@pytest.fixture
def workers(model_repo: Path) -> Iterator[Workers]:
    group = Workers(model_repo)
    try:
        yield group
    finally:
        group.stop_all()


@pytest.fixture(scope="module")
def mlp_reference(model_repo: Path) -> Callable[[np.ndarray], np.ndarray]:
    session = ort.InferenceSession(str(model_repo / "mlp" / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    return lambda x: session.run(["OUTPUT"], {"INPUT": x})[0]


def mlp_request(x: np.ndarray) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="mlp")
    request.inputs.add(name="INPUT", datatype="FP32", shape=list(x.shape))
    request.outputs.add(name="OUTPUT")
    request.raw_input_contents.append(x.tobytes())
    return request


def mlp_output(response: service_pb2.ModelInferResponse) -> np.ndarray:
    (out,) = response.outputs
    assert out.name == "OUTPUT" and out.datatype == "FP32"
    return np.frombuffer(response.raw_output_contents[0], dtype=np.float32).reshape(list(out.shape))


async def until(condition: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    """Wait for a condition the cluster's probing or the traffic makes true (polled, bounded)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while not condition():
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def test_discovers_models_and_spreads_batches(
    workers: Workers, mlp_reference: Callable[[np.ndarray], np.ndarray]
) -> None:
    p1, p2 = workers.start(2)
    addresses = [worker_url(p1), worker_url(p2)]
    cluster = Cluster([WorkerSpec(a) for a in addresses], probe_interval_s=0.5)
    await cluster.start()
    try:
        models = cluster.models()
        assert {"simple", "mlp", "cnn", "encoder"} <= set(models)
        mlp = models["mlp"]
        assert [w.address for w in mlp.replicas] == addresses
        assert mlp.config.max_batch_size == 64
        assert [t.name for t in mlp.metadata.inputs] == ["INPUT"]
        assert mlp.versions == ("1",)

        router = Router(cluster, max_inflight_per_replica=2)
        rng = np.random.default_rng(0)
        inputs = [rng.standard_normal((int(rng.integers(1, 9)), 64), dtype=np.float32) for _ in range(24)]
        loop = asyncio.get_running_loop()
        responses = await asyncio.gather(
            *(router.infer("mlp", "", mlp_request(x), loop.time() + WAIT_S) for x in inputs)
        )
        for x, response in zip(inputs, responses):
            np.testing.assert_allclose(mlp_output(response), mlp_reference(x), rtol=1e-4, atol=1e-4)
        sent = {w.address: w.sent for w in cluster.workers()}
        assert sum(sent.values()) == len(inputs)
        assert all(n > 0 for n in sent.values()), sent
        assert all(w.inflight == 0 and w.failures == 0 for w in cluster.workers())
    finally:
        await cluster.stop()


async def test_each_replica_is_sent_as_many_batches_as_it_executes_at_once(workers: Workers) -> None:
    # Three execution threads: a model with no instance group gets three instances, and
    # the gateway, reading the served config, keeps three batches running plus one waiting.
    wide, = workers.start(1, "--execution-threads", "3", "--intra-op-threads", "1")
    narrow, = workers.start(1, "--execution-threads", "1", "--intra-op-threads", "1")
    cluster = Cluster([WorkerSpec(worker_url(wide)), WorkerSpec(worker_url(narrow))], probe_interval_s=0.5)
    await cluster.start()
    router = Router(cluster)
    try:
        w, n = cluster.workers()
        assert sum(g.count for g in w.models["cnn"].config.instance_group) == 3
        assert (w.models["cnn"].slots, n.models["cnn"].slots) == (3, 1)
        assert router.limits(w, "cnn") == (3, 4) and router.limits(n, "cnn") == (1, 2)
        # The example configs name no instance group; simple's one is its CPU default too.
        assert n.models["simple"].slots == 1
    finally:
        router.close()
        await cluster.stop()


class Stream:
    """Clients calling router.infer in a loop; every outcome is recorded, nothing is raised."""

    def __init__(self, router: Router, clients: int) -> None:
        self.router = router
        self.ok = 0
        self.errors: list[BaseException] = []
        self.running = True
        self.x = np.ones((4, 64), dtype=np.float32)
        self.tasks = [asyncio.create_task(self._client()) for _ in range(clients)]

    async def _client(self) -> None:
        loop = asyncio.get_running_loop()
        while self.running:
            try:
                response = await self.router.infer("mlp", "", mlp_request(self.x), loop.time() + WAIT_S)
                assert mlp_output(response).shape == (4, 10)
                self.ok += 1
            except (InferGateError, AssertionError) as e:
                self.errors.append(e)
                # A call that fails before its first await would otherwise starve the loop.
                await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self.running = False
        await asyncio.gather(*self.tasks)


async def test_worker_killed_mid_stream_then_restarted_on_same_port(workers: Workers) -> None:
    p1, p2 = workers.start(2)
    victim = worker_url(p1)
    port = p1.ready["grpc_port"]
    cluster = Cluster([WorkerSpec(victim), WorkerSpec(worker_url(p2))], probe_interval_s=0.1, failures_to_down=2)
    await cluster.start()
    router = Router(cluster, max_inflight_per_replica=2)
    stream = Stream(router, clients=6)
    try:
        victim_state, survivor = cluster.worker(victim), cluster.worker(worker_url(p2))
        assert victim_state is not None and survivor is not None
        await until(lambda: victim_state.sent >= 5 and survivor.sent >= 5, "traffic on both workers")

        workers.kill(p1)
        ok_at_kill = stream.ok
        await until(lambda: victim_state.state is WorkerStatus.DOWN, "the killed worker marked DOWN")
        await until(lambda: stream.ok >= ok_at_kill + 50, "50 more answers after the kill")
        assert stream.errors == [], stream.errors[:3]

        # Same address again: the periodic probe must bring it back by itself.
        await asyncio.to_thread(workers.start, 1, "--port", str(port))
        await until(lambda: victim_state.state is WorkerStatus.READY, "the restarted worker READY")
        sent_when_back = victim_state.sent
        await until(lambda: victim_state.sent >= sent_when_back + 5, "traffic on the restarted worker")
        await stream.stop()
        assert stream.errors == [], stream.errors[:3]
        assert len(cluster.models()["mlp"].replicas) == 2
    finally:
        await stream.stop()
        await cluster.stop()


async def test_worker_added_at_runtime_and_dead_one_removed(workers: Workers) -> None:
    (first,) = workers.start(1)
    cluster = Cluster([WorkerSpec(worker_url(first))], probe_interval_s=0.2)
    await cluster.start()
    router = Router(cluster, max_inflight_per_replica=2)
    stream = Stream(router, clients=4)
    try:
        assert len(cluster.healthy("mlp")) == 1
        (second,) = await asyncio.to_thread(workers.start, 1)
        added = await cluster.add_worker(WorkerSpec(worker_url(second)))
        # add_worker probes before it returns: the worker serves at once.
        assert added.state is WorkerStatus.READY
        assert len(cluster.healthy("mlp")) == 2
        await until(lambda: added.sent >= 5, "traffic on the added worker")

        workers.kill(first)
        ok_at_kill = stream.ok
        await until(lambda: stream.ok >= ok_at_kill + 30, "30 more answers after the kill")
        assert await cluster.remove_worker(worker_url(first))
        assert [w.address for w in cluster.healthy("mlp")] == [worker_url(second)]
        await stream.stop()
        assert stream.errors == [], stream.errors[:3]
    finally:
        await stream.stop()
        await cluster.stop()
