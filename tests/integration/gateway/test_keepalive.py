"""Keepalive pings between the gateway and its workers never drop a healthy worker.

A gateway and two real ``infergate worker`` processes, the gateway's keepalive
time cut to its floor (1 s, ``worker_keepalive_s``) so that a few seconds hold
several keepalive periods. The cluster is held idle (its packed stream calls
open, nothing on them) and busy (streams over gRPC and HTTP, unary calls, a
client calling all along) for several periods at a time. With the gRPC server
defaults the workers had (a ping every 5 min at most, 2 strikes), a worker
answered GOAWAY "too_many_pings" after a few silent periods, the gateway marked
it DOWN and retried the stream elsewhere (or the client's stream failed); here no worker may leave READY, and
no failure or retry may be counted against one. The same for the bundled Triton server with its defaults.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient

from tests.harness import Proc, start, start_together, start_worker, worker_url
from tests.integration.gateway.stream_clients import Stream, poll, repeat_inputs, square_inputs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

MODELS = ("square_int32", "repeat_int32", "simple")
KEEPALIVE_S = 1.0
# Each idle spell spans several keepalive periods: a worker with gRPC's default ping policy
# refused the fourth ping of a silent connection, so every spell would end in a GOAWAY.
IDLE_S = 6 * KEEPALIVE_S
ROUNDS = 6


def cluster_workers(gateway: Proc) -> list[dict]:
    response = requests.get(f"http://127.0.0.1:{gateway.ready['http_port']}/v2/cluster", timeout=10)
    response.raise_for_status()
    return response.json()["workers"]


@pytest.fixture()
def gateway(model_repo: Path, tmp_path: Path) -> Iterator[Proc]:
    repo = tmp_path / "models"
    for name in MODELS:
        shutil.copytree(model_repo / name, repo / name)
    config = tmp_path / "gateway.yaml"
    config.write_text(f"worker_keepalive_s: {KEEPALIVE_S}\n")
    workers = start_together([lambda: start_worker(repo), lambda: start_worker(repo)])
    try:
        worker_args = [arg for w in workers for arg in ("--worker", worker_url(w))]
        gateway = start(["gateway", *worker_args, "--config", str(config), "--http-port", "0", "--grpc-port", "0"])
        try:
            poll(lambda: [w["state"] for w in cluster_workers(gateway)] == ["ready", "ready"], "both workers ready")
            yield gateway
        finally:
            gateway.stop()
    finally:
        for w in workers:
            w.stop()


def simple_inputs() -> list[grpcclient.InferInput]:
    tensors = []
    for name in ("INPUT0", "INPUT1"):
        tensor = grpcclient.InferInput(name, [1, 16], "INT32")
        tensor.set_data_from_numpy(np.arange(16, dtype=np.int32).reshape(1, 16))
        tensors.append(tensor)
    return tensors


def one_round(gateway: Proc) -> None:
    """A stream over HTTP (SSE), one over gRPC, and a unary call: each must succeed."""
    http = f"http://127.0.0.1:{gateway.ready['http_port']}"
    grpc_url = f"127.0.0.1:{gateway.ready['grpc_port']}"
    body = {"IN": [4, 2, 0, 1], "DELAY": [100, 200, 300, 400], "WAIT": 500}
    sse = requests.post(f"{http}/v2/models/repeat_int32/generate_stream", json=body, timeout=30)
    assert sse.status_code == 200, sse.text
    events = [json.loads(line[len("data: "):]) for line in sse.text.splitlines() if line.startswith("data: ")]
    assert [e["OUT"] for e in events] == [4, 2, 0, 1], sse.text
    stream = Stream(grpc_url)
    stream.send("square_int32", square_inputs(3), "sq", empty_final=True)
    stream.send("repeat_int32", repeat_inputs([5, 6], delay_ms=200), "rep", empty_final=True)
    stream.wait_for(lambda got: sum(1 for r in got if r.final or r.error) >= 2)
    got = stream.finish()
    assert all(r.error is None for r in got), got
    assert [r.values for r in stream.of("sq")] == [[3]] * 3 + [None]
    client = grpcclient.InferenceServerClient(grpc_url)
    try:
        assert client.infer("simple", simple_inputs()).as_numpy("OUTPUT0").shape == (1, 16)
    finally:
        client.close()


def test_idle_and_busy_spells_past_several_keepalive_periods_drop_no_worker(gateway: Proc) -> None:
    grpc_url = f"127.0.0.1:{gateway.ready['grpc_port']}"
    stop = threading.Event()
    errors: list[BaseException] = []
    calls = 0

    def steady_client() -> None:
        # A client calling all along, through the busy half of the rounds.
        nonlocal calls
        client = grpcclient.InferenceServerClient(grpc_url)
        try:
            while not stop.is_set():
                client.infer("simple", simple_inputs())
                calls += 1
        except BaseException as e:  # the test's thread: the failure is reported by the test
            errors.append(e)
        finally:
            client.close()

    busy = threading.Thread(target=steady_client)
    try:
        for n in range(ROUNDS):
            one_round(gateway)
            if n == ROUNDS // 2:
                busy.start()
            # The idle spell under test (not a wait for readiness): past several keepalive periods.
            time.sleep(IDLE_S)
            workers = cluster_workers(gateway)
            assert [w["state"] for w in workers] == ["ready", "ready"], workers
    finally:
        stop.set()
        if busy.is_alive():
            busy.join(timeout=30)
    assert not errors, errors
    assert calls > 0
    workers = cluster_workers(gateway)
    assert [(w["state"], w["load"]["failures"], w["load"]["retries"]) for w in workers] == [("ready", 0, 0)] * 2, (
        workers, gateway.log()[-4000:])


def test_a_triton_server_with_its_defaults_stays_up_through_silent_streams(model_repo: Path,
                                                                          tmp_path: Path) -> None:  # fmt: skip
    """The bundled Triton with its defaults (a ping no sooner than 300 s after the last, 2 strikes) and a
    gateway whose channel to it pings after 1 s of silence (``triton_keepalive_s``, 310 s by default):
    streams held open and silent past several ping periods, with calls between. The channel pings only
    while calls are open and at most twice with no data between (gRPC's default), which Triton's strikes
    allow; a channel pinging without that bound is told GOAWAY too_many_pings here and the silent stream
    fails. No stream may end early, no DOWN, no failure counted."""
    from models.triton import build_triton_repository
    from tests.triton_harness import start_triton, triton_available

    available, reason = triton_available()
    if not available:
        pytest.skip(f"no real Triton here: {reason}")
    repo = tmp_path / "triton-models"
    build_triton_repository(model_repo, repo, ["simple"])
    shutil.copytree(model_repo / "repeat_int32", repo / "repeat_int32")
    triton = start_triton(repo, models=["simple", "repeat_int32"])
    try:
        config = tmp_path / "gateway.yaml"
        config.write_text(f"triton_keepalive_s: {KEEPALIVE_S}\nprobe:\n  interval_s: 0.5\n")
        gateway = start(["gateway", "--worker", f"triton://{triton.grpc_url}", "--config", str(config),
                         "--http-port", "0", "--grpc-port", "0"])
        grpc_url = f"127.0.0.1:{gateway.ready['grpc_port']}"
        try:
            poll(lambda: [w["state"] for w in cluster_workers(gateway)] == ["ready"], "Triton ready")
            client = grpcclient.InferenceServerClient(grpc_url)
            try:
                for n in range(ROUNDS // 2):
                    for _ in range(10):
                        assert client.infer("simple", simple_inputs()).as_numpy("OUTPUT0").shape == (1, 16)
                    # A stream silent for the idle spell under test: its second response waits that long.
                    stream = Stream(grpc_url)
                    stream.send("repeat_int32", repeat_inputs([7, 8], delay_ms=[0, int(IDLE_S * 1000)]), f"quiet-{n}",
                                empty_final=True)
                    stream.wait_for(lambda got: any(r.final or r.error for r in got), timeout_s=IDLE_S * 4)
                    got = stream.finish()
                    assert all(r.error is None for r in got), (got, gateway.log()[-3000:])
                    assert [r.values for r in got if not r.final] == [[7], [8]], got
                    assert [w["state"] for w in cluster_workers(gateway)] == ["ready"], gateway.log()[-3000:]
            finally:
                client.close()
            workers = cluster_workers(gateway)
            assert [(w["state"], w["load"]["failures"], w["load"]["retries"]) for w in workers] == \
                [("ready", 0, 0)], (workers, gateway.log()[-4000:])
        finally:
            gateway.stop()
    finally:
        triton.stop()
