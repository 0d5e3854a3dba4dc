"""Several gateway processes (``--processes 2``) behind one pair of ports, with
real processes: a simulated worker (no compute) and the stock ``tritonclient``.

Asserted: every process answers the same statistics, /metrics and cluster
counters, equal to the requests sent exactly, and both processes served some
of them; placement runs in the leader only and loaded the declared (or
requested, with load on demand) model once; a load or unload sent to any
process holds in every process when it returns; a drain sent to any process
stops every process sending to the worker; SIGTERM to the parent answers the
requests in flight and stops every process, and a child that dies stops the
gateway; ``infergate up --gateway-processes 2`` lists the processes in its
ready file; what several processes cannot do yet is refused at start.

Each request goes over a fresh connection, so the kernel spreads them over
both processes; which process answered an HTTP call is in its
``X-Infergate-Process`` header.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcclient_aio
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families

from tests.harness import Proc, infergate_cmd, start, start_worker, worker_url

pytestmark = pytest.mark.timeout(180)

WAIT_S = 60.0
FAST = "probe:\n  interval_s: 0.5\nplacement:\n  interval_s: 0.3\n"
REQUESTS = 40  # per protocol


def until(condition: Callable[[], Any], what: str) -> Any:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)  # polling a condition, bounded by the deadline
    raise AssertionError(f"timed out waiting for {what}")


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def fetch(gateway: Proc, path: str) -> tuple[str, bytes]:
    """(answering process, body) of one GET over a fresh connection."""
    with urllib.request.urlopen(f"http://127.0.0.1:{gateway.ready['http_port']}{path}", timeout=30) as r:
        return r.headers["X-Infergate-Process"], r.read()


def fetch_status(gateway: Proc, path: str) -> tuple[str, int]:
    """(answering process, HTTP status) of one GET over a fresh connection."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{gateway.ready['http_port']}{path}", timeout=30) as r:
            return r.headers["X-Infergate-Process"], r.status
    except urllib.error.HTTPError as e:
        return e.headers["X-Infergate-Process"], e.code


def from_every_process(gateway: Proc, path: str) -> dict[str, list[bytes]]:
    """Ask until both processes have answered (fresh connections; bounded)."""
    answers: dict[str, list[bytes]] = {}
    for _ in range(400):
        process, body = fetch(gateway, path)
        answers.setdefault(process, []).append(body)
        if len(answers) == 2 and min(len(v) for v in answers.values()) >= 2:
            break
    assert set(answers) == {"0", "1"}, f"only processes {sorted(answers)} answered {path}"
    return answers


def simple_inputs(module: Any) -> list[Any]:
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [module.InferInput("INPUT0", [1, 16], "INT32"), module.InferInput("INPUT1", [1, 16], "INT32")]
    for i in inputs:
        i.set_data_from_numpy(a)
    return inputs


def infer_fresh(gateway: Proc, model: str = "simple") -> None:
    """One HTTP and one gRPC request, each on a new connection (the simulated worker answers zeros)."""
    http = httpclient.InferenceServerClient(f"127.0.0.1:{gateway.ready['http_port']}")
    try:
        assert http.infer(model, simple_inputs(httpclient)).as_numpy("OUTPUT0").shape == (1, 16)
    finally:
        http.close()
    grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{gateway.ready['grpc_port']}")
    try:
        assert grpc.infer(model, simple_inputs(grpcclient)).as_numpy("OUTPUT0").shape == (1, 16)
    finally:
        grpc.close()


def samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """``name``'s samples (the parser adds ``_total`` to Triton's bare counter names)."""
    return {tuple(sorted(s.labels.items())): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name in (name, f"{name}_total")}


@pytest.fixture
def worker(model_repo: Path) -> Iterator[Proc]:
    proc = start_worker(model_repo, "--backend", "sim", "--sim-latency-ms", "0", "--model-control-mode", "explicit")
    yield proc
    proc.stop()


def gateway_of(worker: Proc, tmp_path: Path, config: str, *extra: str) -> Proc:
    path = tmp_path / "gateway.yaml"
    path.write_text(FAST + config)
    return start(["gateway", "--worker", worker_url(worker), "--http-port", "0", "--grpc-port", "0",
                  "--config", str(path), "--processes", "2", *extra])


def test_every_process_answers_the_exact_whole_gateway_statistics(worker: Proc, tmp_path: Path) -> None:
    gateway = gateway_of(worker, tmp_path, "models:\n  simple: {replicas: 1}\n")
    try:
        assert len(gateway.ready["gateway_pids"]) == 2
        http = httpclient.InferenceServerClient(f"127.0.0.1:{gateway.ready['http_port']}")
        until(lambda: http.is_model_ready("simple"), "simple placed")
        http.close()
        for _ in range(REQUESTS):
            infer_fresh(gateway)
        sent = 2 * REQUESTS

        stats = from_every_process(gateway, "/v2/models/simple/stats")
        bodies = {b for v in stats.values() for b in v}
        assert len(bodies) == 1, "processes answered different statistics"
        (model,) = json.loads(bodies.pop())["model_stats"]
        assert model["inference_count"] == sent
        assert model["inference_stats"]["success"]["count"] == sent
        assert model["inference_stats"]["fail"]["count"] == 0
        assert sum(b["compute_infer"]["count"] for b in model["batch_stats"]) == model["execution_count"]
        assert sum(int(b["batch_size"]) * int(b["compute_infer"]["count"]) for b in model["batch_stats"]) == sent
        for _ in range(10):  # gRPC statistics, each over a new channel
            client = grpcclient.InferenceServerClient(f"127.0.0.1:{gateway.ready['grpc_port']}")
            try:
                (grpc_model,) = client.get_inference_statistics("simple").model_stats
            finally:
                client.close()
            assert grpc_model.inference_count == sent and grpc_model.execution_count == model["execution_count"]

        for process, texts in from_every_process(gateway, "/metrics").items():
            text = texts[-1].decode()
            success = samples(text, "nv_inference_request_success")
            assert success[(("model", "simple"), ("version", "1"))] == sent, process
            per_process = samples(text, "infergate_process_requests")
            assert sum(per_process.values()) == sent
            assert all(n > 0 for n in per_process.values()) and len(per_process) == 2, per_process
            # Placement runs in the leader only: its rounds, one load of the one declared replica.
            rounds = samples(text, "infergate_placement_rounds")
            assert rounds[(("process", "0"),)] > 0 and rounds[(("process", "1"),)] == 0, rounds
            assert samples(text, "infergate_placement_loads") == {(): 1.0}
        for texts in from_every_process(gateway, "/v2/cluster/stats").values():
            (doc,) = [m for m in json.loads(texts[-1])["models"] if m["model"] == "simple"]
            assert doc["success"] == sent and doc["inferences"] == sent
        # Each process judges light models on its own calls; /v2/cluster shows every verdict, in process order.
        views = {b for v in from_every_process(gateway, "/v2/cluster").values() for b in v}
        judged = {json.dumps([(m["light"], m["light_by_process"]) for m in json.loads(b)["models"]
                              if m["name"] == "simple"]) for b in views}
        assert len(judged) == 1, judged
        ((light, by_process),) = json.loads(judged.pop())
        agreed = set(by_process) - {None}
        assert len(by_process) == 2 and light == (agreed.pop() if len(agreed) == 1 else None), by_process
    finally:
        gateway.stop()
    assert all(gone(pid) for pid in gateway.ready["gateway_pids"])


def test_a_load_through_any_process_is_served_by_every_process(worker: Proc, tmp_path: Path) -> None:
    gateway = gateway_of(worker, tmp_path, "")
    try:
        for _ in range(6):  # fresh connections: the loads land on both processes
            client = grpcclient.InferenceServerClient(f"127.0.0.1:{gateway.ready['grpc_port']}")
            try:
                client.load_model("simple")
            finally:
                client.close()
            for _ in range(4):
                infer_fresh(gateway)
        placement = {json.loads(b)["counters"]["loads"] for v in from_every_process(
            gateway, "/v2/cluster/placement").values() for b in v}
        assert placement == {0}, "the repository load is not a placement"
        for _ in range(4):  # an unload through any process: no process serves the model when it returns
            client = grpcclient.InferenceServerClient(f"127.0.0.1:{gateway.ready['grpc_port']}")
            try:
                client.unload_model("simple")
            finally:
                client.close()
            statuses = [fetch_status(gateway, "/v2/models/simple/ready") for _ in range(10)]
            assert set(statuses) <= {("0", 400), ("1", 400)} and len(statuses) == 10, statuses
            client = grpcclient.InferenceServerClient(f"127.0.0.1:{gateway.ready['grpc_port']}")
            try:
                client.load_model("simple")
            finally:
                client.close()
    finally:
        gateway.stop()


def worker_inferences(worker: Proc, model: str) -> int:
    client = grpcclient.InferenceServerClient(worker_url(worker))
    try:
        stats = client.get_inference_statistics(model).model_stats
    except Exception:  # not loaded there
        return 0
    finally:
        client.close()
    return sum(s.inference_count for s in stats)


def test_a_model_loaded_on_demand_is_placed_once(worker: Proc, tmp_path: Path) -> None:
    gateway = gateway_of(worker, tmp_path, "", "--load-on-demand")
    try:
        for _ in range(8):  # the first request each process gets for `simple` places it
            infer_fresh(gateway)
        for texts in from_every_process(gateway, "/metrics").values():
            text = texts[-1].decode()
            assert samples(text, "infergate_placement_loads") == {(): 1.0}
            assert samples(text, "nv_inference_request_success")[(("model", "simple"), ("version", "1"))] == 16
    finally:
        gateway.stop()


def test_a_drain_through_any_process_stops_every_process_sending_there(model_repo: Path, tmp_path: Path) -> None:
    workers = [start_worker(model_repo, "--backend", "sim", "--sim-latency-ms", "0", "--model-control-mode", "explicit")
               for _ in range(2)]
    gateway = None
    try:
        path = tmp_path / "gateway.yaml"
        path.write_text(FAST + "models:\n  simple: {replicas: 1}\n")
        gateway = start(["gateway", *[a for w in workers for a in ("--worker", worker_url(w))], "--http-port", "0",
                         "--grpc-port", "0", "--config", str(path), "--processes", "2"])
        by_address = {worker_url(w): w for w in workers}

        def placed() -> list[str]:
            models = json.loads(fetch(gateway, "/v2/cluster")[1])["models"]
            return next((m["replicas"] for m in models if m["name"] == "simple"), [])

        (host,) = until(placed, "simple placed")
        for _ in range(10):
            infer_fresh(gateway)
        request = urllib.request.Request(
            f"http://127.0.0.1:{gateway.ready['http_port']}/v2/cluster/workers/{host}/drain?timeout_s=30", method="POST")
        with urllib.request.urlopen(request, timeout=60) as reply:
            answer = json.loads(reply.read())
        assert answer["state"] == "drained" and answer["moved"] == ["simple"] and answer["inflight"] == 0, answer
        before = worker_inferences(by_address[host], "simple")
        for _ in range(20):  # fresh connections: both processes
            infer_fresh(gateway)
        assert worker_inferences(by_address[host], "simple") == before
        (other,) = [w for a, w in by_address.items() if a != host]
        assert worker_inferences(other, "simple") == 40
    finally:
        if gateway is not None:
            gateway.stop()
        for w in workers:
            w.stop()


async def _inflight(gateway: Proc, n: int) -> list[Any]:
    clients = [grpcclient_aio.InferenceServerClient(f"127.0.0.1:{gateway.ready['grpc_port']}") for _ in range(n)]
    try:
        calls = [asyncio.ensure_future(c.infer("simple", simple_inputs(grpcclient))) for c in clients]

        def held() -> bool:
            _, body = fetch(gateway, "/v2/cluster/stats")
            doc = json.loads(body)
            return (sum(w["inflight"] for w in doc["workers"]) + sum(m["queue_depth"] for m in doc["models"])) == n

        await asyncio.get_running_loop().run_in_executor(None, until, held, "every request in the gateway")
        gateway.popen.send_signal(15)
        return await asyncio.gather(*calls, return_exceptions=True)
    finally:
        await asyncio.gather(*(c.close() for c in clients))


def test_sigterm_answers_requests_in_flight_and_stops_every_process(model_repo: Path, tmp_path: Path) -> None:
    worker = start_worker(model_repo, "--backend", "sim", "--sim-latency-ms", "400")
    gateway = None
    try:
        gateway = gateway_of(worker, tmp_path, "", "--batching", "off")
        results = asyncio.run(_inflight(gateway, 8))
        assert [str(r) for r in results if isinstance(r, BaseException)] == []
        assert gateway.popen.wait(timeout=60) == 0, gateway.log()[-4000:]
        assert all(gone(pid) for pid in gateway.ready["gateway_pids"])
    finally:
        if gateway is not None:
            gateway.stop(check=False)
        worker.stop()


def test_up_runs_several_gateway_processes(model_repo: Path) -> None:
    up = start(["up", "--workers", "1", "--gateway-processes", "2", "--model-repository", str(model_repo),
                "--http-port", "0", "--grpc-port", "0", "--worker-arg=--backend=sim", "--worker-arg=--sim-latency-ms=0"])
    try:
        pids = up.ready["gateway_pids"]
        assert len(pids) == 2 and up.pid not in pids
        for _ in range(10):
            infer_fresh(up)
        (model,) = json.loads(fetch(up, "/v2/models/simple/stats")[1])["model_stats"]
        assert model["inference_count"] == 20
        # Whatever process answers /v2/cluster, the worker's devices are read from its metrics.
        for process, bodies in from_every_process(up, "/v2/cluster").items():
            assert all(w["devices"] for b in bodies for w in json.loads(b)["workers"]), process
    finally:
        up.stop()
    assert all(gone(pid) for pid in pids + [w["pid"] for w in up.ready["workers"]])


@pytest.mark.parametrize(("flags", "config", "message"), [
    (["--processes", "-1"], "", "--processes must be >= 0"),
    (["--processes", "2"], "models:\n  mlp_tp2: {from: mlp, tensor_parallel: 2}\n", "need one gateway process"),
])
def test_what_several_processes_cannot_do_is_refused_at_start(
    model_repo: Path, tmp_path: Path, flags: list[str], config: str, message: str
) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text(config)
    result = subprocess.run(
        infergate_cmd("gateway", "--http-port", "0", "--grpc-port", "0", "--config", str(path),
                      "--model-repository", str(model_repo), *flags),
        capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2 and message in result.stderr, result.stderr[-2000:]


def test_a_gateway_process_that_dies_stops_the_whole_gateway(worker: Proc, tmp_path: Path) -> None:
    gateway = gateway_of(worker, tmp_path, "")
    try:
        pids = gateway.ready["gateway_pids"]
        os.kill(pids[1], 9)
        assert gateway.popen.wait(timeout=60) == 1, gateway.log()[-4000:]
        assert all(gone(pid) for pid in pids)
    finally:
        gateway.stop(check=False)
