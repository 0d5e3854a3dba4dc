"""One routing path for batches and streams (gateway/routing/router.py, tries.py, attempts.py):
a replica written here in a few lines (no gRPC) serves both through the router; a replica
failing every stream is ejected exactly as one failing every batch is; stream retries are
bounded by the same retry budget. The cluster is real; no sockets.
"""

from __future__ import annotations

import random
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing

import pytest
from tritonclient.grpc import model_config_pb2, service_pb2

from gateway.fleet.cluster import Cluster
from gateway.replicas.errors import PingsRefused
from gateway.replicas.replica import Replica, StreamItem
from gateway.routing.outlier import CircuitState, OutlierDetector
from gateway.routing.retry_budget import RetryBudget
from gateway.routing.router import Router
from gateway.settings import WorkerSpec
from protos.errors import Unavailable
from protos.triton_words import is_final, set_final


class CountingReplica:
    """A replica of model "m": a batch's answer names it; a stream counts to the request's ``n``.

    With ``failing`` set, every batch and every stream fails with UNAVAILABLE before any answer
    (the replica answered, so it is not unreachable: the outlier detector judges it).
    """

    def __init__(self, spec: WorkerSpec, failing: bool = False) -> None:
        self.address, self.kind, self.failing = spec.address, "test", failing
        self.closed = False
        self.calls = 0

    async def infer(self, request: object, timeout_s: float | None = None) -> service_pb2.ModelInferResponse:
        self.calls += 1
        if self.failing:
            raise Unavailable(f"replica {self.address} is failing")
        return service_pb2.ModelInferResponse(model_name="m", id=self.address)

    async def stream(self, request: service_pb2.ModelInferRequest, timeout_s: float | None
                     ) -> AsyncIterator[StreamItem]:  # fmt: skip
        self.calls += 1
        if self.failing:
            raise Unavailable(f"replica {self.address} is failing")
        n = request.parameters["n"].int64_param
        for i in range(n):
            response = service_pb2.ModelInferResponse(model_name="m", id=f"{self.address}/{i}")
            set_final(response, i == n - 1)
            yield response, time.monotonic()

    async def data_lane_ready(self, timeout_s: float) -> None:
        return None

    async def server_live(self, timeout_s: float | None = None) -> bool:
        return True

    async def server_ready(self, timeout_s: float | None = None) -> bool:
        return True

    async def server_metadata(self, timeout_s: float | None = None) -> service_pb2.ServerMetadataResponse:
        return service_pb2.ServerMetadataResponse(name="counting")

    async def model_ready(self, name: str, version: str = "", timeout_s: float | None = None) -> bool:
        return name == "m"

    async def model_config(self, name: str, version: str = "", timeout_s: float | None = None
                           ) -> model_config_pb2.ModelConfig:  # fmt: skip
        return model_config_pb2.ModelConfig(name=name, max_batch_size=8)

    async def model_metadata(self, name: str, version: str = "", timeout_s: float | None = None
                             ) -> service_pb2.ModelMetadataResponse:  # fmt: skip
        return service_pb2.ModelMetadataResponse(name=name, versions=["1"], platform="test")

    async def model_statistics(self, name: str = "", version: str = "", timeout_s: float | None = None
                               ) -> service_pb2.ModelStatisticsResponse:  # fmt: skip
        return service_pb2.ModelStatisticsResponse()

    async def repository_index(self, ready: bool = False, timeout_s: float | None = None
                               ) -> list[service_pb2.RepositoryIndexResponse.ModelIndex]:  # fmt: skip
        return [service_pb2.RepositoryIndexResponse.ModelIndex(name="m", version="1", state="READY")]

    async def load(self, name: str, parameters: Mapping[str, service_pb2.ModelRepositoryParameter] | None = None,
                   timeout_s: float | None = None) -> None:  # fmt: skip
        return None

    async def unload(self, name: str, parameters: Mapping[str, service_pb2.ModelRepositoryParameter] | None = None,
                     timeout_s: float | None = None) -> None:  # fmt: skip
        return None

    async def close(self, grace_s: float | None = None) -> None:
        self.closed = True


async def cluster_of(*addresses: str, failing: frozenset[str] = frozenset()) -> tuple[Cluster, dict[str, CountingReplica]]:
    replicas: dict[str, CountingReplica] = {}

    def make(spec: WorkerSpec) -> Replica:
        replica = replicas[spec.address] = CountingReplica(spec, spec.address in failing)
        return replica

    cluster = Cluster([WorkerSpec(a) for a in addresses], client_factory=make, probe_interval_s=3600.0)
    await cluster.start()
    return cluster, replicas


def stream_request(n: int) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="m", id="r")
    request.parameters["n"].int64_param = n
    return request


async def streamed(router: Router, n: int) -> list[str]:
    async with aclosing(router.stream("m", "", stream_request(n), None)) as responses:
        return [r.id async for r, _ in responses if r.id or is_final(r)]


async def test_a_replica_written_here_serves_batches_and_streams_through_the_router() -> None:
    cluster, replicas = await cluster_of("a:1")
    router = Router(cluster)
    try:
        answer = await router.infer("m", "", service_pb2.ModelInferRequest(model_name="m", id="x"), None)
        assert answer.id == "a:1"
        assert await streamed(router, 3) == ["a:1/0", "a:1/1", "a:1/2"]
        (worker,) = cluster.workers()
        assert worker.sent == 2 and worker.inflight == 0  # the stream's slot freed at its end
        assert replicas["a:1"].calls == 2
    finally:
        router.close()
        await cluster.stop()


@pytest.mark.parametrize("kind", ["batch", "stream"])
async def test_a_replica_failing_every_call_is_ejected_the_same_for_batches_and_streams(kind: str) -> None:
    cluster, replicas = await cluster_of("bad:1", "good:1", failing=frozenset({"bad:1"}))
    outliers = OutlierDetector()
    router = Router(cluster, rng=random.Random(7), outliers=outliers, retry_budget=RetryBudget(100.0, 10))
    limit = outliers.settings.consecutive_failures
    try:
        for _ in range(4 * limit):
            if kind == "batch":
                answer = await router.infer("m", "", service_pb2.ModelInferRequest(model_name="m"), None)
                assert answer.id == "good:1"  # every failed try retried on the good replica
            else:
                assert (await streamed(router, 2))[0].startswith("good:1/")
        bad = next(w for w in cluster.workers() if w.address == "bad:1")
        assert outliers.state("bad:1") is CircuitState.OPEN
        assert replicas["bad:1"].calls == limit and bad.failures == limit  # none reach it once ejected
        assert outliers.state("good:1") is CircuitState.CLOSED
    finally:
        router.close()
        await cluster.stop()


@pytest.mark.parametrize("kind", ["batch", "stream"])
async def test_retries_are_refused_once_the_budget_is_spent_the_same_for_batches_and_streams(kind: str) -> None:
    cluster, replicas = await cluster_of("bad:1", "good:1", failing=frozenset({"bad:1"}))
    # No extra attempt allowed at all: a failed first try is not retried.
    router = Router(cluster, rng=random.Random(3), retry_budget=RetryBudget(budget_percent=0.0, min_concurrency=0))
    try:
        refused = 0
        for _ in range(20):
            try:
                if kind == "batch":
                    await router.infer("m", "", service_pb2.ModelInferRequest(model_name="m"), None)
                else:
                    await streamed(router, 1)
            except Unavailable as e:
                assert "retries are limited while many requests fail" in str(e)
                refused += 1
        # Every call that went first to the failing replica was refused a retry (none got through it).
        assert refused == replicas["bad:1"].calls > 0
        assert replicas["good:1"].calls == 20 - refused
    finally:
        router.close()
        await cluster.stop()


async def test_a_connection_closed_for_its_pings_is_retried_even_on_the_only_replica_and_charged_to_no_one() -> None:
    cluster, replicas = await cluster_of("a:1")
    router = Router(cluster)
    replica = replicas["a:1"]
    refusals = [PingsRefused("worker a:1: Too many pings")]
    served = replica.infer

    async def infer(request: object, timeout_s: float | None = None) -> service_pb2.ModelInferResponse:
        if refusals:
            replica.calls += 1
            raise refusals.pop()
        return await served(request, timeout_s)

    replica.infer = infer  # type: ignore[method-assign]
    try:
        answer = await router.infer("m", "", service_pb2.ModelInferRequest(model_name="m"), None)
        (worker,) = cluster.workers()
        assert answer.id == "a:1" and replica.calls == 2
        assert worker.failures == 0 and router.outliers.state("a:1") is CircuitState.CLOSED
    finally:
        router.close()
        await cluster.stop()
