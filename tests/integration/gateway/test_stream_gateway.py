"""Streams of decoupled models through the gateway, with real processes: one
``infergate worker`` serving ``square_int32``, ``repeat_int32`` and ``simple``, a
gateway in front, the stock tritonclient gRPC stream (``start_stream`` /
``async_stream_infer``).

Checked: counts, values, order and final flags; the empty final response only
when asked; requests interleaved on one stream; several streams at once; a
unary call (gRPC and HTTP) refused in Triton's words and codes; an ordinary
model on a stream as before; a client's cancel reaching the model on the
worker; the gateway's statistics and metrics counting streams and responses.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.harness import Proc, start, start_worker, worker_url
from tests.integration.gateway.stream_clients import (
    Stream,
    metric,
    poll,
    repeat_inputs,
    square_inputs,
)

pytestmark = pytest.mark.timeout(120)

MODELS = ("square_int32", "repeat_int32", "simple")


@dataclass
class Cluster:
    worker: Proc
    gateway: Proc

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.gateway.ready['grpc_port']}"

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.gateway.ready['http_port']}"

    @property
    def worker_metrics(self) -> str:
        return f"127.0.0.1:{self.worker.ready['metrics_port']}"


@pytest.fixture(scope="module")
def cluster(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    repo = tmp_path_factory.mktemp("stream-models")
    for name in MODELS:
        shutil.copytree(model_repo / name, repo / name)
    worker = start_worker(repo, "--metrics-port", "0")
    try:
        gateway = start(["gateway", "--worker", worker_url(worker), "--http-port", "0", "--grpc-port", "0"])
        try:
            client = grpcclient.InferenceServerClient(f"127.0.0.1:{gateway.ready['grpc_port']}")
            poll(lambda: all(client.is_model_ready(m) for m in MODELS), "models ready through the gateway")
            client.close()
            yield Cluster(worker, gateway)
        finally:
            gateway.stop()
    finally:
        worker.stop()


def test_the_gateway_knows_the_models_are_decoupled(cluster: Cluster) -> None:
    client = grpcclient.InferenceServerClient(cluster.grpc_url)
    try:
        assert client.get_model_config("square_int32").config.model_transaction_policy.decoupled
        assert not client.get_model_config("simple").config.model_transaction_policy.decoupled
    finally:
        client.close()


def test_square_sends_n_responses_then_the_final_flag_only_when_asked(cluster: Cluster) -> None:
    stream = Stream(cluster.grpc_url)
    stream.send("square_int32", square_inputs(3), "plain")
    stream.send("square_int32", square_inputs(4), "asked", empty_final=True)
    stream.send("square_int32", square_inputs(0), "zero", empty_final=True)
    stream.send("square_int32", square_inputs(0), "zero-plain")
    got = stream.finish()
    assert all(r.error is None for r in got), got
    plain = stream.of("plain")
    assert [r.values for r in plain] == [[3]] * 3 and [r.final for r in plain] == [False] * 3
    asked = stream.of("asked")
    assert [r.values for r in asked] == [[4]] * 4 + [None]
    assert [r.final for r in asked] == [False] * 4 + [True]
    assert [(r.values, r.final) for r in stream.of("zero")] == [(None, True)]
    assert stream.of("zero-plain") == []


def test_repeat_interleaves_requests_on_one_stream_each_in_order(cluster: Cluster) -> None:
    stream = Stream(cluster.grpc_url)
    values = {"a": list(range(10, 20)), "b": [20, 21, 22]}
    delays = {"a": 50, "b": 10}  # b runs inside a's half second
    for request_id, vals in values.items():
        stream.send("repeat_int32", repeat_inputs(vals, delay_ms=delays[request_id]), request_id, empty_final=True)
    got = stream.finish()
    assert all(r.error is None for r in got), got
    for request_id, vals in values.items():
        mine = stream.of(request_id)
        assert [r.values[0] for r in mine[:-1]] == vals
        assert [r.index for r in mine[:-1]] == list(range(len(vals)))
        assert [r.final for r in mine] == [False] * len(vals) + [True]
    ids = [r.id for r in got]
    # Both ran at once: b's responses went out while a's were still coming, not after them.
    assert ids.index("b") < len(ids) - 1 - ids[::-1].index("a")


def test_several_streams_at_once(cluster: Cluster) -> None:
    results: dict[int, list] = {}

    def run(k: int) -> None:
        stream = Stream(cluster.grpc_url)
        for j in range(3):
            stream.send("square_int32", square_inputs(k + j), f"s{k}-{j}", empty_final=True)
        results[k] = stream.finish()

    threads = [threading.Thread(target=run, args=(k,)) for k in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(results) == [1, 2, 3, 4]
    for k, got in results.items():
        assert all(r.error is None for r in got), got
        for j in range(3):
            mine = [r for r in got if r.id == f"s{k}-{j}"]
            assert [r.values for r in mine] == [[k + j]] * (k + j) + [None]


def test_an_in_stream_error_ends_its_request_and_the_stream_goes_on(cluster: Cluster) -> None:
    stream = Stream(cluster.grpc_url)
    stream.send("repeat_int32", repeat_inputs([1, 2], delay_ms=[0]), "bad", empty_final=True)  # DELAY too short
    stream.send("square_int32", square_inputs(2), "good", empty_final=True)
    got = stream.finish()
    errors = [r for r in got if r.error is not None]
    assert len(errors) == 1 and "DELAY" in errors[0].error, got
    assert [r.values for r in stream.of("good")] == [[2], [2], None]


def test_a_request_timeout_ends_its_stream_in_words_that_say_so(cluster: Cluster) -> None:
    stream = Stream(cluster.grpc_url)
    # Each value waits 2 s; the request's own timeout (Triton's `timeout` parameter) is 0.3 s.
    stream.send("repeat_int32", repeat_inputs([1, 2, 3], delay_ms=2000), "slow", timeout_us=300_000)
    stream.send("square_int32", square_inputs(1), "quick", empty_final=True)
    got = stream.wait_for(lambda got: any(r.error for r in got) and len([r for r in got if r.id == "quick"]) == 2)
    errors = [r.error for r in got if r.error]
    assert len(errors) == 1 and "deadline exceeded" in errors[0] and "'slow'" in errors[0], errors
    assert "Stream removed" not in errors[0]
    stream.finish(cancel=True)


def test_a_unary_call_to_a_decoupled_model_is_refused_in_tritons_words(cluster: Cluster) -> None:
    client = grpcclient.InferenceServerClient(cluster.grpc_url)
    try:
        with pytest.raises(InferenceServerException) as refused:
            client.infer("square_int32", square_inputs(1))
        assert refused.value.status() == "StatusCode.UNIMPLEMENTED"
        assert "ModelInfer RPC doesn't support models with decoupled transaction policy" in refused.value.message()
    finally:
        client.close()
    http = httpclient.InferenceServerClient(cluster.http_url)
    try:
        tensor = httpclient.InferInput("IN", [1], "INT32")
        tensor.set_data_from_numpy(np.array([1], np.int32))
        with pytest.raises(InferenceServerException) as refused_http:
            http.infer("square_int32", [tensor])
        assert "doesn't support models with decoupled transaction policy" in refused_http.value.message()
        assert refused_http.value.status() == "501"
    finally:
        http.close()


def test_an_ordinary_model_on_a_stream_answers_once_as_before(cluster: Cluster) -> None:
    stream = Stream(cluster.grpc_url)
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        tensor = grpcclient.InferInput(name, [1, 16], "INT32")
        tensor.set_data_from_numpy(a)
        inputs.append(tensor)
    stream.client.async_stream_infer("simple", inputs, request_id="one")
    stream.client.async_stream_infer("simple", inputs, request_id="two", enable_empty_final_response=True)
    stream.finish()
    one, two = stream.of("one"), stream.of("two")
    assert len(one) == 1 and one[0].final is None and one[0].error is None
    assert len(two) == 1 and two[0].final is True


def test_a_client_cancel_reaches_the_model_on_the_worker(cluster: Cluster) -> None:
    label = 'model="repeat_int32"'
    failed_before = metric(cluster.worker_metrics, "nv_inference_request_failure", label)
    stream = Stream(cluster.grpc_url)
    # 200 responses 50 ms apart: ten seconds unless the cancel stops it.
    stream.send("repeat_int32", repeat_inputs(list(range(200)), delay_ms=50), "long", empty_final=True)
    stream.wait_for(lambda got: len(got) >= 2)
    poll(lambda: metric(cluster.worker_metrics, "nv_inference_pending_request_count", label) == 1,
         "the request in flight on the worker")
    stream.finish(cancel=True)
    # The model saw is_cancelled() and returned: its instance is free, the request failed (cancelled).
    poll(lambda: metric(cluster.worker_metrics, "nv_inference_pending_request_count", label) == 0,
         "the worker let the cancelled request go", timeout_s=5.0)
    assert metric(cluster.worker_metrics, "nv_inference_request_failure", label) == failed_before + 1
    poll(lambda: metric(cluster.http_url, "infergate_streams_open", label) == 0, "the gateway closed the stream")
    assert len(stream.got) < 200


def test_statistics_and_metrics_count_streams_and_responses(cluster: Cluster) -> None:
    client = grpcclient.InferenceServerClient(cluster.grpc_url)
    label = 'model="square_int32"'
    try:
        def successes() -> int:
            stats = client.get_inference_statistics("square_int32").model_stats
            return sum(s.inference_stats.success.count for s in stats)

        before = successes()
        responses_before = metric(cluster.http_url, "infergate_stream_responses_total", label)
        streams_before = metric(cluster.http_url, "infergate_streams_total", label)
        forwarded_before = metric(cluster.http_url, "infergate_stream_forward_seconds_count")
        stream = Stream(cluster.grpc_url)
        stream.send("square_int32", square_inputs(5), "x")
        stream.send("square_int32", square_inputs(2), "y", empty_final=True)
        stream.finish()
        assert successes() == before + 2
        assert metric(cluster.http_url, "infergate_stream_responses_total", label) == responses_before + 8
        assert metric(cluster.http_url, "infergate_streams_total", label) == streams_before + 2
        assert metric(cluster.http_url, "infergate_stream_forward_seconds_count") == forwarded_before + 8
        assert metric(cluster.http_url, "infergate_stream_first_response_seconds_count", label) >= 2
        assert metric(cluster.http_url, "infergate_streams_open", label) == 0
    finally:
        client.close()
