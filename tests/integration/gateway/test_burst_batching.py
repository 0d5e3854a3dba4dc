"""A burst batches up: 200 single-row ``mlp`` calls at once over one ``grpc.aio`` channel
against ``infergate up --workers 2`` run in few worker executions, counted from the
workers' own statistics (``execution_count``), on the gateway's first burst as on later ones.

The bound comes from the policy (gateway/batching/batcher.py, adaptive mode
with a burst hold, and gateway/routing/capacity.py), not from a measurement:

* Before the burst shows, each request that finds a replica idle goes at
  once. A model not judged yet counts as light, so a replica is busy at one
  batch: about ``REPLICAS`` such batches before an arrival finds every
  replica busy (the burst begins). On a loaded machine the client may send
  so slowly that replicas finish between arrivals (then nothing is a burst
  yet), so the test reads how many batches went at once from the gateway's
  counter ``infergate_batches_sent_at_once`` instead of assuming
  ``REPLICAS``; at least one batch must have been held.
* From then on, until the model is idle, a batch goes when it has
  ``max_batch_size`` rows (at most ``ceil(N / 64)`` of those), when its
  oldest request has waited the hold, or when no row came for a quarter of
  the hold. A batch takes every queued row, so the next short batch's oldest
  request arrived after it formed, and that batch goes a quarter of the hold
  after that arrival at the earliest: short batches form at least a quarter
  of the hold apart, at most ``1 + T / (hold / 4)`` of them in a burst whose
  arrivals span ``T`` (the client's whole burst time bounds it).
* One more short batch may go without that wait: a hold also ends once as
  many requests are in the gateway as the most the previous second saw at
  once (closed-loop clients all in). A burst's calls are then all in, so
  that batch takes every queued row (up to ``max_batch_size``): once per burst.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.grpc import service_pb2, service_pb2_grpc

from tests.harness import Proc, start
from tests.integration.burst import Rows, grpc_burst

pytestmark = pytest.mark.timeout(180)

CALLS = 200
REPLICAS = 2
MAX_BATCH_SIZE = 64  # models/mlp/config.pbtxt
HOLD_S = 0.04


@pytest.fixture(scope="module")
def cluster(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    config = tmp_path_factory.mktemp("burst_batching") / "gateway.yaml"
    config.write_text(f"batching:\n  burst_hold_us: {int(HOLD_S * 1e6)}\n")
    proc = start(["up", "--workers", str(REPLICAS), "--model-repository", str(model_repo), "--http-port", "0",
                  "--grpc-port", "0", "--no-worker-token", "--config", str(config)])
    try:
        yield proc
    finally:
        proc.stop()


async def executions(cluster: Proc) -> int:
    total = 0
    for worker in cluster.ready["workers"]:
        async with grpc.aio.insecure_channel(worker["address"]) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            stats = await stub.ModelStatistics(service_pb2.ModelStatisticsRequest(name="mlp"), timeout=30)
            total += sum(m.execution_count for m in stats.model_stats)
    return total


def sent_at_once(cluster: Proc) -> int:
    text = requests.get(f"http://127.0.0.1:{cluster.ready['http_port']}/metrics", timeout=30).text
    return round(sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
                     if sample.name == "infergate_batches_sent_at_once_total" and sample.labels.get("model") == "mlp"))


@pytest.mark.parametrize("burst", ["first", "second"])
async def test_a_burst_of_single_rows_runs_in_few_executions(cluster: Proc, model_repo: Path, burst: str) -> None:
    rows = Rows.for_repository(model_repo)
    before, at_once_before = await executions(cluster), sent_at_once(cluster)
    started = time.perf_counter()
    tally = await grpc_burst(f"127.0.0.1:{cluster.ready['grpc_port']}", rows, CALLS)
    span_s = time.perf_counter() - started
    ran = await executions(cluster) - before
    at_once = sent_at_once(cluster) - at_once_before
    tally.check(CALLS)
    assert tally.served == CALLS, tally
    bound = at_once + math.ceil(CALLS / MAX_BATCH_SIZE) + 2 + math.floor(span_s / (HOLD_S / 4))
    print(f"{burst} burst: {CALLS} calls in {ran} executions ({at_once} sent at once) over {span_s * 1000:.0f} ms "
          f"(bound {bound})")
    assert at_once < ran <= bound
