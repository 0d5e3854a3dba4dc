"""Prefix-aware routing of generation (gateway/routing/prefix.py) with two real
workers serving ``tiny_lm`` behind ``infergate up``: prompts that share their
opening bytes land on one worker, as the workers' own statistics count them
and the gateway's ``infergate_prefix_routes_total`` says; distinct prompts
sent together spread over both."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from tests.harness import Proc, start
from tests.integration.gateway.stream_clients import metric
from tests.integration.workers.gen_client import GenStream

pytestmark = pytest.mark.timeout(120)

SHARED = "System: you are a terse assistant; answer in one short line, no more. Question: "


@pytest.fixture(scope="module")
def cluster(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    repo = tmp_path_factory.mktemp("prefix-routing")
    shutil.copytree(model_repo / "tiny_lm", repo / "tiny_lm")
    proc = start(["up", "--workers", "2", "--model-repository", str(repo), "--http-port", "0", "--grpc-port", "0",
                  "--no-worker-token"])  # the test reads the workers' statistics itself
    try:
        assert len(proc.ready["workers"]) == 2
        yield proc
    finally:
        proc.stop()


def served(proc: Proc) -> dict[str, int]:
    """Requests of ``tiny_lm`` each worker has served, from its own statistics."""
    counts = {}
    for worker in proc.ready["workers"]:
        with grpc.insecure_channel(worker["address"]) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            stats = stub.ModelStatistics(service_pb2.ModelStatisticsRequest(name="tiny_lm"), timeout=30)
            counts[worker["address"]] = sum(m.inference_count for m in stats.model_stats)
    return counts


def routes(proc: Proc) -> dict[str, float]:
    """The gateway's prefix routes by outcome, from its /metrics."""
    url = f"127.0.0.1:{proc.ready['http_port']}"
    return {k: metric(url, "infergate_prefix_routes_total", f'outcome="{k}"') for k in ("followed", "new", "diverted")}


def delta(before: dict[str, int], after: dict[str, int]) -> list[int]:
    return [after[a] - before[a] for a in sorted(before)]


def test_prompts_sharing_a_prefix_land_on_one_worker(cluster: Proc) -> None:
    stream = GenStream(f"127.0.0.1:{cluster.ready['grpc_port']}")
    try:
        before, routed = served(cluster), routes(cluster)
        for i in range(6):
            g = stream.generate("tiny_lm", f"shared-{i}", f"{SHARED}what is {i} plus {i}?", max_tokens=4)
            assert g.error is None and g.finish_reason in ("stop", "length")
        assert sorted(delta(before, served(cluster))) == [0, 6]
        # The gateway's /metrics count it: one new prefix, then five prompts that followed it.
        now = routes(cluster)
        assert {k: now[k] - routed[k] for k in now} == {"followed": 5, "new": 1, "diverted": 0}
        remembered = metric(f"127.0.0.1:{cluster.ready['http_port']}", "infergate_prefix_routes_remembered")
        assert remembered >= 1
    finally:
        stream.close()


def test_distinct_prefixes_sent_together_spread_over_both_workers(cluster: Proc) -> None:
    stream = GenStream(f"127.0.0.1:{cluster.ready['grpc_port']}")
    try:
        before = served(cluster)
        pending = [stream.send("tiny_lm", f"distinct-{i}", f"{i} is the number of this prompt", max_tokens=48)
                   for i in range(6)]
        for g in pending:
            assert g.done.wait(60) and g.error is None
        counts = delta(before, served(cluster))
        assert sum(counts) == 6 and min(counts) >= 1, counts
    finally:
        stream.close()
