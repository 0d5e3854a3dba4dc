"""Bursts with real processes: thousands of calls at once to ``infergate up``
(two ONNX Runtime workers, ``mlp``, the default configuration).

Asserted for each burst (gRPC from one channel, from several channels, and
HTTP with one connection per call): every call is served -- with the model's
own output for its row -- or refused at once with a status a client retries
(UNAVAILABLE / RESOURCE_EXHAUSTED / 503 / 429) carrying a retry hint; never
CANCELLED, never a connection reset, never another error. The gateway's
resident memory stays within a stated growth bound, it serves normally right
after, and a client that retries refusals after their hint gets every call
answered.

The worker side: a burst straight at a worker, and one the gateway forwards
(batching off, no per-replica bound), end the same way.

The 10,000-call variants are marked ``slow`` (run them with ``--run-slow``).
Counts are printed, not asserted, beyond "every call accounted for".
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import Proc, start
from tests.integration.burst import PeakRss, Rows, grpc_burst, http_burst, retrying_grpc_burst, rss_mb

pytestmark = pytest.mark.timeout(240)

BURST = 3000
BIG_BURST = 10_000
# Through every burst of the module, one after another, the gateway's resident memory stays
# within this much of its idle size at start: bounded, and nothing accumulates from burst to
# burst (measured on 2 cores: peaks about +45 MB over 3,000-call bursts, up to +200 MB over 10,000).
RSS_GROWTH_BOUND_MB = 128.0
BIG_RSS_GROWTH_BOUND_MB = 320.0
# A small queue, so that a burst of 3,000 is partly refused even where the workers are fast.
CLUSTER_CONFIG = """
models:
  mlp: {max_queue_size: 64}
"""
# Forwards every request to a worker at once: no batching, no bound on calls per replica.
FORWARDING_CONFIG = """
batching: {max_inflight_per_replica: 100000}
models:
  mlp: {mode: "off"}
"""


@pytest.fixture(scope="module")
def cluster(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    config = tmp_path_factory.mktemp("burst") / "gateway.yaml"
    config.write_text(CLUSTER_CONFIG)
    proc = start(["up", "--workers", "2", "--model-repository", str(model_repo), "--http-port", "0",
                  "--grpc-port", "0", "--no-worker-token", "--config", str(config), "--worker-arg=--max-queue-size=64"])
    try:
        proc.ready["idle_rss_mb"] = rss_mb(proc.pid)
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def rows(model_repo: Path) -> Rows:
    return Rows.for_repository(model_repo)


def _grpc(cluster: Proc) -> str:
    return f"127.0.0.1:{cluster.ready['grpc_port']}"


def _http(cluster: Proc) -> str:
    return f"http://127.0.0.1:{cluster.ready['http_port']}"


def _check_memory(cluster: Proc, rss: PeakRss, bound_mb: float = RSS_GROWTH_BOUND_MB) -> None:
    idle = cluster.ready["idle_rss_mb"]
    assert rss.peak_mb < idle + bound_mb, f"gateway RSS peaked at {rss.peak_mb:.0f} MB, idle {idle:.0f} MB"


async def _serves_normally(cluster: Proc, rows: Rows) -> None:
    after = await grpc_burst(_grpc(cluster), rows, 16)
    assert after.served == 16, after
    after = await http_burst(_http(cluster), rows, 16)
    assert after.served == 16, after


@pytest.mark.parametrize("channels", [1, 8])
async def test_grpc_burst_is_served_or_refused_with_a_hint(cluster: Proc, rows: Rows, channels: int) -> None:
    async with PeakRss(cluster.pid) as rss:
        tally = await grpc_burst(_grpc(cluster), rows, BURST, channels)
    print(f"gRPC {BURST} calls / {channels} channel(s): {tally}; gateway RSS +{rss.growth_mb:.0f} MB, peak {rss.peak_mb:.0f} MB")
    tally.check(BURST)
    _check_memory(cluster, rss)
    await _serves_normally(cluster, rows)
    # What a burst held is given back: the same burst again stays within the same bound.
    async with PeakRss(cluster.pid) as again:
        tally = await grpc_burst(_grpc(cluster), rows, BURST, channels)
    print(f"again: {tally}; gateway RSS peak {again.peak_mb:.0f} MB (first burst: {rss.peak_mb:.0f} MB)")
    tally.check(BURST)
    _check_memory(cluster, again)


async def test_http_burst_is_served_or_refused_with_a_hint(cluster: Proc, rows: Rows) -> None:
    async with PeakRss(cluster.pid) as rss:
        tally = await http_burst(_http(cluster), rows, BURST)
    print(f"HTTP {BURST} connections: {tally}; gateway RSS +{rss.growth_mb:.0f} MB, peak {rss.peak_mb:.0f} MB")
    tally.check(BURST)
    _check_memory(cluster, rss)
    await _serves_normally(cluster, rows)


async def test_a_client_that_retries_refusals_gets_every_call_served(cluster: Proc, rows: Rows) -> None:
    served, other = await retrying_grpc_burst(_grpc(cluster), rows, BURST)
    assert not other, other.most_common(5)
    assert served == BURST


async def test_burst_straight_at_a_worker(cluster: Proc, rows: Rows) -> None:
    worker = cluster.ready["workers"][0]["address"]
    tally = await grpc_burst(worker, rows, BURST)
    print(f"worker, gRPC {BURST} calls: {tally}")
    tally.check(BURST)


async def test_burst_forwarded_to_the_workers(cluster: Proc, rows: Rows, tmp_path: Path) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text(FORWARDING_CONFIG)
    workers = [arg for w in cluster.ready["workers"] for arg in ("--worker", w["address"])]
    gateway = start(["gateway", *workers, "--http-port", "0", "--grpc-port", "0", "--config", str(config)])
    try:
        tally = await grpc_burst(f"127.0.0.1:{gateway.ready['grpc_port']}", rows, BURST)
        print(f"forwarded, gRPC {BURST} calls: {tally}")
        tally.check(BURST)
        after = await grpc_burst(f"127.0.0.1:{gateway.ready['grpc_port']}", rows, 16)
        assert after.served == 16, after
    finally:
        gateway.stop()


@pytest.mark.slow
@pytest.mark.parametrize("channels", [1, 16])
async def test_big_grpc_burst(cluster: Proc, rows: Rows, channels: int) -> None:
    async with PeakRss(cluster.pid) as rss:
        tally = await grpc_burst(_grpc(cluster), rows, BIG_BURST, channels)
    print(f"gRPC {BIG_BURST} calls / {channels} channel(s): {tally}; gateway RSS +{rss.growth_mb:.0f} MB, peak {rss.peak_mb:.0f} MB")
    tally.check(BIG_BURST)
    _check_memory(cluster, rss, BIG_RSS_GROWTH_BOUND_MB)
    await _serves_normally(cluster, rows)


@pytest.mark.slow
async def test_big_http_burst(cluster: Proc, rows: Rows) -> None:
    async with PeakRss(cluster.pid) as rss:
        tally = await http_burst(_http(cluster), rows, BIG_BURST)
    print(f"HTTP {BIG_BURST} connections: {tally}; gateway RSS +{rss.growth_mb:.0f} MB, peak {rss.peak_mb:.0f} MB")
    tally.check(BIG_BURST)
    _check_memory(cluster, rss, BIG_RSS_GROWTH_BOUND_MB)
    await _serves_normally(cluster, rows)


def _listen_backlog(port: int) -> int:
    """The backlog of the socket listening on ``port`` (``ss`` shows it as Send-Q)."""
    out = subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True, check=True).stdout
    return max(int(line.split()[2]) for line in out.splitlines())


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")
def test_listeners_hold_thousands_of_connects_at_once(cluster: Proc) -> None:
    # A connect that finds the accept queue full is dropped, and the client tries again a second or more later.
    wanted = min(4096, int(Path("/proc/sys/net/core/somaxconn").read_text()))
    assert _listen_backlog(cluster.ready["http_port"]) >= wanted
    assert _listen_backlog(cluster.ready["grpc_port"]) >= wanted
