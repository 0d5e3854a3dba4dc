"""Stateful sequences through a real gateway and real workers: sticky routing
while workers join, Triton's sequence client flows (sync gRPC and HTTP with
integer and string ids, asyncio, the gRPC stream), errors in Triton's words,
and a sequence whose worker is lost."""

from __future__ import annotations

import asyncio
import json
import queue
import shutil
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcclient_aio
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from models.sequences import SEQUENCE_MODEL_NAMES
from tests.harness import Proc, start, start_worker, worker_url

pytestmark = pytest.mark.timeout(180)
FAST = "probe:\n  interval_s: 0.3\nmembership:\n  heartbeat_interval_s: 0.3\n"
VALUES = [11, 7, 5, 3, 2, 0, 1]  # Triton's sequence client examples send these


@pytest.fixture(scope="module")
def repo(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sequence-models")
    for name in SEQUENCE_MODEL_NAMES:
        shutil.copytree(model_repo / name, root / name)
    return root


class Cluster:
    def __init__(self, repo: Path, tmp: Path) -> None:
        self.repo, self.tmp = repo, tmp
        self.procs: list[Proc] = []
        self.gateway: Proc | None = None

    def start(self, workers: int) -> Proc:
        self.procs.extend(start_worker(self.repo) for _ in range(workers))
        config = self.tmp / "gateway.yaml"
        config.write_text(FAST)
        args = [arg for w in self.procs for arg in ("--worker", worker_url(w))]
        self.gateway = start(["gateway", *args, "--http-port", "0", "--grpc-port", "0", "--config", str(config)])
        return self.gateway

    def join(self) -> Proc:
        assert self.gateway is not None
        proc = start_worker(self.repo, "--gateway", f"127.0.0.1:{self.gateway.ready['grpc_port']}",
                            "--heartbeat-interval", "0.3")
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in ([self.gateway] if self.gateway else []) + self.procs:
            if proc.popen.poll() is None:
                proc.stop()


@pytest.fixture
def cluster(repo: Path, tmp_path: Path) -> Iterator[Cluster]:
    group = Cluster(repo, tmp_path)
    try:
        yield group
    finally:
        group.close()


def grpc_url(proc: Proc) -> str:
    return f"127.0.0.1:{proc.ready['grpc_port']}"


def http_url(proc: Proc) -> str:
    return f"127.0.0.1:{proc.ready['http_port']}"


def ready_workers(gateway: Proc) -> int:
    """Replicas of `accumulate` the gateway routes to."""
    with urllib.request.urlopen(f"http://{http_url(gateway)}/v2/cluster", timeout=10) as response:
        doc: Any = json.loads(response.read())
    return sum(len(m["replicas"]) for m in doc["models"] if m["name"] == "accumulate")


def wait_for(condition: Any, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def tensor(module: Any, value: int) -> list[Any]:
    inp = module.InferInput("INPUT", [1, 1], "INT32")
    inp.set_data_from_numpy(np.array([[value]], dtype=np.int32))
    return [inp]


def send(client: Any, module: Any, model: str, seq: int | str, value: int, start: bool, end: bool) -> int:
    result = client.infer(model, tensor(module, value), sequence_id=seq, sequence_start=start, sequence_end=end)
    return int(result.as_numpy("OUTPUT")[0][0])


def expected_simple(first: int, values: list[int], dyna: bool, corrid: int) -> list[int]:
    """What Triton's examples expect of simple_sequence (INPUT + START) and simple_dyna_sequence (+ CORRID at END)."""
    out = [first + 1] + list(values)
    if dyna:
        out[-1] += corrid
    return out


def test_interleaved_accumulators_stick_to_their_workers_while_one_joins(cluster: Cluster) -> None:
    gateway = cluster.start(workers=2)
    ids: list[int | str] = [1, 2, "three", "four"]
    sums = dict.fromkeys(ids, 0)
    with grpcclient.InferenceServerClient(grpc_url(gateway)) as client:
        def step(round_: int, *, start: bool = False, end: bool = False) -> None:
            for k, seq in enumerate(ids):
                value = 100 * (k + 1) + round_
                sums[seq] += value
                assert send(client, grpcclient, "accumulate", seq, value, start, end) == sums[seq], (seq, round_)

        step(0, start=True)
        step(1)
        cluster.join()
        wait_for(lambda: ready_workers(gateway) == 3)
        for round_ in range(2, 6):
            step(round_)
        step(6, end=True)
        # New sequences may land on the new worker; each still gets its own sum.
        sums = dict.fromkeys(ids, 0)
        step(7, start=True)
        step(8, end=True)
    executions = 0
    for proc in cluster.procs:
        with grpcclient.InferenceServerClient(worker_url(proc)) as direct:
            executions += direct.get_inference_statistics("accumulate").model_stats[0].execution_count
    assert executions == 4 * 9  # each request ran exactly once, on one worker


def test_tritons_sequence_examples(cluster: Cluster) -> None:
    gateway = cluster.start(workers=2)
    for dyna in (False, True):
        model = "simple_dyna_sequence" if dyna else "simple_sequence"
        for module, url in ((grpcclient, grpc_url(gateway)), (httpclient, http_url(gateway))):
            with module.InferenceServerClient(url) as client:
                seq0 = [send(client, module, model, 1000, v, i == 0, i == len(VALUES)) for i, v in enumerate([0] + VALUES)]
                seq1 = [send(client, module, model, 1001, v, i == 0, i == len(VALUES))
                        for i, v in enumerate([100] + [-v for v in VALUES])]
                assert seq0 == expected_simple(0, VALUES, dyna, 1000)
                assert seq1 == expected_simple(100, [-v for v in VALUES], dyna, 1001)
                # A string sequence id, as the examples send: a UUID to simple_sequence; to the dyna
                # model, its string twin, with an id that reads as an integer (added at END).
                sid = "1002" if dyna else str(uuid.uuid4())
                string_model = "simple_string_dyna_sequence" if dyna else model
                got = [send(client, module, string_model, sid, v, i == 0, i == len(VALUES))
                       for i, v in enumerate([20] + [-v for v in VALUES])]
                assert got == expected_simple(20, [-v for v in VALUES], dyna, 1002)


def test_tritons_streaming_and_asyncio_sequence_examples(cluster: Cluster) -> None:
    gateway = cluster.start(workers=2)
    results: queue.Queue = queue.Queue()
    sid = str(uuid.uuid4())
    with grpcclient.InferenceServerClient(grpc_url(gateway)) as client:
        client.start_stream(callback=lambda result, error: results.put(error or result))
        for seq, first in ((1000, 0), (1001, 100), (sid, 20)):
            values = [first] + (VALUES if first == 0 else [-v for v in VALUES])
            for i, value in enumerate(values):
                client.async_stream_infer("simple_sequence", tensor(grpcclient, value), request_id=f"{seq}_{i}",
                                          sequence_id=seq, sequence_start=i == 0, sequence_end=i == len(values) - 1)
        got: dict[str, dict[int, int]] = {}
        for _ in range(3 * (len(VALUES) + 1)):
            item = results.get(timeout=60)
            assert not isinstance(item, InferenceServerException), item
            seq, index = item.get_response().id.rsplit("_", 1)
            got.setdefault(seq, {})[int(index)] = int(item.as_numpy("OUTPUT")[0][0])
        client.stop_stream()
    assert [got["1000"][i] for i in range(8)] == expected_simple(0, VALUES, False, 0)
    assert [got[sid][i] for i in range(8)] == expected_simple(20, [-v for v in VALUES], False, 0)

    async def aio() -> list[int]:
        async with grpcclient_aio.InferenceServerClient(grpc_url(gateway)) as client:
            out = []
            for i, value in enumerate([0] + VALUES):
                result = await client.infer("simple_dyna_sequence", tensor(grpcclient_aio, value), sequence_id=1000,
                                            sequence_start=i == 0, sequence_end=i == len(VALUES))
                out.append(int(result.as_numpy("OUTPUT")[0][0]))
            return out

    assert asyncio.run(aio()) == expected_simple(0, VALUES, True, 1000)


def executions(proc: Proc) -> int:
    with grpcclient.InferenceServerClient(worker_url(proc)) as direct:
        return direct.get_inference_statistics("accumulate").model_stats[0].execution_count


def test_errors_and_a_lost_worker(cluster: Cluster) -> None:
    gateway = cluster.start(workers=2)
    with grpcclient.InferenceServerClient(grpc_url(gateway)) as client:
        with pytest.raises(InferenceServerException, match="must specify a non-zero or non-empty correlation ID"):
            client.infer("accumulate", tensor(grpcclient, 1))
        with pytest.raises(InferenceServerException, match="sequence 9 to model 'accumulate' must specify the START flag"):
            send(client, grpcclient, "accumulate", 9, 1, False, False)
        assert send(client, grpcclient, "accumulate", 5, 2, True, False) == 2
        # A drain waits for open sequences and moves none: timed out, it says so, and the sequence goes on there.
        holder = next(p for p in cluster.procs if executions(p) == 1)
        request = urllib.request.Request(
            f"http://{http_url(gateway)}/v2/cluster/workers/{worker_url(holder)}/drain?timeout_s=0.3", method="POST"
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            drained = json.loads(response.read())
        assert (drained["state"], drained["open_sequences"]) == ("draining", 1)
        assert send(client, grpcclient, "accumulate", 5, 3, False, False) == 5
        assert executions(holder) == 2
        holder.kill()
        with pytest.raises(InferenceServerException, match="sequence 5 of model 'accumulate' was lost"):
            send(client, grpcclient, "accumulate", 5, 4, False, False)
