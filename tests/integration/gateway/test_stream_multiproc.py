"""Streams through several gateway processes (``infergate up --gateway-processes 2``)
behind one pair of ports, with real processes and the stock tritonclient.

Every process reads each worker's model config itself, so each knows the model
is decoupled: a process that did not would send the request as a batch and the
worker would refuse it. Each stream and each unary call goes over a fresh
connection, so the kernel spreads them over both processes (twelve of each:
all on one process by chance once in two thousand runs). The whole gateway's
/metrics sums the processes' stream counters exactly.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.harness import Proc, start
from tests.integration.gateway.stream_clients import Stream, metric, poll, square_inputs

pytestmark = pytest.mark.timeout(120)

CONNECTIONS = 12


@pytest.fixture(scope="module")
def up(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    repo = tmp_path_factory.mktemp("stream-models")
    for name in ("square_int32", "simple"):
        shutil.copytree(model_repo / name, repo / name)
    proc = start(["up", "--workers", "1", "--gateway-processes", "2", "--model-repository", str(repo),
                  "--http-port", "0", "--grpc-port", "0"])
    try:
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{proc.ready['grpc_port']}")
        poll(lambda: client.is_model_ready("square_int32"), "the model ready")
        client.close()
        yield proc
    finally:
        proc.stop()


def test_streams_through_every_process(up: Proc) -> None:
    grpc_url, http_url = f"127.0.0.1:{up.ready['grpc_port']}", f"127.0.0.1:{up.ready['http_port']}"
    label = 'model="square_int32"'
    before = metric(http_url, "infergate_stream_responses_total", label)

    def one(k: int) -> list:
        stream = Stream(grpc_url)  # a fresh connection
        stream.send("square_int32", square_inputs(k % 4 + 1), f"r{k}", empty_final=True)
        return stream.finish()

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, range(CONNECTIONS)))
    for k, got in enumerate(results):
        n = k % 4 + 1
        assert [r.values for r in got] == [[n]] * n + [None], got
        assert got[-1].final is True
    sent = sum(k % 4 + 2 for k in range(CONNECTIONS))
    assert metric(http_url, "infergate_stream_responses_total", label) == before + sent
    assert metric(http_url, "infergate_streams_open", label) == 0


def test_every_process_refuses_a_unary_call(up: Proc) -> None:
    for _ in range(CONNECTIONS):
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{up.ready['grpc_port']}")
        try:
            with pytest.raises(InferenceServerException) as refused:
                client.infer("square_int32", square_inputs(1))
            assert refused.value.status() == "StatusCode.UNIMPLEMENTED"
            assert "doesn't support models with decoupled transaction policy" in refused.value.message()
        finally:
            client.close()
