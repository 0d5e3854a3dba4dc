"""The gateway in front of a real Triton Inference Server and one of our own
workers at once (tests/triton_harness.py, tests/harness.py).

One module-wide pool: Triton serves Python-backend copies of ``mlp``,
``simple`` and ``encoder`` with its statistics and repository protocols
restricted behind a header token; our worker serves ``mlp`` and ``simple``.
The gateway reaches Triton through its config file (``kind: triton`` and the
header) and the worker through ``--worker``. Checked through tritonclient
HTTP and gRPC: a model on both is sharded across both, outputs equal ONNX
Runtime, Triton's errors come back with Triton's codes, load / unload /
load-with-override (with versions) reach Triton, the statistics page shows
each worker's own statistics. Gateways of their own check a Triton reached
without the header and one without explicit model control. The last test
stops Triton mid-stream and brings it back on its ports.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.utils import InferenceServerException

from gateway.batching.batcher import BatchPolicy
from models.triton import (
    build_triton_repository,
    config_json,
    python_backend_config,
)
from tests import triton_harness
from tests.harness import Proc, start, start_worker, worker_url
from tests.integration.gateway.triton_clients import (
    assert_outputs,
    grpc_client,
    http_client,
    inference_count,
    infer,
    mlp_input,
    override_files,
    status_of,
    wait_for,
    worker_section,
)
from tests.triton_harness import (
    TritonProc,
    grpc_header_key,
    start_triton,
    triton_available,
)

AVAILABLE, REASON = triton_available()

pytestmark = [
    pytest.mark.triton,
    pytest.mark.timeout(180),
    pytest.mark.skipif(not AVAILABLE, reason=f"no real Triton here: {REASON}"),
]

TRITON_MODELS = ["encoder", "mlp", "simple"]
WORKER_MODELS = ["mlp", "simple"]
TOKEN = ("triton-access-token", "s3cret")
RESTRICTED = {"model-repository": TOKEN, "statistics": TOKEN}
HEADERS = {grpc_header_key(TOKEN[0]): TOKEN[1]}  # triton-grpc-protocol-triton-access-token
PROBE_INTERVAL_S = 0.5


@dataclass
class Triton:
    """The module's Triton server; the last test replaces ``proc`` with a restarted one."""

    proc: TritonProc
    repo: Path

    @property
    def url(self) -> str:
        return self.proc.grpc_url


@dataclass
class Pool:
    triton: Triton
    worker: Proc
    gateway: Proc

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.gateway.ready['grpc_port']}"

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.gateway.ready['http_port']}"


# --- fixtures -------------------------------------------------------------------


@pytest.fixture(scope="module")
def triton(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Triton]:
    repo = tmp_path_factory.mktemp("triton-models")
    build_triton_repository(model_repo, repo, TRITON_MODELS)
    holder = Triton(start_triton(repo, models=TRITON_MODELS, restricted_grpc=RESTRICTED), repo)
    try:
        yield holder
    finally:
        holder.proc.stop()  # asserts a clean exit


@pytest.fixture(scope="module")
def worker(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    repo = tmp_path_factory.mktemp("worker-models")
    for name in WORKER_MODELS:
        shutil.copytree(model_repo / name, repo / name)
    proc = start_worker(repo)
    try:
        yield proc
    finally:
        proc.stop()


def start_gateway(tmp_path: Path, config: str, *workers: str) -> Proc:
    path = tmp_path / "gateway.yaml"
    path.write_text(f"probe:\n  interval_s: {PROBE_INTERVAL_S}\n{config}")
    args = ["gateway", "--http-port", "0", "--grpc-port", "0", "--config", str(path)]
    for address in workers:
        args += ["--worker", address]
    return start(args)


@pytest.fixture(scope="module")
def pool(triton: Triton, worker: Proc, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    config = (
        "workers:\n"
        f"  - address: {triton.url}\n"
        "    kind: triton\n"
        f"    headers: {{{grpc_header_key(TOKEN[0])}: {TOKEN[1]}}}\n"
    )
    gateway = start_gateway(tmp_path_factory.mktemp("gateway"), config, worker_url(worker))
    try:
        yield Pool(triton, worker, gateway)
    finally:
        gateway.stop()


@pytest.fixture(scope="module")
def references(model_repo: Path) -> dict[str, Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]]:
    def runner(name: str) -> Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]:
        session = ort.InferenceSession(str(model_repo / name / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
        outputs = [o.name for o in session.get_outputs()]
        return lambda feeds: dict(zip(outputs, session.run(outputs, feeds)))

    return {name: runner(name) for name in TRITON_MODELS}


# --- batching policy (no server) ------------------------------------------------------


def test_triton_backed_models_are_forwarded_promptly() -> None:
    config = mc.ModelConfig(name="m", max_batch_size=8)
    config.dynamic_batching.max_queue_delay_microseconds = 5000
    config.dynamic_batching.preferred_batch_size[:] = [4]
    ours = BatchPolicy.from_model_config(config, default_mode="fixed")
    assert (ours.mode, ours.max_queue_delay_us) == ("fixed", 5000)
    theirs = BatchPolicy.from_model_config(config, default_mode="fixed", backend_batches=True)
    assert (theirs.mode, theirs.max_queue_delay_us, theirs.max_batch_size) == ("adaptive", 0, 8)
    pinned = BatchPolicy.from_model_config(config, {"mode": "fixed"}, default_mode="fixed", backend_batches=True)
    assert pinned.mode == "fixed"  # a per-model setting still wins
    off = BatchPolicy.from_model_config(config, default_mode="off", backend_batches=True)
    assert off.mode == "off"
    # The burst hold: none where Triton waits out a queue delay of its own (one wait, not two),
    # the gateway's where Triton runs what it gets at once.
    assert BatchPolicy.from_model_config(config, backend_batches=True, default_burst_hold_us=5000).burst_hold_us == 0
    config.dynamic_batching.max_queue_delay_microseconds = 0
    assert BatchPolicy.from_model_config(config, backend_batches=True, default_burst_hold_us=5000).burst_hold_us == 5000


# --- the module's pool -----------------------------------------------------------------


def test_mixed_pool_shards_across_triton_and_worker(pool: Pool, references: dict) -> None:
    triton_url, worker_grpc = pool.triton.url, worker_url(pool.worker)
    before = inference_count(triton_url, "mlp", headers=HEADERS), inference_count(worker_grpc, "mlp")
    jobs = [(i % 2 == 0, 1 + i % 3, i) for i in range(32)]

    def send(job: tuple[bool, int, int]) -> int:
        use_grpc, rows, seed = job
        module = grpcclient if use_grpc else httpclient
        client = grpc_client(pool.grpc_url) if use_grpc else http_client(pool.http_url)
        try:
            feeds = mlp_input(rows, seed)
            assert_outputs(infer(module, client, "mlp", feeds), references["mlp"](feeds))
        finally:
            client.close()
        return rows

    with ThreadPoolExecutor(8) as threads:
        rows_sent = sum(threads.map(send, jobs))

    def counts() -> tuple[int, int]:
        return inference_count(triton_url, "mlp", headers=HEADERS), inference_count(worker_grpc, "mlp")

    # Triton counts a request once it has released it, a moment after answering.
    wait_for(lambda: sum(counts()) - sum(before) >= rows_sent, "both servers to count every row")
    after = counts()
    on_triton, on_worker = after[0] - before[0], after[1] - before[1]
    assert on_triton > 0 and on_worker > 0, (on_triton, on_worker)
    assert on_triton + on_worker == rows_sent  # every row ran exactly once

    # The statistics page: the gateway's own, plus each worker's on request.
    client = http_client(pool.http_url)
    try:
        plain = client.get_inference_statistics("mlp")
        assert set(plain) == {"model_stats"}  # what Triton answers; standard clients see nothing new
        assert plain["model_stats"][0]["inference_count"] >= rows_sent
    finally:
        client.close()
    section = {w["kind"]: w for w in worker_section(pool.http_url, "mlp")}
    assert set(section) == {"triton", "infergate"}
    assert section["triton"]["model_stats"][0]["inference_count"] == after[0]
    assert section["infergate"]["model_stats"][0]["inference_count"] == after[1]
    assert all(w["state"] == "READY" and "error" not in w for w in section.values())


def test_triton_errors_come_back_with_triton_codes(pool: Pool, references: dict) -> None:
    direct = grpc_client(pool.triton.url)
    via_grpc, via_http = grpc_client(pool.grpc_url), http_client(pool.http_url)
    try:
        # Only Triton can reject this one: token ids outside the embedding
        # table pass every check the gateway makes; ONNX Runtime fails in Triton.
        bad_tokens = {"TOKENS": np.array([[1, 2, 5000, 3]], dtype=np.int64)}
        code, message = status_of(lambda: infer(grpcclient, direct, "encoder", bad_tokens))
        assert code == "StatusCode.INTERNAL" and "out of data bounds" in message
        assert status_of(lambda: infer(grpcclient, via_grpc, "encoder", bad_tokens)) == (code, message)
        http_code, http_message = status_of(lambda: infer(httpclient, via_http, "encoder", bad_tokens))
        assert (http_code, http_message) == ("500", message)  # INTERNAL's HTTP status
        # Requests both reject: the same gRPC code from the gateway as from Triton.
        wrong_shape = {"INPUT": np.zeros((1, 63), np.float32)}
        for model in ("mlp", "nope"):
            from_triton = status_of(lambda m=model: infer(grpcclient, direct, m, wrong_shape))[0]
            assert status_of(lambda m=model: infer(grpcclient, via_grpc, m, wrong_shape))[0] == from_triton
            assert status_of(lambda m=model: infer(httpclient, via_http, m, wrong_shape))[0] == "400"
        good = {"TOKENS": np.array([[1, 2, 999, 3]], dtype=np.int64)}
        assert_outputs(infer(grpcclient, via_grpc, "encoder", good), references["encoder"](good))
    finally:
        direct.close()
        via_grpc.close()
        via_http.close()


def test_unload_and_load_through_gateway_reach_triton(pool: Pool, references: dict) -> None:
    direct = grpc_client(pool.triton.url)
    via_grpc, via_http = grpc_client(pool.grpc_url), http_client(pool.http_url)
    tokens = {"TOKENS": np.arange(12, dtype=np.int64).reshape(2, 6)}
    try:
        assert direct.is_model_ready("encoder") and via_grpc.is_model_ready("encoder")
        via_http.unload_model("encoder")
        assert not direct.is_model_ready("encoder")
        assert not via_grpc.is_model_ready("encoder")
        assert status_of(lambda: infer(grpcclient, via_grpc, "encoder", tokens))[0] == "StatusCode.NOT_FOUND"
        via_grpc.load_model("encoder")
        assert direct.is_model_ready("encoder") and via_http.is_model_ready("encoder")
        assert_outputs(infer(httpclient, via_http, "encoder", tokens), references["encoder"](tokens))
    finally:
        direct.close()
        via_grpc.close()
        via_http.close()


def test_load_with_override_makes_python_model_servable_on_triton(
    pool: Pool, model_repo: Path, references: dict
) -> None:
    config = python_backend_config(
        text_format.Parse((model_repo / "mlp" / "config.pbtxt").read_text(), mc.ModelConfig())
    )
    config.name = "mlp_pushed"
    config.version_policy.all.SetInParent()  # serve both versions pushed below
    direct = grpc_client(pool.triton.url)
    via_grpc, via_http = grpc_client(pool.grpc_url), http_client(pool.http_url)
    try:
        assert not direct.is_model_ready("mlp_pushed")
        via_grpc.load_model("mlp_pushed", config=config_json(config), files=override_files(model_repo, ["1", "2"]))
        assert direct.is_model_ready("mlp_pushed", "1") and direct.is_model_ready("mlp_pushed", "2")
        assert via_http.get_model_metadata("mlp_pushed")["versions"] == ["1", "2"]
        assert via_grpc.get_model_config("mlp_pushed").config.backend == "python"

        # Our worker runs Python-backend models too, so the override reached both replicas.
        ours = grpc_client(worker_url(pool.worker))
        try:
            assert ours.is_model_ready("mlp_pushed", "1") and ours.is_model_ready("mlp_pushed", "2")
        finally:
            ours.close()

        # Versions as Triton serves them: version 1 on request, the latest (2) by default,
        # whichever of the two replicas ran the request.
        def counts() -> tuple[int, int]:
            return tuple(inference_count(pool.triton.url, "mlp_pushed", v, headers=HEADERS)
                         + inference_count(worker_url(pool.worker), "mlp_pushed", v) for v in "12")

        feeds = mlp_input(3, seed=11)
        assert counts() == (0, 0)
        assert_outputs(infer(grpcclient, via_grpc, "mlp_pushed", feeds, model_version="1"), references["mlp"](feeds))
        wait_for(lambda: counts() != (0, 0), "Triton to count the request")
        assert counts() == (3, 0)
        assert_outputs(infer(httpclient, via_http, "mlp_pushed", feeds), references["mlp"](feeds))
        wait_for(lambda: counts() != (3, 0), "Triton to count the request")
        assert counts() == (3, 3)

        via_http.unload_model("mlp_pushed")
        assert not direct.is_model_ready("mlp_pushed")
        assert not via_grpc.is_model_ready("mlp_pushed")
    finally:
        direct.close()
        via_grpc.close()
        via_http.close()


# --- gateways of their own ---------------------------------------------------------------


def test_without_headers_gateway_serves_and_says_what_it_cannot_read(
    pool: Pool, tmp_path: Path, references: dict
) -> None:
    # The same Triton and worker, reached without Triton's header token.
    gateway = start_gateway(tmp_path, "", worker_url(pool.worker), f"triton://{pool.triton.url}")
    http_url = f"127.0.0.1:{gateway.ready['http_port']}"
    try:
        section = {w["kind"]: w for w in worker_section(http_url, "mlp")}
        assert set(section) == {"triton", "infergate"}, section  # mlp found on Triton by name
        restricted = section["triton"]
        assert "restricted" in restricted["error"] and "model_stats" not in restricted
        assert set(restricted["unreadable"]) == {"repository_index", "statistics"}

        before = inference_count(pool.triton.url, "mlp", headers=HEADERS)
        client = grpc_client(f"127.0.0.1:{gateway.ready['grpc_port']}")
        try:
            for seed in range(16):
                feeds = mlp_input(1, seed)
                assert_outputs(infer(grpcclient, client, "mlp", feeds), references["mlp"](feeds))
            # encoder is only on Triton, whose index this gateway may not read.
            assert not client.is_model_ready("encoder")
        finally:
            client.close()
        wait_for(lambda: inference_count(pool.triton.url, "mlp", headers=HEADERS) > before, "Triton to serve")
    finally:
        gateway.stop()


def test_triton_without_model_control_is_served_and_named(
    model_repo: Path, tmp_path: Path, references: dict
) -> None:
    # Without explicit model control Triton loads its whole repository: keep it to one model.
    repo = tmp_path / "models"
    build_triton_repository(model_repo, repo, ["mlp"])
    fixed = start_triton(repo, explicit=False, workdir=tmp_path)
    gateway = None
    try:
        gateway = start(["gateway", "--http-port", "0", "--grpc-port", "0", "--worker", f"triton://{fixed.grpc_url}"])
        client = grpc_client(f"127.0.0.1:{gateway.ready['grpc_port']}")
        try:
            code, message = status_of(lambda: client.load_model("mlp"))
            assert code == "StatusCode.UNAVAILABLE"  # Triton's own code
            assert "without explicit model control" in message
            feeds = mlp_input(2, seed=5)
            assert_outputs(infer(grpcclient, client, "mlp", feeds), references["mlp"](feeds))
        finally:
            client.close()
        [entry] = worker_section(f"127.0.0.1:{gateway.ready['http_port']}", "mlp")
        assert entry["model_control"] == "none"
    finally:
        if gateway is not None:
            gateway.stop()
        fixed.stop()


# --- failover: runs last, it restarts the module's Triton -------------------------------


def test_triton_stopped_mid_stream_loses_nothing_and_rejoins(
    pool: Pool, references: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    stop = threading.Event()
    done: list[int] = []
    errors: list[str] = []

    def stream(use_grpc: bool, seed: int) -> None:
        module = grpcclient if use_grpc else httpclient
        client = grpc_client(pool.grpc_url) if use_grpc else http_client(pool.http_url)
        rng = np.random.default_rng(seed)
        try:
            while not stop.is_set():
                feeds = {"INPUT": rng.standard_normal((int(rng.integers(1, 4)), 64)).astype(np.float32)}
                try:
                    assert_outputs(infer(module, client, "mlp", feeds), references["mlp"](feeds))
                    done.append(1)
                except (InferenceServerException, AssertionError) as e:
                    errors.append(f"{type(e).__name__}: {e}")
        finally:
            client.close()

    old = pool.triton.proc
    threads = [threading.Thread(target=stream, args=(i % 2 == 0, i)) for i in range(4)]
    for t in threads:
        t.start()
    try:
        start_count = inference_count(old.grpc_url, "mlp", headers=HEADERS)
        wait_for(lambda: inference_count(old.grpc_url, "mlp", headers=HEADERS) > start_count + 20, "Triton to serve")
        old.stop()  # SIGTERM mid-stream; asserts Triton's clean exit
        served = len(done)
        wait_for(lambda: len(done) > served + 50, "the worker alone to serve")

        # Triton comes back on the same ports (the gateway knows it by address).
        ports = [old.http_port, old.grpc_port, old.metrics_port]
        monkeypatch.setattr(triton_harness, "free_ports", lambda count: list(ports))
        pool.triton.proc = start_triton(pool.triton.repo, models=TRITON_MODELS, restricted_grpc=RESTRICTED)
        assert pool.triton.url == old.grpc_url
        wait_for(lambda: inference_count(pool.triton.url, "mlp", headers=HEADERS) > 10, "Triton back in rotation")
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    assert not errors, errors[:5]
    assert len(done) > 70
