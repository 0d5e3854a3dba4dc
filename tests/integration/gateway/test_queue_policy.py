"""A model's own queue policy through a real gateway and a simulated worker
(1.5 s a batch): its ``max_queue_size`` wins over the gateway-wide default
(the gateway config's entry for the model wins over both), and its queue
timeout answers a request that waits for a busy replica -- the request stays
in the gateway's queue instead of waiting on the worker out of the policy's
reach. Over gRPC and HTTP with the real ``tritonclient`` asyncio clients.
"""

from __future__ import annotations

import asyncio
import http.client
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc.aio as grpcaio
import tritonclient.http.aio as httpaio
from tritonclient.utils import InferenceServerException

from tests.harness import Proc, start, start_worker, worker_url
from tests.integration.gateway.test_triton_semantics import _until, _worker_busy

pytestmark = pytest.mark.timeout(120)

GATEWAY_CONFIG = """
batching: {max_queue_size: 1024}
models:
  overridden: {max_queue_size: 4}
  timed: {mode: "off"}
"""
POLICIES = {
    "bounded": "dynamic_batching { default_queue_policy { max_queue_size: 2 } }",
    "overridden": "dynamic_batching { default_queue_policy { max_queue_size: 2 } }",
    "timed": "dynamic_batching { default_queue_policy { default_timeout_microseconds: 300000 timeout_action: REJECT } }",
}


@pytest.fixture(scope="module")
def gateway(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    root = tmp_path_factory.mktemp("queue-policy")
    for name, policy in POLICIES.items():
        shutil.copytree(model_repo / "simple", root / name)
        config = (root / name / "config.pbtxt").read_text().replace('name: "simple"', f'name: "{name}"')
        (root / name / "config.pbtxt").write_text(config + policy + "\n")
    (root / "gateway.yaml").write_text(GATEWAY_CONFIG)
    worker = start_worker(root, "--backend", "sim", "--sim-latency-ms", "1500")
    proc = None
    try:
        proc = start(["gateway", "--worker", worker_url(worker), "--http-port", "0", "--grpc-port", "0",
                      "--config", str(root / "gateway.yaml")])
        yield proc
    finally:
        if proc is not None:
            proc.stop()
        worker.stop()


def _inputs(module) -> list:  # type: ignore[no-untyped-def]
    inputs = [module.InferInput(name, [1, 16], "INT32") for name in ("INPUT0", "INPUT1")]
    for i in inputs:
        i.set_data_from_numpy(np.ones((1, 16), np.int32))
    return inputs


async def _outcomes(gateway: Proc, model: str, later: int, use_http: bool) -> tuple[str, list[str]]:
    """One request that occupies the worker, then ``later`` more while it runs: their outcomes."""
    if use_http:
        client, module = httpaio.InferenceServerClient(f"127.0.0.1:{gateway.ready['http_port']}"), httpaio
    else:
        client, module = grpcaio.InferenceServerClient(f"127.0.0.1:{gateway.ready['grpc_port']}"), grpcaio

    async def one() -> str:
        try:
            await client.infer(model, _inputs(module))
            return "OK"
        except InferenceServerException as e:
            return f"{e.status()}: {e.message()}"

    try:
        first = asyncio.create_task(one())
        metrics = http.client.HTTPConnection("127.0.0.1", gateway.ready["http_port"], timeout=30)
        await asyncio.to_thread(_until, lambda: _worker_busy(metrics))
        rest = await asyncio.gather(*(one() for _ in range(later)))
        return await first, list(rest)
    finally:
        await client.close()


@pytest.mark.parametrize("model, use_http, queued", [("bounded", False, 2), ("overridden", True, 4)])
async def test_the_models_max_queue_size_wins_over_the_gateway_default(
    gateway: Proc, model: str, use_http: bool, queued: int
) -> None:
    first, rest = await _outcomes(gateway, model, 6, use_http)
    assert first == "OK"
    refused = [r for r in rest if r != "OK"]
    assert rest.count("OK") == queued and len(refused) == 6 - queued, rest
    assert all("queue is full" in r and r.split(":")[0] in ("503", "StatusCode.UNAVAILABLE") for r in refused), refused


@pytest.mark.parametrize("use_http", [False, True])
async def test_a_queue_timeout_applies_while_every_replica_is_busy(gateway: Proc, use_http: bool) -> None:
    """The worker is busy with one request (1.5 s) and has room for a second; the model's queue policy
    rejects after 0.3 s. The second request is not sent to wait on the worker: it times out as Triton says."""
    first, rest = await _outcomes(gateway, "timed", 1, use_http)
    assert first == "OK"
    assert rest == ["503: Request timeout expired" if use_http else "StatusCode.UNAVAILABLE: Request timeout expired"]
