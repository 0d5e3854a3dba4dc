"""The gateway's streamed requests to an infergate worker on one packed call
(``gateway.replicas.packed_streams``), against real workers on 127.0.0.1.

Checked through ``WorkerClient.stream``, as the gateway streams: concurrent
streams share one call and each gets its own responses in order; the model
sees each request's own id and parameters (ids clients repeat included),
not the call's key; a stream
abandoned by its reader and one past its deadline are cancelled on the
worker (its instance freed, the request counted failed); a worker killed
under open streams fails each as unreachable (retried elsewhere by the
router when nothing was sent yet), and the next stream opens a fresh call.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import struct
from collections.abc import Callable, Iterator
from contextlib import aclosing
from pathlib import Path

import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from gateway.replicas.worker_client import WorkerClient
from gateway.replicas.errors import WorkerUnreachable
from protos.errors import DeadlineExceeded
from tests.harness import Proc, start_worker, worker_url
from tests.integration.gateway.stream_clients import metric
from tests.integration.gateway.stream_clients import repeat_request as repeat

pytestmark = pytest.mark.timeout(120)

LABEL = 'model="repeat_int32"'


# A decoupled model that answers with what it was given: its request's id and parameters.
ECHO_ID_PY = """
import json
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            seen = json.dumps({"id": request.request_id(), "parameters": json.loads(request.parameters())})
            out = pb_utils.Tensor("SEEN", np.array([seen.encode()], dtype=np.object_))
            request.get_response_sender().send(pb_utils.InferenceResponse(output_tensors=[out]),
                                               flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

ECHO_ID_CONFIG = """
name: "echo_id"
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "SEEN" data_type: TYPE_STRING dims: [ 1 ] } ]
model_transaction_policy { decoupled: true }
instance_group [ { count: 2 kind: KIND_CPU } ]
"""


@pytest.fixture(scope="module")
def repo(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("packed-streams")
    shutil.copytree(model_repo / "repeat_int32", root / "repeat_int32")
    (root / "echo_id" / "1").mkdir(parents=True)
    (root / "echo_id" / "1" / "model.py").write_text(ECHO_ID_PY)
    (root / "echo_id" / "config.pbtxt").write_text(ECHO_ID_CONFIG)
    return root


@pytest.fixture(scope="module")
def worker(repo: Path) -> Iterator[Proc]:
    proc = start_worker(repo, "--metrics-port", "0")
    try:
        yield proc
    finally:
        proc.stop()


def counting_opens(client: WorkerClient) -> list[int]:
    """How many packed calls the client opens from now on."""
    opened: list[int] = []
    packed = client._packed
    assert packed is not None
    open_call = packed._open_call
    packed._open_call = lambda metadata: opened.append(1) or open_call(metadata)  # type: ignore[method-assign]
    return opened


async def values(client: WorkerClient, request: service_pb2.ModelInferRequest, timeout_s: float | None = 30,
                 stop_after: int | None = None) -> list[int]:
    got: list[int] = []
    async with aclosing(client.stream(request, timeout_s)) as responses:
        async for response, _ in responses:
            if response.raw_output_contents:
                got.append(struct.unpack("<i", response.raw_output_contents[0])[0])
            if stop_after is not None and len(got) >= stop_after:
                break
    return got


async def until(condition: Callable[[], bool], what: str, timeout_s: float = 5.0) -> None:
    """Wait until ``condition()`` holds, letting the loop run (the cancel goes out from it)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"{what}: not within {timeout_s} s"
        await asyncio.sleep(0.05)


def pending(proc: Proc) -> float:
    return metric(f"127.0.0.1:{proc.ready['metrics_port']}", "nv_inference_pending_request_count", LABEL)


def failures(proc: Proc) -> float:
    return metric(f"127.0.0.1:{proc.ready['metrics_port']}", "nv_inference_request_failure", LABEL)


async def test_streams_share_one_packed_call_each_in_order(worker: Proc) -> None:
    client = WorkerClient(worker_url(worker), packed_streams=True)
    opened = counting_opens(client)
    try:
        wanted = [[100 * i + k for k in range(3 + i)] for i in range(6)]
        got = await asyncio.gather(*(values(client, repeat(f"same-{i % 2}", v, 3)) for i, v in enumerate(wanted)))
        assert got == wanted  # ids the client repeats do not matter: the call gives its own
        assert len(opened) == 1
        assert await values(client, repeat("again", [5, 6], 0)) == [5, 6]
        assert len(opened) == 1
    finally:
        await client.close()


async def test_the_model_sees_its_clients_id_and_parameters_not_the_calls_key(worker: Proc) -> None:
    client = WorkerClient(worker_url(worker), packed_streams=True)

    async def seen(request_id: str, n: int) -> dict[str, object]:
        request = service_pb2.ModelInferRequest(model_name="echo_id", id=request_id)
        request.inputs.add(name="IN", datatype="INT32", shape=[1])
        request.raw_input_contents.append(np.array([n], np.int32).tobytes())
        request.parameters["note"].string_param = f"n={n}"
        answers = []
        async with aclosing(client.stream(request, 30)) as responses:
            async for response, _ in responses:
                if response.raw_output_contents:
                    raw = response.raw_output_contents[0]
                    answers.append(json.loads(raw[4:4 + struct.unpack("<I", raw[:4])[0]]))
        assert len(answers) == 1
        return answers[0]

    try:
        # Two requests under one id at once (clients pick ids; they need not be unique).
        got = await asyncio.gather(seen("same", 1), seen("same", 2), seen("", 3))
        assert [g["id"] for g in got] == ["same", "same", ""]
        assert [g["parameters"].get("note") for g in got] == ["n=1", "n=2", "n=3"]  # type: ignore[union-attr]
        assert not any(key.startswith("infergate") for g in got for key in g["parameters"])  # type: ignore[union-attr]
    finally:
        await client.close()


async def test_an_abandoned_stream_and_a_deadline_cancel_the_request_on_the_worker(worker: Proc) -> None:
    client = WorkerClient(worker_url(worker), packed_streams=True)
    try:
        before = failures(worker)
        # 200 responses 50 ms apart: ten seconds unless the cancel stops it.
        assert await values(client, repeat("left", list(range(200)), 50), stop_after=2) == [0, 1]
        await until(lambda: pending(worker) == 0, "the abandoned request let go")
        assert failures(worker) == before + 1
        with pytest.raises(DeadlineExceeded, match="deadline exceeded while request 'late'"):
            await values(client, repeat("late", list(range(200)), 50), timeout_s=0.3)
        await until(lambda: pending(worker) == 0, "the late request let go")
        assert failures(worker) == before + 2
    finally:
        await client.close()


async def test_a_killed_worker_fails_its_streams_as_unreachable_and_the_next_opens_a_fresh_call(repo: Path) -> None:
    doomed = start_worker(repo)
    client = WorkerClient(worker_url(doomed), packed_streams=True)
    opened = counting_opens(client)
    try:
        firsts: list[asyncio.Event] = [asyncio.Event(), asyncio.Event()]

        async def long(i: int) -> None:
            async with aclosing(client.stream(repeat(f"long-{i}", list(range(200)), 50), 60)) as rs:
                async for _ in rs:
                    firsts[i].set()

        streams = [asyncio.ensure_future(long(i)) for i in range(2)]
        await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 30)
        doomed.kill()
        for stream in streams:
            with pytest.raises(WorkerUnreachable):
                await asyncio.wait_for(stream, 30)
        with pytest.raises(WorkerUnreachable):
            await values(client, repeat("after", [1], 0), timeout_s=5)
        assert len(opened) == 2
    finally:
        await client.close()
        doomed.kill()


def test_a_call_of_its_own_per_stream_when_asked(worker: Proc) -> None:
    client = WorkerClient(worker_url(worker))  # packed_streams off: Triton's way, one call a request

    async def run() -> None:
        try:
            opened = []
            stub = client._service()
            own_call = stub.ModelStreamInfer
            stub.ModelStreamInfer = lambda **kw: opened.append(1) or own_call(**kw)  # type: ignore[method-assign]
            assert await values(client, repeat("own", [3, 4], 0)) == [3, 4]
            assert await values(client, repeat("own", [5], 0)) == [5]
            assert len(opened) == 2 and client._packed is None  # one call a request
        finally:
            await client.close()

    asyncio.run(run())
