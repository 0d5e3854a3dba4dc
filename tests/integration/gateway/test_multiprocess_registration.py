"""Self-registering workers (``infergate worker --gateway``) with several gateway
processes: a worker keeps one channel, so its calls land on one process, and
every process must know it anyway.

Asserted with real processes (simulated workers, a 2-process gateway, the
stock ``tritonclient``): a registration is listed by every process and every
process serves requests on the worker; its heartbeats keep it in every
process's cluster well past the heartbeats-to-down window; a clean stop's
deregistration takes it out of every process; ``infergate up --register
--gateway-processes 2`` starts, with its worker known to both processes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import tritonclient.http as httpclient

from tests.harness import Proc, start, start_worker
from tests.integration.gateway.test_multiprocess import FAST, fetch, infer_fresh, until
from tests.integration.gateway.test_multiprocess_settings import served_by_every_process

pytestmark = pytest.mark.timeout(240)

HEARTBEAT_S = 0.2
MISSES = 3


def listed_by(gateway: Proc, address: str) -> set[str]:
    """The processes that listed ``address`` as an up worker, among the answers to fresh-connection GETs."""
    seen: dict[str, bool] = {}
    for _ in range(200):
        process, body = fetch(gateway, "/v2/cluster")
        seen[process] = seen.get(process, False) or any(
            w["address"] == address and w["state"] != "down" for w in json.loads(body)["workers"])
        if len(seen) == 2:
            break
    assert len(seen) == 2, f"only processes {sorted(seen)} answered"
    return {p for p, listed in seen.items() if listed}


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[Proc]:
    path = tmp_path / "gateway.yaml"
    path.write_text(FAST + f"membership:\n  heartbeat_interval_s: {HEARTBEAT_S}\n  heartbeat_misses_to_down: {MISSES}\n")
    proc = start(["gateway", "--http-port", "0", "--grpc-port", "0", "--config", str(path), "--processes", "2"])
    yield proc
    proc.stop()


def test_a_worker_registered_with_one_process_is_known_to_every_process(model_repo: Path, gateway: Proc) -> None:
    worker = start_worker(model_repo, "--backend", "sim", "--sim-latency-ms", "0",
                          "--gateway", f"127.0.0.1:{gateway.ready['grpc_port']}")
    stopped = False
    try:
        address = f"127.0.0.1:{worker.ready['grpc_port']}"
        until(lambda: listed_by(gateway, address) == {"0", "1"}, "the worker listed by both processes")
        http = httpclient.InferenceServerClient(f"127.0.0.1:{gateway.ready['http_port']}")
        try:
            until(lambda: http.is_model_ready("simple"), "simple ready")
        finally:
            http.close()
        served_by_every_process(gateway, lambda: infer_fresh(gateway))

        # Heartbeats reach every process: no process drops the worker over several down windows.
        watched_until = time.monotonic() + 4 * HEARTBEAT_S * MISSES
        while time.monotonic() < watched_until:  # an observation window, not a readiness wait
            assert listed_by(gateway, address) == {"0", "1"}

        worker.stop()
        stopped = True
        assert listed_by(gateway, address) == set(), "the deregistration reached every process"
    finally:
        if not stopped:
            worker.stop()


def test_up_registers_its_workers_with_several_gateway_processes(model_repo: Path) -> None:
    up = start(["up", "--workers", "1", "--register", "--gateway-processes", "2", "--model-repository",
                str(model_repo), "--http-port", "0", "--grpc-port", "0", "--worker-arg=--backend=sim",
                "--worker-arg=--sim-latency-ms=0"])
    try:
        assert len(up.ready["gateway_pids"]) == 2
        (worker,) = up.ready["workers"]
        assert listed_by(up, worker["address"]) == {"0", "1"}
        served_by_every_process(up, lambda: infer_fresh(up))
    finally:
        up.stop()
