"""The light-model rule end to end (gateway/routing/light.py): a real gateway
times its real worker calls, and ``GET /v2/cluster`` shows each model's
recent worker time per row and whether it counts as light.

Two workers behind one gateway: an ONNX Runtime worker serving the example
``mlp`` (about a millisecond a single-row call) and a simulated accelerator
serving ``heavy``, an ``mlp``-shaped model whose every batch takes 20 ms.
The threshold is set to 10 ms a row, far from both, so a slow machine judges alike.
After enough single-row requests of each, ``mlp`` is light and ``heavy`` is
heavy; with ``light_row_ms: 0`` neither is judged.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tests.harness import Proc, start, start_worker, worker_url
from tests.integration.gateway.e2e_cluster import grpc_url, http_url

pytestmark = pytest.mark.timeout(180)

CALLS = 40  # above the rule's 32 calls before a verdict


@pytest.fixture(scope="module")
def workers(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, Proc]]:
    heavy_repo = tmp_path_factory.mktemp("heavy")
    (heavy_repo / "heavy" / "1").mkdir(parents=True)
    config = (model_repo / "mlp" / "config.pbtxt").read_text().replace('name: "mlp"', 'name: "heavy"')
    (heavy_repo / "heavy" / "config.pbtxt").write_text(config)
    onnx = start_worker(model_repo, "--execution-threads", "2", "--intra-op-threads", "1")
    try:
        sim = start_worker(heavy_repo, "--backend", "sim", "--sim-latency-ms", "20")
        try:
            yield onnx, sim
        finally:
            sim.stop()
    finally:
        onnx.stop()


def gateway(workers: tuple[Proc, Proc], config_dir: Path, light_row_ms: float) -> Proc:
    config = config_dir / "gateway.yaml"
    config.write_text(f"batching:\n  light_row_ms: {light_row_ms}\n")
    args = ["gateway", "--http-port", "0", "--grpc-port", "0", "--config", str(config)]
    for worker in workers:
        args += ["--worker", worker_url(worker)]
    return start(args)


def single_rows(proc: Proc, model: str, calls: int) -> None:
    client = grpcclient.InferenceServerClient(grpc_url(proc))
    try:
        for i in range(calls):
            tensor = grpcclient.InferInput("INPUT", [1, 64], "FP32")
            tensor.set_data_from_numpy(np.full((1, 64), i, dtype=np.float32))
            client.infer(model, [tensor])
    finally:
        client.close()


def models_view(proc: Proc) -> dict[str, dict]:
    with urllib.request.urlopen(f"http://{http_url(proc)}/v2/cluster", timeout=30) as answer:
        return {m["name"]: m for m in json.load(answer)["models"]}


def test_a_cheap_model_is_light_and_a_dear_one_is_not(workers: tuple[Proc, Proc], tmp_path: Path) -> None:
    proc = gateway(workers, tmp_path, 10.0)
    try:
        before = models_view(proc)
        assert before["mlp"]["light"] is None and before["mlp"]["worker_ms_per_row"] is None  # not judged yet
        single_rows(proc, "mlp", CALLS)
        single_rows(proc, "heavy", CALLS)
        view = models_view(proc)
        assert view["mlp"]["light"] is True, view["mlp"]
        assert view["mlp"]["worker_ms_per_row"] < 10.0
        assert view["heavy"]["light"] is False, view["heavy"]  # heavy: judged, not light
        assert view["heavy"]["worker_ms_per_row"] >= 19.0  # its 20 ms batches of one row
    finally:
        proc.stop()


def test_zero_turns_the_rule_off(workers: tuple[Proc, Proc], tmp_path: Path) -> None:
    proc = gateway(workers, tmp_path, 0)
    try:
        single_rows(proc, "mlp", CALLS)
        view = models_view(proc)
        assert view["mlp"]["light"] is None and view["mlp"]["worker_ms_per_row"] is None
    finally:
        proc.stop()
