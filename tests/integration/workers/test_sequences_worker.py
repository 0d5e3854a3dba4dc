"""Triton's sequence batching on a real worker: control inputs, implicit state,
interleaved sequences, idle release and Triton's error words, over gRPC with
tritonclient (sync and streaming)."""

from __future__ import annotations

import queue
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from models.sequences import SEQUENCE_MODEL_NAMES
from tests.harness import Proc, start_worker, worker_url

pytestmark = pytest.mark.timeout(120)
SHORT_IDLE = "max_sequence_idle_microseconds: 10000000"


@pytest.fixture(scope="module")
def worker(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    root = tmp_path_factory.mktemp("sequence-repo")
    for name in SEQUENCE_MODEL_NAMES:
        shutil.copytree(model_repo / name, root / name)
    # A copy of `accumulate` that releases sequences idle for 1 µs: any later request finds it gone.
    shutil.copytree(model_repo / "accumulate", root / "forgetful")
    text = (root / "forgetful" / "config.pbtxt").read_text()
    assert SHORT_IDLE in text
    text = text.replace('name: "accumulate"', 'name: "forgetful"').replace(SHORT_IDLE, "max_sequence_idle_microseconds: 1")
    (root / "forgetful" / "config.pbtxt").write_text(text)
    proc = start_worker(root)
    try:
        yield proc
    finally:
        proc.stop()


def _input(value: int) -> list[grpcclient.InferInput]:
    inp = grpcclient.InferInput("INPUT", [1, 1], "INT32")
    inp.set_data_from_numpy(np.array([[value]], dtype=np.int32))
    return [inp]


def _send(client: grpcclient.InferenceServerClient, model: str, seq: int | str, value: int, *,
          start: bool = False, end: bool = False) -> int:
    result = client.infer(model, _input(value), sequence_id=seq, sequence_start=start, sequence_end=end)
    return int(result.as_numpy("OUTPUT")[0][0])


def test_simple_sequence_adds_start(worker: Proc) -> None:
    with grpcclient.InferenceServerClient(worker_url(worker)) as client:
        assert _send(client, "simple_sequence", 7, 10, start=True) == 11
        assert _send(client, "simple_sequence", 7, 5) == 5
        assert _send(client, "simple_sequence", 7, 3, end=True) == 3


def test_dyna_sequence_adds_the_correlation_id_at_end(worker: Proc) -> None:
    with grpcclient.InferenceServerClient(worker_url(worker)) as client:
        assert _send(client, "simple_dyna_sequence", 1000, 0, start=True) == 1
        assert _send(client, "simple_dyna_sequence", 1000, 2) == 2
        assert _send(client, "simple_dyna_sequence", 1000, 1, end=True) == 1001


def test_interleaved_accumulators_keep_their_own_state(worker: Proc) -> None:
    ids: list[int | str] = [11, 12, "alpha", "beta"]
    sums = dict.fromkeys(ids, 0)
    with grpcclient.InferenceServerClient(worker_url(worker)) as client:
        for step in range(5):
            for k, seq in enumerate(ids):
                value = (k + 1) * 10 + step
                sums[seq] += value
                got = _send(client, "accumulate", seq, value, start=step == 0, end=step == 4)
                assert got == sums[seq], (seq, step)
        # A START on an id whose sequence ended begins again from zero.
        assert _send(client, "accumulate", 11, 4, start=True) == 4
        # So does a START on an open sequence (Triton restarts it).
        assert _send(client, "accumulate", 11, 6, start=True) == 6


def test_streamed_requests_of_a_sequence_run_in_order(worker: Proc) -> None:
    results: queue.Queue = queue.Queue()
    values = list(range(1, 21))
    with grpcclient.InferenceServerClient(worker_url(worker)) as client:
        client.start_stream(callback=lambda result, error: results.put(error or result))
        for i, value in enumerate(values):
            client.async_stream_infer("accumulate", _input(value), request_id=str(i), sequence_id=99,
                                      sequence_start=i == 0, sequence_end=i == len(values) - 1)
        got = {}
        for _ in values:
            item = results.get(timeout=60)
            assert not isinstance(item, InferenceServerException), item
            got[int(item.get_response().id)] = int(item.as_numpy("OUTPUT")[0][0])
        client.stop_stream()
    assert [got[i] for i in range(len(values))] == list(np.cumsum(values))


def test_errors_in_tritons_words(worker: Proc) -> None:
    with grpcclient.InferenceServerClient(worker_url(worker)) as client:
        with pytest.raises(InferenceServerException, match="must specify a non-zero or non-empty correlation ID"):
            client.infer("accumulate", _input(1))
        with pytest.raises(InferenceServerException, match="must specify the START flag on the first request of the sequence"):
            _send(client, "accumulate", 424242, 1)
        batch = grpcclient.InferInput("INPUT", [2, 1], "INT32")
        batch.set_data_from_numpy(np.array([[1], [2]], dtype=np.int32))
        with pytest.raises(InferenceServerException, match="must specify batch-size 1"):
            client.infer("accumulate", [batch], sequence_id=5, sequence_start=True)


def test_an_idle_sequence_is_released(worker: Proc) -> None:
    with grpcclient.InferenceServerClient(worker_url(worker)) as client:
        assert _send(client, "forgetful", 1, 3, start=True) == 3
        # Idle longer than 1 µs by the time the next request arrives: released.
        with pytest.raises(InferenceServerException, match="sequence 1 to model 'forgetful' must specify the START flag"):
            _send(client, "forgetful", 1, 3)


def test_initial_state_from_a_data_file(worker: Proc) -> None:
    """`accumulate_seeded` starts each sequence from its initial_state/ file (100), not zeros; a START restarts it."""
    with grpcclient.InferenceServerClient(worker_url(worker)) as client:
        assert _send(client, "accumulate_seeded", 1, 5, start=True) == 105
        assert _send(client, "accumulate", 1, 5, start=True) == 5  # zero_data, beside it
        assert _send(client, "accumulate_seeded", 2, 1, start=True) == 101
        assert _send(client, "accumulate_seeded", 1, 2) == 107
        assert _send(client, "accumulate_seeded", 1, 3, start=True) == 103
        assert _send(client, "accumulate_seeded", 2, 1, end=True) == 102
