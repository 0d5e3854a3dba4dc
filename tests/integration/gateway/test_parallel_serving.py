"""Split models served end to end: ``infergate up`` with four workers and a
config declaring TP2, TP4, PP2 and a hybrid (2 replica groups x TP2) logical
model of ``encoder`` on peer collectives, and TP2 on the gateway's star.

Checked through tritonclient over HTTP and gRPC: outputs equal the unsplit
model's, the logical models show ``encoder``'s signature, each worker's own
repository index holds only its slot's shards, ``/metrics`` counts one
gateway call per rank per batch (one per batch for the pipeline), a
repository unload/load of a logical model reaches the workers, and killing
a worker of a replicated group loses no request and its group is rebuilt
(the test that kills runs last).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
from prometheus_client.parser import text_string_to_metric_families
import tritonclient.grpc.aio as grpcclient_aio
import tritonclient.http as httpclient

from tests.harness import ROOT, Proc, infergate_cmd, start

pytestmark = pytest.mark.timeout(180)

LOGICAL = {
    "encoder_tp2": {"tensor_parallel": 2},
    "encoder_tp4": {"tensor_parallel": 4},
    "encoder_pp2": {"pipeline_parallel": 2},
    "encoder_hybrid": {"tensor_parallel": 2, "replicas": 2},
    "encoder_star": {"tensor_parallel": 2, "collectives": "gateway"},
}
# Gateway -> worker calls per batch on peer collectives: one per rank, one per pipeline.
CALLS_PER_BATCH = {"encoder_tp2": 2, "encoder_tp4": 4, "encoder_pp2": 1, "encoder_hybrid": 2}
TOLERANCE = 1e-4
RECOVERY_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def cluster(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    config = tmp_path_factory.mktemp("parallel-serving") / "gateway.yaml"
    lines = ["models:"]
    for name, layout in LOGICAL.items():
        settings = ", ".join(f"{k}: {v}" for k, v in layout.items())
        lines.append(f"  {name}: {{from: encoder, {settings}}}")
    config.write_text("\n".join(lines) + "\n")
    proc = start(["up", "--workers", "4", "--model-repository", str(model_repo),
                  "--http-port", "0", "--grpc-port", "0", "--config", str(config)])
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def reference(model_repo: Path):
    session = ort.InferenceSession(str(model_repo / "encoder" / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    return lambda x: session.run(["HIDDEN"], {"TOKENS": x})[0]


def tokens(rows: int, seq: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 100, size=(rows, seq)).astype(np.int64)


def grpc_url(proc: Proc) -> str:
    return f"127.0.0.1:{proc.ready['grpc_port']}"


def http_url(proc: Proc) -> str:
    return f"127.0.0.1:{proc.ready['http_port']}"


def infer(client: grpcclient.InferenceServerClient | httpclient.InferenceServerClient, model: str, x: np.ndarray) -> np.ndarray:
    module = grpcclient if isinstance(client, grpcclient.InferenceServerClient) else httpclient
    tensor = module.InferInput("TOKENS", list(x.shape), "INT64")
    tensor.set_data_from_numpy(x)
    return client.infer(model, [tensor], outputs=[module.InferRequestedOutput("HIDDEN")]).as_numpy("HIDDEN")


def worker_headers(proc: Proc) -> dict[str, str]:
    """The credentials ``up`` gives its workers, when it gives them any."""
    token_file = proc.ready.get("worker_token_file")
    if not token_file:
        return {}
    return {"authorization": f"Bearer {Path(token_file).read_text().strip()}"}


def worker_shards(address: str, headers: dict[str, str]) -> set[str]:
    """READY models of one worker's own repository index that are shards (dotted names)."""
    client = grpcclient.InferenceServerClient(address)
    try:
        index = client.get_model_repository_index(headers=headers)
        return {m.name for m in index.models if m.state == "READY" and "." in m.name}
    finally:
        client.close()


SHARD = re.compile(r"^(?P<model>[^.]+)\.(?:tp\d\.r(?P<rank>\d)|pp2)\.s(?P<seg>\d+)$")


def slots_by_worker(workers: list[str], headers: dict[str, str]) -> dict[str, dict[str, set[str]]]:
    """model -> worker -> slot ids ("r0"/"r1" for a rank, "s0"/"s1" for a stage) it holds shards of."""
    out: dict[str, dict[str, set[str]]] = {name: {} for name in LOGICAL}
    for address in workers:
        for shard in worker_shards(address, headers):
            m = SHARD.match(shard)
            assert m is not None and m["model"] in LOGICAL, shard
            slot = f"r{m['rank']}" if m["rank"] is not None else f"s{m['seg']}"
            out[m["model"]].setdefault(address, set()).add(slot)
    return out


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_split_models_equal_the_unsplit_model(cluster: Proc, reference, protocol: str) -> None:
    if protocol == "grpc":
        client = grpcclient.InferenceServerClient(grpc_url(cluster))
    else:
        client = httpclient.InferenceServerClient(http_url(cluster))
    try:
        for seed, (rows, seq) in enumerate([(1, 5), (3, 11), (16, 7)]):
            x = tokens(rows, seq, seed)
            want = reference(x)
            through_gateway = infer(client, "encoder", x)
            np.testing.assert_allclose(through_gateway, want, atol=TOLERANCE, rtol=0)
            for name in LOGICAL:
                got = infer(client, name, x)
                assert got.shape == want.shape, name
                np.testing.assert_allclose(got, want, atol=TOLERANCE, rtol=0, err_msg=name)
    finally:
        client.close()


async def test_concurrent_requests_are_batched_and_stay_exact(cluster: Proc, reference) -> None:
    client = grpcclient_aio.InferenceServerClient(grpc_url(cluster))
    xs = [tokens(1 + i % 3, 9, 100 + i) for i in range(24)]

    async def one(name: str, x: np.ndarray) -> np.ndarray:
        tensor = grpcclient.InferInput("TOKENS", list(x.shape), "INT64")
        tensor.set_data_from_numpy(x)
        return (await client.infer(name, [tensor])).as_numpy("HIDDEN")

    try:
        for name in LOGICAL:
            outs = await asyncio.gather(*(one(name, x) for x in xs))
            for x, got in zip(xs, outs):
                np.testing.assert_allclose(got, reference(x), atol=TOLERANCE, rtol=0, err_msg=name)
        stats = await client.get_inference_statistics("encoder_hybrid")
        counts = stats.model_stats[0]
        # Rows counted per request, batches per executed plan run: at most one per request.
        assert counts.inference_count >= len(xs) and 0 < counts.execution_count <= counts.inference_count
    finally:
        await client.close()


def parallel_counters(proc: Proc) -> dict[tuple[str, str], float]:
    """(family, model) -> value of the infergate_parallel_* counters on the gateway's /metrics."""
    text = urllib.request.urlopen(f"http://{http_url(proc)}/metrics", timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("infergate_parallel_"):
                out[(sample.name, sample.labels["model"])] = sample.value
    return out


def test_counters_show_one_gateway_call_per_rank(cluster: Proc) -> None:
    client = grpcclient.InferenceServerClient(grpc_url(cluster))
    try:
        before = parallel_counters(cluster)
        for name in LOGICAL:
            for seed in range(3):
                infer(client, name, tokens(2, 7, seed))
        after = parallel_counters(cluster)
    finally:
        client.close()

    def delta(family: str, model: str) -> float:
        key = (f"infergate_parallel_{family}_total", model)
        return after[key] - before.get(key, 0)

    for name, calls in CALLS_PER_BATCH.items():
        batches = delta("batches", name)
        assert batches >= 3, name
        assert delta("worker_calls", name) == calls * batches, name
        assert delta("peer_bytes", name) > 0, name
    # The star makes a call per rank per segment and moves nothing between workers.
    assert delta("worker_calls", "encoder_star") > 2 * delta("batches", "encoder_star") > 0
    assert delta("peer_bytes", "encoder_star") == 0


def test_logical_models_show_the_source_signature(cluster: Proc) -> None:
    client = grpcclient.InferenceServerClient(grpc_url(cluster))
    try:
        source = client.get_model_metadata("encoder")
        source_config = client.get_model_config("encoder").config
        index = {m.name: m for m in client.get_model_repository_index().models}
        for name in LOGICAL:
            assert client.is_model_ready(name)
            meta = client.get_model_metadata(name)
            assert meta.name == name and meta.platform == "infergate_parallel"
            assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == \
                [(t.name, t.datatype, list(t.shape)) for t in source.inputs]
            assert [(t.name, t.datatype, list(t.shape)) for t in meta.outputs] == \
                [(t.name, t.datatype, list(t.shape)) for t in source.outputs]
            config = client.get_model_config(name).config
            assert config.max_batch_size == source_config.max_batch_size > 0
            assert '"source": "encoder"' in config.parameters["infergate_logical"].string_value
            assert index[name].state == "READY" and index[name].reason.startswith("logical model")
        # Shards are ordinary models in the gateway's index too.
        assert "encoder_tp2.tp2.r0.s0" in index and "encoder_pp2.pp2.s1" in index
    finally:
        client.close()


def test_each_worker_holds_only_its_own_shards(cluster: Proc) -> None:
    workers = [w["address"] for w in cluster.ready["workers"]]
    headers = worker_headers(cluster)
    placed = slots_by_worker(workers, headers)
    for name, holders in placed.items():
        # No worker holds two slots of one logical model (four workers are enough for each).
        assert all(len(slots) == 1 for slots in holders.values()), (name, holders)
    assert sorted(s for slots in placed["encoder_tp2"].values() for s in slots) == ["r0", "r1"]
    assert sorted(s for slots in placed["encoder_pp2"].values() for s in slots) == ["s0", "s1"]
    hybrid = placed["encoder_hybrid"]
    assert len(hybrid) == 4 and sorted(s for slots in hybrid.values() for s in slots) == ["r0", "r0", "r1", "r1"]
    # A worker holding a rank holds every segment of that rank, and nothing of the other.
    for address, slots in hybrid.items():
        (rank,) = slots
        held = {s for s in worker_shards(address, headers) if s.startswith("encoder_hybrid.")}
        segments = {SHARD.match(s)["seg"] for s in held}  # type: ignore[index]
        assert held == {f"encoder_hybrid.tp2.{rank}.s{k}" for k in segments} and len(segments) > 1


def test_repository_unload_and_load_of_a_logical_model(cluster: Proc, reference) -> None:
    workers = [w["address"] for w in cluster.ready["workers"]]
    headers = worker_headers(cluster)
    client = httpclient.InferenceServerClient(http_url(cluster))
    try:
        client.unload_model("encoder_pp2")
        assert not client.is_model_ready("encoder_pp2")
        assert not any(s.startswith("encoder_pp2.") for w in workers for s in worker_shards(w, headers))
        client.load_model("encoder_pp2")
        assert client.is_model_ready("encoder_pp2")
        assert sorted(s for slots in slots_by_worker(workers, headers)["encoder_pp2"].values() for s in slots) == ["s0", "s1"]
        x = tokens(2, 6, 42)
        np.testing.assert_allclose(infer(client, "encoder_pp2", x), reference(x), atol=TOLERANCE, rtol=0)
    finally:
        client.close()


def test_a_logical_model_that_cannot_be_built_stops_up_with_a_clear_error(model_repo: Path, tmp_path: Path) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text("models:\n  ghost_tp2: {from: ghost, tensor_parallel: 2}\n")
    done = subprocess.run(infergate_cmd("up", "--workers", "1", "--model-repository", str(model_repo),
                                        "--http-port", "0", "--grpc-port", "0", "--config", str(config)),
                          cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "models.ghost_tp2" in done.stderr and "ghost" in done.stderr.splitlines()[-1]


async def test_killing_a_worker_of_a_replicated_group_loses_no_request(cluster: Proc, reference) -> None:
    workers = {w["address"]: w["pid"] for w in cluster.ready["workers"]}
    headers = worker_headers(cluster)
    placed = slots_by_worker(list(workers), headers)
    # The victim hosts a rank of the hybrid; preferably one of encoder_tp2 as
    # well, whose only copy then has to be re-placed.
    victims = sorted(placed["encoder_hybrid"], key=lambda a: a not in placed["encoder_tp2"])
    victim = victims[0]
    x = tokens(2, 9, 7)
    want = reference(x)
    client = grpcclient_aio.InferenceServerClient(grpc_url(cluster))
    results: list[float | str] = []
    stop = asyncio.Event()

    async def sender() -> None:
        while not stop.is_set():
            tensor = grpcclient.InferInput("TOKENS", list(x.shape), "INT64")
            tensor.set_data_from_numpy(x)
            try:
                out = (await client.infer("encoder_hybrid", [tensor], client_timeout=30)).as_numpy("HIDDEN")
                results.append(float(np.max(np.abs(out - want))))
            except Exception as e:  # noqa: BLE001 - every failure is recorded and fails the test below
                results.append(repr(e))

    async def until(count: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while len(results) < count and time.monotonic() < deadline:
            await asyncio.sleep(0.02)  # polling the result count, not standing in for readiness

    tasks = [asyncio.create_task(sender()) for _ in range(6)]
    try:
        await until(20, 30)
        before = len(results)
        os.kill(workers[victim], signal.SIGKILL)
        await until(before + 120, 60)
    finally:
        stop.set()
        await asyncio.gather(*tasks)
    try:
        failures = [r for r in results if isinstance(r, str) or r > TOLERANCE]
        assert len(results) >= before + 120 and not failures, (len(results), failures[:3])

        # Every logical model still answers, encoder_tp2 after re-placing its lost rank.
        for name in LOGICAL:
            tensor = grpcclient.InferInput("TOKENS", list(x.shape), "INT64")
            tensor.set_data_from_numpy(x)
            out = (await client.infer(name, [tensor], client_timeout=60)).as_numpy("HIDDEN")
            np.testing.assert_allclose(out, want, atol=TOLERANCE, rtol=0, err_msg=name)
    finally:
        await client.close()

    # The hybrid gets its second copy of every rank back (on the restarted
    # worker, or elsewhere once the gateway stops waiting for it).
    deadline = time.monotonic() + RECOVERY_TIMEOUT_S
    while True:
        try:
            hybrid = slots_by_worker(list(workers), headers)["encoder_hybrid"]
        except Exception:  # noqa: BLE001 - the victim may still be restarting
            hybrid = {}
        ranks = sorted(s for slots in hybrid.values() for s in slots)
        if ranks == ["r0", "r0", "r1", "r1"]:
            break
        assert time.monotonic() < deadline, f"hybrid not whole again: {hybrid}"
        await asyncio.sleep(0.2)
    # ... and both copies run as peer groups again (the broken one rebuilt on its new members).
    while parallel_counters(cluster).get(("infergate_parallel_groups_ready", "encoder_hybrid")) != 2:
        assert time.monotonic() < deadline, "the hybrid's peer groups were not rebuilt"
        await asyncio.sleep(0.2)
