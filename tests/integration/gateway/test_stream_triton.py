"""Streams through the gateway to a real Triton Inference Server (tests/triton_harness.py)
serving the example repository's own ``square_int32`` and ``repeat_int32`` files in its
Python backend, attached to the gateway as a worker of kind ``triton``.

Checked: the gateway reads the decoupled flag from Triton's model config; counts,
order, final flags and the empty final response only when asked; requests
interleaved on one stream; a unary call refused in Triton's words; a client's
cancel reaching the model in Triton (the model stops and Triton releases the request).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.harness import Proc, start
from tests.integration.gateway.stream_clients import Stream, metric, poll, repeat_inputs, square_inputs
from tests.triton_harness import TritonProc, start_triton, triton_available

AVAILABLE, REASON = triton_available()

pytestmark = [
    pytest.mark.triton,
    pytest.mark.timeout(180),
    pytest.mark.skipif(not AVAILABLE, reason=f"no real Triton here: {REASON}"),
]

MODELS = ["square_int32", "repeat_int32"]


@dataclass
class Pool:
    triton: TritonProc
    gateway: Proc

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.gateway.ready['grpc_port']}"

    @property
    def triton_metrics(self) -> str:
        return f"127.0.0.1:{self.triton.metrics_port}"


@pytest.fixture(scope="module")
def pool(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    repo = tmp_path_factory.mktemp("triton-stream-models")
    for name in MODELS:  # the same files our worker runs
        shutil.copytree(model_repo / name, repo / name)
    triton = start_triton(repo, models=MODELS)
    try:
        config = tmp_path_factory.mktemp("gateway") / "gateway.yaml"
        config.write_text(f"probe:\n  interval_s: 0.5\nworkers:\n  - address: {triton.grpc_url}\n    kind: triton\n")
        gateway = start(["gateway", "--http-port", "0", "--grpc-port", "0", "--config", str(config)])
        try:
            client = grpcclient.InferenceServerClient(f"127.0.0.1:{gateway.ready['grpc_port']}")
            poll(lambda: all(client.is_model_ready(m) for m in MODELS), "models ready through the gateway")
            client.close()
            yield Pool(triton, gateway)
        finally:
            gateway.stop()
    finally:
        triton.stop()


def test_square_and_repeat_through_the_gateway(pool: Pool) -> None:
    client = grpcclient.InferenceServerClient(pool.grpc_url)
    try:
        assert client.get_model_config("square_int32").config.model_transaction_policy.decoupled
    finally:
        client.close()
    stream = Stream(pool.grpc_url)
    stream.send("square_int32", square_inputs(3), "sq", empty_final=True)
    stream.send("square_int32", square_inputs(2), "sq-plain")
    stream.send("repeat_int32", repeat_inputs([7, 8, 9], delay_ms=20), "rep", empty_final=True)
    stream.send("repeat_int32", repeat_inputs([4, 5, 6], delay_ms=20), "rep2", empty_final=True)
    got = stream.finish()
    assert all(r.error is None for r in got), got
    assert [(r.values, r.final) for r in stream.of("sq")] == [([3], False)] * 3 + [(None, True)]
    assert [(r.values, r.final) for r in stream.of("sq-plain")] == [([2], False)] * 2
    for request_id, values in (("rep", [7, 8, 9]), ("rep2", [4, 5, 6])):
        mine = stream.of(request_id)
        assert [(r.values[0], r.index) for r in mine[:-1]] == list(zip(values, range(3)))
        assert mine[-1].final is True and mine[-1].values is None


def test_a_unary_call_is_refused_in_tritons_words(pool: Pool) -> None:
    client = grpcclient.InferenceServerClient(pool.grpc_url)
    try:
        with pytest.raises(InferenceServerException) as refused:
            client.infer("square_int32", square_inputs(1))
        assert refused.value.status() == "StatusCode.UNIMPLEMENTED"
        assert refused.value.message() == "ModelInfer RPC doesn't support models with decoupled transaction policy"
    finally:
        client.close()


def test_a_client_cancel_reaches_the_model_in_triton(pool: Pool) -> None:
    label = 'model="repeat_int32"'
    done_before = metric(pool.triton_metrics, "nv_inference_request_success", label)
    stream = Stream(pool.grpc_url)
    stream.send("repeat_int32", repeat_inputs(list(range(200)), delay_ms=50), "long", empty_final=True)
    stream.wait_for(lambda got: len(got) >= 2)
    stream.finish(cancel=True)
    # Ten seconds of responses unless the model saw is_cancelled(): then it stops at once and
    # Triton releases the request (counted when released; Triton's queue count is 0 throughout).
    poll(lambda: metric(pool.triton_metrics, "nv_inference_request_success", label) == done_before + 1,
         "Triton released the cancelled request", timeout_s=5.0)
    assert len(stream.got) < 200
