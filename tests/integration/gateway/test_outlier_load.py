"""Latency outliers with real processes: a burst of the gateway's own making ejects no
worker, while a worker truly slowed (a delay in its backend) still is ejected.

Simulated accelerators (``--backend sim``) serve ``mlp`` (its config, no
model run: every batch takes a fixed time plus a time per row). Two healthy
workers of one speed per batch, one with a single execution instance and one
with four: under a burst the gateway keeps a batch waiting on each busy
worker, and on the one-instance worker that batch waits out a whole
execution first, so its calls take about twice the other's -- latency the
gateway's own queueing causes. The latency rule is set sharp (2 times the
peers' median, 20 ms over it) so that a worker judged against peers at
another load would be ejected (the old rule ejected the one-instance worker
at 56 ms against 22 ms), yet CPU contention on a loaded machine (1.5 times
at moments) is not. Ejections are read from ``/metrics``
(``infergate_worker_ejections_total``), not from timing or logs.
"""

from __future__ import annotations

import asyncio
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.harness import Proc, start, start_together, start_worker, worker_url
from tests.integration.burst import Rows, grpc_burst
from tests.integration.gateway.e2e_cluster import http_url

pytestmark = pytest.mark.timeout(240)

# Batches of at most 8 rows: a burst is many batches, many latency samples.
OUTLIER_CONFIG = """
models:
  mlp: {max_batch_size: 8}
outlier:
  latency_factor: 2.0
  latency_min_excess_s: 0.02
"""


def sim_repo(model_repo: Path, tmp_path_factory: pytest.TempPathFactory, instances: int) -> Path:
    repo = tmp_path_factory.mktemp(f"sim_mlp{instances}")
    (repo / "mlp" / "1").mkdir(parents=True)
    config = (model_repo / "mlp" / "config.pbtxt").read_text()
    (repo / "mlp" / "config.pbtxt").write_text(config + f"instance_group {{ count: {instances} kind: KIND_CPU }}\n")
    return repo


@pytest.fixture(scope="module")
def repos(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    return {n: sim_repo(model_repo, tmp_path_factory, n) for n in (1, 4)}


def sim_worker(repo: Path, latency_ms: float) -> Proc:
    return start_worker(repo, "--backend", "sim", "--sim-latency-ms", str(latency_ms), "--sim-per-row-us", "500")


@pytest.fixture
def gateway_of(tmp_path: Path) -> Iterator:
    procs: list[Proc] = []

    def make(*workers: Proc) -> Proc:
        config = tmp_path / "gateway.yaml"
        config.write_text(OUTLIER_CONFIG)
        args = ["gateway", "--http-port", "0", "--grpc-port", "0", "--config", str(config)]
        for worker in workers:
            args += ["--worker", worker_url(worker)]
        procs.append(start(args))
        return procs[-1]

    yield make
    for proc in procs:
        proc.stop()


def latency_ejections(proc: Proc) -> int:
    with urllib.request.urlopen(f"http://{http_url(proc)}/metrics", timeout=30) as answer:
        text = answer.read().decode()
    return sum(int(float(v)) for v in re.findall(r'infergate_worker_ejections_total\{[^}]*reason="latency"[^}]*\} (\S+)', text))


async def sequential(address: str, rows: Rows, calls: int) -> None:
    for _ in range(calls):
        tally = await grpc_burst(address, rows, 1)
        assert tally.served + sum(tally.refused.values()) == 1, tally


@pytest.fixture(scope="module")
def rows(model_repo: Path) -> Rows:
    return Rows.for_repository(model_repo)


def served_zeros(rows: Rows) -> Rows:
    """The sim answers zeros: the rows to check answers against."""
    return Rows(rows.inputs, np.zeros_like(rows.outputs))


async def test_a_burst_of_the_gateways_making_ejects_no_worker(repos: dict[int, Path], rows: Rows, gateway_of) -> None:
    workers = start_together([lambda: sim_worker(repos[1], 20), lambda: sim_worker(repos[4], 20)])
    try:
        proc = gateway_of(*workers)
        address = f"127.0.0.1:{proc.ready['grpc_port']}"
        zeros = served_zeros(rows)
        await sequential(address, zeros, 40)  # both judged at rest first: single rows, one batch each
        for _ in range(3):
            tally = await grpc_burst(address, zeros, 1000, channels=4)
            tally.check(1000)
        await sequential(address, zeros, 20)
        assert latency_ejections(proc) == 0
    finally:
        for worker in workers:
            worker.stop()


async def test_a_truly_slow_worker_is_still_ejected(repos: dict[int, Path], rows: Rows, gateway_of) -> None:
    workers = start_together([lambda: sim_worker(repos[1], 20), lambda: sim_worker(repos[4], 20),
                              lambda: sim_worker(repos[1], 100)])
    try:
        proc = gateway_of(*workers)
        address = f"127.0.0.1:{proc.ready['grpc_port']}"
        zeros = served_zeros(rows)
        for _ in range(60):
            await sequential(address, zeros, 1)
            if latency_ejections(proc):
                break
            await asyncio.sleep(0)
        assert latency_ejections(proc) >= 1
    finally:
        for worker in workers:
            worker.stop()
