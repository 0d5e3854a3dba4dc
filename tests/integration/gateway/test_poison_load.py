"""Poison load, with real processes: a gateway in front of two, then four ONNX
Runtime workers, steady good traffic, and beside it a steady stream of
well-formed requests the models cannot run (tests/poison_models.py): batch
sizes that cannot broadcast, an over-long sequence, a token id past the
vocabulary (batched with good rows), a size no memory holds (which the
worker cannot tell from a server fault: the gateway's rule decides).

Asserted: every poison request answered 4xx / INVALID_ARGUMENT with the cause
in its message, not one good request failed, no worker ejected (``/v2/cluster``
and ``/metrics``), and every worker served good traffic (each worker's own
statistics). Ejection is set to its most eager (two failures in a row), so one
request fault charged to a worker would show.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpc_aio
import tritonclient.http.aio as http_aio
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from tests.harness import Proc, start, start_worker, worker_url
from tests.poison_models import MAX_SEQUENCE, VOCABULARY, write_repository

pytestmark = pytest.mark.timeout(300)

GATEWAY_CONFIG = """
probe: {interval_s: 0.5}
default_timeout_s: 30
outlier: {consecutive_failures: 2, base_ejection_s: 60}
"""
GOOD_CLIENTS = 6
GOOD_PER_CLIENT = 30
POISON_ROUNDS = 6  # each round sends every kind of poison once


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_repository(tmp_path_factory.mktemp("poison"))


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}-workers")
def cluster(request: pytest.FixtureRequest, repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, list[Proc]]]:
    config = tmp_path_factory.mktemp("gw") / "gateway.yaml"
    config.write_text(GATEWAY_CONFIG)
    workers: list[Proc] = []
    gateway: Proc | None = None
    try:
        for _ in range(request.param):
            workers.append(start_worker(repo, "--execution-threads", "1", "--intra-op-threads", "1"))
        gateway = start(["gateway", *(a for w in workers for a in ("--worker", worker_url(w))),
                         "--http-port", "0", "--grpc-port", "0", "--config", str(config)])
        yield gateway, workers
    finally:
        if gateway is not None:
            gateway.stop()
        for w in workers:
            w.stop()


def tokens(row: list[int]) -> np.ndarray:
    return np.array([row], dtype=np.int64)


def expected_hidden(row: list[int]) -> np.ndarray:
    table = np.arange(VOCABULARY * 2, dtype=np.float32).reshape(VOCABULARY, 2)
    positions = np.arange(MAX_SEQUENCE * 2, dtype=np.float32).reshape(MAX_SEQUENCE, 2) / 100
    return (table[row] + positions[: len(row)])[None]


async def good_client(client: grpc_aio.InferenceServerClient, index: int, failures: list[str]) -> None:
    for n in range(GOOD_PER_CLIENT):
        row = [(index + n + k) % VOCABULARY for k in range(4)]
        inp = grpcclient.InferInput("TOKENS", [1, 4], "INT64")
        inp.set_data_from_numpy(tokens(row))
        try:
            result = await client.infer("encoder", [inp])
            np.testing.assert_allclose(result.as_numpy("HIDDEN"), expected_hidden(row), rtol=1e-6)
            if n % 5 == 0:  # the models that do not batch serve good requests too
                a = grpcclient.InferInput("A", [2, 4], "FP32")
                a.set_data_from_numpy(np.ones((2, 4), np.float32))
                b = grpcclient.InferInput("B", [1, 4], "FP32")
                b.set_data_from_numpy(np.full((1, 4), 2, np.float32))
                summed = await client.infer("pair", [a, b])
                assert (summed.as_numpy("SUM") == 3).all()
        except (InferenceServerException, AssertionError) as e:
            failures.append(f"good request {index}/{n}: {e}")


def poison_requests() -> list[tuple[str, str, list[http_aio.InferInput], str]]:
    """(kind, model, inputs, a piece of the cause the answer must carry)."""
    def inp(name: str, array: np.ndarray, datatype: str) -> http_aio.InferInput:
        i = http_aio.InferInput(name, list(array.shape), datatype)
        i.set_data_from_numpy(array)
        return i

    return [
        ("mismatched batch", "pair", [inp("A", np.ones((2, 4), np.float32), "FP32"),
                                      inp("B", np.ones((3, 4), np.float32), "FP32")], "broadcast"),
        ("over-long sequence", "encoder", [inp("TOKENS", np.zeros((1, MAX_SEQUENCE + 4), np.int64), "INT64")],
         f"by {MAX_SEQUENCE + 4}"),
        ("token out of range", "encoder", [inp("TOKENS", tokens([1, 2, 99, 3]), "INT64")], "idx=99"),
        ("size beyond memory", "fill", [inp("SIZE", np.array([1 << 45], np.int64), "INT64")],
         "same failure on 2 replicas"),
    ]


async def poison_client(client: http_aio.InferenceServerClient, answers: list[tuple[str, str, str, str]]) -> None:
    for _ in range(POISON_ROUNDS):
        for kind, model, inputs, cause in poison_requests():
            try:
                await client.infer(model, inputs)
                answers.append((kind, "200", "", cause))
            except InferenceServerException as e:
                answers.append((kind, str(e.status()), e.message() or "", cause))


async def test_requests_the_model_cannot_run_eject_no_worker(cluster: tuple[Proc, list[Proc]]) -> None:
    gateway, workers = cluster
    http_url = f"127.0.0.1:{gateway.ready['http_port']}"
    grpc_client = grpc_aio.InferenceServerClient(f"127.0.0.1:{gateway.ready['grpc_port']}")
    http_client = http_aio.InferenceServerClient(http_url)
    failures: list[str] = []
    answers: list[tuple[str, str, str, str]] = []
    try:
        await asyncio.gather(
            *(good_client(grpc_client, i, failures) for i in range(GOOD_CLIENTS)),
            poison_client(http_client, answers), poison_client(http_client, answers),
        )
    finally:
        await grpc_client.close()
        await http_client.close()

    assert not failures, failures[:5]
    assert len(answers) == 2 * POISON_ROUNDS * len(poison_requests())
    wrong = [a for a in answers if a[1] != "400" or a[3] not in a[2]]
    assert not wrong, wrong[:5]
    assert all("/" not in message for _, _, message, _ in answers), answers[0]

    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://{http_url}/v2/cluster") as response:
            view = await response.json()
        async with session.get(f"http://{http_url}/metrics") as response:
            metrics = await response.text()
    assert [w["state"] for w in view["workers"]] == ["ready"] * len(workers), view["workers"]
    ejections = [s for f in text_string_to_metric_families(metrics) for s in f.samples
                 if s.name == "infergate_worker_ejections_total"]
    assert len(ejections) == 3 * len(workers) and all(s.value == 0 for s in ejections), ejections
    assert all(w["load"]["failures"] == 0 for w in view["workers"]), view["workers"]

    # Each worker's own statistics: every one served good traffic, about its share.
    served = []
    for w in workers:
        client = grpcclient.InferenceServerClient(worker_url(w))
        try:
            stats = client.get_inference_statistics("encoder", as_json=True)
        finally:
            client.close()
        served.append(sum(int(m.get("inference_count", 0)) for m in stats["model_stats"]))
    total = sum(served)
    assert total == GOOD_CLIENTS * GOOD_PER_CLIENT, served  # good rows only: refused batches count nothing
    assert all(n >= total / (5 * len(workers)) for n in served), served

