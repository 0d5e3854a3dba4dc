"""Decoupled models on a real ``infergate worker``: the example Python-backend
models ``square_int32`` and ``repeat_int32`` streamed with tritonclient's
``start_stream``/``async_stream_infer``: response counts, values, final flags,
the empty final response only when asked for, several requests interleaved
on one stream, in-stream errors, the unary refusal, statistics, a cancelled
stream reaching the model, and shutdown waiting for an open stream.
"""

from __future__ import annotations

import re
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.harness import Proc, start_worker, worker_url
from tests.integration.workers.decoupled_client import (
    Stream,
    assert_square_answer,
    by_request,
    infer_inputs,
    repeat,
    square,
)

pytestmark = pytest.mark.timeout(60)

MODELS = ("square_int32", "repeat_int32")


@pytest.fixture(scope="module")
def worker(model_repo: Path) -> Iterator[Proc]:
    args = ["--model-control-mode", "explicit", "--metrics-port", "0"]
    for name in MODELS:
        args += ["--load-model", name]
    proc = start_worker(model_repo, *args)
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def client(worker: Proc) -> Iterator[grpcclient.InferenceServerClient]:
    client = grpcclient.InferenceServerClient(worker_url(worker))
    yield client
    client.close()


def pending(worker: Proc, model: str) -> float:
    """The worker's ``nv_inference_pending_request_count`` of ``model`` (its requests in flight)."""
    url = f"http://127.0.0.1:{worker.ready['metrics_port']}/metrics"
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    match = re.search(rf'^nv_inference_pending_request_count{{[^}}]*model="{model}"[^}}]*}} (\S+)$', text, re.M)
    assert match, text
    return float(match.group(1))


def wait_until(condition: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"not within {timeout_s}s: {what}"
        time.sleep(0.02)  # polling a condition with a deadline


def test_config_and_metadata_say_decoupled(client: grpcclient.InferenceServerClient) -> None:
    for name in MODELS:
        config = client.get_model_config(name).config
        assert config.model_transaction_policy.decoupled and config.backend == "python"
        assert client.get_model_metadata(name).platform == "python"


@pytest.mark.parametrize("n", [0, 1, 5, 37])
@pytest.mark.parametrize("empty_final", [True, False])
def test_square(client: grpcclient.InferenceServerClient, n: int, empty_final: bool) -> None:
    stream = Stream(client)
    stream.send("square_int32", square(n), f"sq-{n}", empty_final=empty_final)
    assert_square_answer(stream.close(), f"sq-{n}", n, empty_final)


def test_repeat_keeps_order_and_index(client: grpcclient.InferenceServerClient) -> None:
    values = [4, -2, 0, 7, 2**31 - 1]
    stream = Stream(client)
    stream.send("repeat_int32", repeat(values, delay_ms=[3, 0, 5, 1, 2]), "rep")
    got = stream.until_final("rep")
    assert [r.outputs["OUT"].tolist() for r in got[:-1]] == [[v] for v in values]
    assert [r.outputs["IDX"].tolist() for r in got[:-1]] == [[i] for i in range(len(values))]
    assert got[-1].outputs == {} and got[-1].final and not any(r.final for r in got[:-1])
    assert [r.outputs["IDX"].dtype for r in got[:-1]] == [np.dtype(np.uint32)] * len(values)
    assert len(stream.close()) == len(values) + 1


def test_requests_interleave_on_one_stream(client: grpcclient.InferenceServerClient) -> None:
    stream = Stream(client)
    plans = {"a": [1, 2, 3, 4, 5, 6], "b": [10, 20, 30], "c": [-1, -2, -3, -4]}
    for request_id, values in plans.items():
        stream.send("repeat_int32", repeat(values, delay_ms=2), request_id)
    stream.send("square_int32", square(3), "d")
    stream.send("square_int32", square(2), "e")
    grouped = by_request(stream.close())
    assert sorted(grouped) == ["a", "b", "c", "d", "e"]
    for request_id, values in plans.items():
        got = grouped[request_id]
        assert [r.outputs["OUT"].tolist()[0] for r in got if r.outputs] == values
        assert [r.outputs["IDX"].tolist()[0] for r in got if r.outputs] == list(range(len(values)))
        assert [r.final for r in got] == [False] * len(values) + [True]
    assert_square_answer(grouped["d"], "d", 3, True)
    assert_square_answer(grouped["e"], "e", 2, True)


def test_errors_are_in_stream_and_the_stream_goes_on(client: grpcclient.InferenceServerClient) -> None:
    stream = Stream(client)
    cases = [
        ("square_int32", {"X": np.array([1], dtype=np.int32)}, "unexpected inference input 'X' for model 'square_int32'"),
        ("repeat_int32", {**repeat([1, 2]), "DELAY": np.array([1], dtype=np.uint32)},
         "TritonModelException: DELAY must have as many elements as IN (2), got 1"),
        ("square_int32", square(-3), "IN must be >= 0, got -3"),
    ]  # fmt: skip
    for index, (model, inputs, words) in enumerate(cases):
        stream.send(model, inputs, f"bad-{index}")
        got = stream.next()
        assert got.error == words
    stream.send("square_int32", square(2), "good")
    assert len(stream.until_final("good")) == 3
    received = stream.close()
    assert len(received) == len(cases) + 3


def test_unary_infer_is_refused_in_tritons_words(client: grpcclient.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException) as err:
        client.infer("square_int32", infer_inputs(square(2)))
    assert err.value.status() == "StatusCode.UNIMPLEMENTED"
    assert err.value.message() == "ModelInfer RPC doesn't support models with decoupled transaction policy"


def test_statistics_count_requests(client: grpcclient.InferenceServerClient) -> None:
    def counts() -> tuple[int, int, int]:
        stats = client.get_inference_statistics("square_int32").model_stats[0]
        return stats.inference_stats.success.count, stats.inference_stats.fail.count, stats.execution_count

    before = counts()
    stream = Stream(client)
    stream.send("square_int32", square(4), "ok-1")
    stream.send("square_int32", square(0), "ok-2")
    stream.send("square_int32", square(-1), "fails")
    stream.close()
    after = counts()
    assert (after[0] - before[0], after[1] - before[1], after[2] - before[2]) == (2, 1, 2)


def test_cancelled_stream_reaches_the_model(worker: Proc, client: grpcclient.InferenceServerClient) -> None:
    def failures() -> int:
        return client.get_inference_statistics("repeat_int32").model_stats[0].inference_stats.fail.count

    before = failures()
    stream = Stream(client)
    # 400 responses 50 ms apart: 20 s if nothing stops it.
    stream.send("repeat_int32", repeat(list(range(400)), delay_ms=50), "long")
    assert stream.next().outputs["IDX"].tolist() == [0]  # running
    # Earlier tests' requests leave the count once their execute returned, a moment after their final response.
    wait_until(lambda: pending(worker, "repeat_int32") == 1, 5.0, "only the long request in flight")
    stream.close(cancel=True)
    # The model sees is_cancelled() within a 10 ms slice; the request ends when execute returns.
    wait_until(lambda: pending(worker, "repeat_int32") == 0, 5.0, "the cancelled request leaves the worker")
    assert failures() == before + 1
    # Both instances are free again: two more requests run at once.
    stream = Stream(client)
    stream.send("repeat_int32", repeat([1], wait_ms=0), "after-1")
    stream.send("repeat_int32", repeat([2], wait_ms=0), "after-2")
    assert sorted(by_request(stream.close())) == ["after-1", "after-2"]


def test_shutdown_waits_for_an_open_stream(model_repo: Path) -> None:
    proc = start_worker(model_repo, "--model-control-mode", "explicit", "--load-model", "repeat_int32")
    client = grpcclient.InferenceServerClient(worker_url(proc))
    try:
        stream = Stream(client)
        stream.send("repeat_int32", repeat(list(range(20)), delay_ms=20), "draining")
        assert stream.next().outputs["IDX"].tolist() == [0]
        proc.popen.send_signal(signal.SIGTERM)
        got = stream.until_final("draining")
        assert [r.outputs["IDX"].tolist()[0] for r in got if r.outputs] == list(range(1, 20))
        stream.close()
        assert proc.popen.wait(timeout=30) == 0, proc.log()[-4000:]
    finally:
        client.close()
        proc.kill()
