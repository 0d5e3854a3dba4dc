"""``infergate serve``: the gateway running the repository's models in its own
process (a local replica), driven by the real tritonclient over HTTP and gRPC
and checked against ONNX Runtime run directly on the same files; a bad
request stays a 4xx; load and unload through the gateway; statistics and
metrics; an ensemble, a stateful sequence and a decoupled model's stream;
and a local replica beside a
remote worker, both serving one model (seen in their statistics), through
``serve --worker`` and ``up --local``.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.harness import Proc, start, start_worker, worker_url
from tests.integration.gateway.e2e_cluster import (
    MODELS,
    assert_outputs_equal,
    grpc_inputs,
    grpc_url,
    http_inputs,
    http_url,
    make_inputs,
    onnx_references,
)
from tests.integration.gateway.stream_clients import Stream, repeat_inputs

pytestmark = pytest.mark.timeout(180)


def start_serve(model_repo: Path, *extra: str) -> Proc:
    return start(["serve", "--model-repository", str(model_repo), "--http-port", "0", "--grpc-port", "0", *extra])


@pytest.fixture(scope="module")
def served(model_repo: Path) -> Iterator[Proc]:
    proc = start_serve(model_repo)
    try:
        yield proc
    finally:
        proc.stop()


def get_json(proc: Proc, path: str) -> dict:
    with urllib.request.urlopen(f"http://{http_url(proc)}{path}", timeout=30) as response:
        return json.loads(response.read())


def test_serve_is_ready_with_every_example_model_local(served: Proc) -> None:
    client = grpcclient.InferenceServerClient(grpc_url(served))
    assert client.is_server_ready()
    for model in (*MODELS, "identity_string"):
        assert client.is_model_ready(model), model
    (worker,) = get_json(served, "/v2/cluster")["workers"]
    assert (worker["address"], worker["kind"], worker["state"]) == ("local", "local", "ready")


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("model", MODELS)
def test_answers_equal_onnx_runtime(served: Proc, model_repo: Path, model: str, protocol: str) -> None:
    """simple, mlp, cnn and encoder (input-dependent shapes) through serve, as ONNX Runtime answers."""
    references = onnx_references(model_repo)
    rng = np.random.default_rng(7)
    for rows in (1, 3):
        inputs = make_inputs(model, rows, rng)
        want = references[model](inputs)
        if protocol == "http":
            client = httpclient.InferenceServerClient(http_url(served))
            result = client.infer(model, http_inputs(inputs, binary=True),
                                  outputs=[httpclient.InferRequestedOutput(n) for n in want])
        else:
            client = grpcclient.InferenceServerClient(grpc_url(served))
            result = client.infer(model, grpc_inputs(inputs), outputs=[grpcclient.InferRequestedOutput(n) for n in want])
        assert_outputs_equal({n: result.as_numpy(n) for n in want}, want)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_string_tensors_round_trip(served: Proc, protocol: str) -> None:
    texts = np.array(["hello", "wörld", "", "a" * 300], dtype=np.object_)
    module = httpclient if protocol == "http" else grpcclient
    client = module.InferenceServerClient(http_url(served) if protocol == "http" else grpc_url(served))
    tensor = module.InferInput("INPUT0", [len(texts)], "BYTES")
    tensor.set_data_from_numpy(texts)
    result = client.infer("identity_string", [tensor])
    assert [t.decode() for t in result.as_numpy("OUTPUT0")] == list(texts)


def test_a_bad_request_stays_a_client_error(served: Proc) -> None:
    wrong = {"INPUT": np.zeros((1, 63), dtype=np.float32)}  # mlp takes 64 columns
    with pytest.raises(InferenceServerException) as http_error:
        httpclient.InferenceServerClient(http_url(served)).infer("mlp", http_inputs(wrong, binary=True))
    assert http_error.value.status() == "400", http_error.value
    with pytest.raises(InferenceServerException) as grpc_error:
        grpcclient.InferenceServerClient(grpc_url(served)).infer("mlp", grpc_inputs(wrong))
    assert grpc_error.value.status() == "StatusCode.INVALID_ARGUMENT", grpc_error.value
    # The local replica took no fault for it: still READY, still serving.
    assert get_json(served, "/v2/cluster")["workers"][0]["state"] == "ready"
    ok = {"INPUT": np.zeros((1, 64), dtype=np.float32)}
    grpcclient.InferenceServerClient(grpc_url(served)).infer("mlp", grpc_inputs(ok))


def test_unload_and_load_through_the_gateway(served: Proc) -> None:
    client = httpclient.InferenceServerClient(http_url(served))
    client.unload_model("cnn")
    assert not client.is_model_ready("cnn")
    with pytest.raises(InferenceServerException):
        client.infer("cnn", http_inputs({"IMAGE": np.zeros((1, 3, 32, 32), dtype=np.float32)}, binary=True))
    client.load_model("cnn")
    assert client.is_model_ready("cnn")
    result = client.infer("cnn", http_inputs({"IMAGE": np.zeros((1, 3, 32, 32), dtype=np.float32)}, binary=True))
    assert result.as_numpy("PROBS").shape == (1, 10)


def test_statistics_come_from_the_local_replica(served: Proc) -> None:
    grpcclient.InferenceServerClient(grpc_url(served)).infer(
        "simple", grpc_inputs(make_inputs("simple", 1, np.random.default_rng(1))))
    body = get_json(served, "/v2/models/simple/stats?workers=true")
    (local,) = body["workers"]
    assert local["address"] == "local"
    (stats,) = local["model_stats"]
    assert int(stats["execution_count"]) >= 1
    with urllib.request.urlopen(f"http://{http_url(served)}/metrics", timeout=30) as response:
        metrics = response.read().decode()
    assert 'infergate_worker_state{state="READY",worker="local"} 1' in metrics.splitlines(), metrics[:2000]


def test_a_local_and_a_remote_replica_share_one_model(model_repo: Path) -> None:
    worker = start_worker(model_repo)
    try:
        proc = start_serve(model_repo, "--worker", worker_url(worker))
        try:
            cluster = get_json(proc, "/v2/cluster")
            assert {w["address"] for w in cluster["workers"] if w["state"] == "ready"} == {"local", worker_url(worker)}
            session = ort.InferenceSession(str(model_repo / "cnn" / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
            rng = np.random.default_rng(3)
            images = [rng.standard_normal((1, 3, 32, 32), dtype=np.float32) for _ in range(256)]

            def one(image: np.ndarray) -> None:
                client = grpcclient.InferenceServerClient(grpc_url(proc))
                got = client.infer("cnn", grpc_inputs({"IMAGE": image})).as_numpy("PROBS")
                np.testing.assert_allclose(got, session.run(["PROBS"], {"IMAGE": image})[0], rtol=1e-5, atol=1e-5)

            # Enough concurrent clients to fill the local replica's slots: the rest go to the worker.
            with ThreadPoolExecutor(32) as pool:
                list(pool.map(one, images))
            body = get_json(proc, "/v2/models/cnn/stats?workers=true")
            executions = {w["address"]: sum(int(s.get("execution_count", 0)) for s in w["model_stats"])
                          for w in body["workers"]}
            assert executions["local"] > 0 and executions[worker_url(worker)] > 0, executions
        finally:
            proc.stop()
    finally:
        worker.stop()


def test_an_ensemble_runs_its_steps_on_the_local_replica(served: Proc) -> None:
    """``classify`` (preprocess -> cnn -> postprocess): the gateway runs the steps, each a local model."""
    images = np.random.default_rng(5).integers(0, 256, (2, 32, 32, 3), dtype=np.uint8)
    tensor = grpcclient.InferInput("IMAGE", list(images.shape), "UINT8")
    tensor.set_data_from_numpy(images)
    result = grpcclient.InferenceServerClient(grpc_url(served)).infer("classify", [tensor])
    assert result.as_numpy("SCORES").shape == (2, 3) and result.as_numpy("CLASSES").shape == (2, 3)


def test_up_local_runs_the_models_in_the_gateway_beside_its_workers(model_repo: Path) -> None:
    proc = start(["up", "--local", "--workers", "1", "--model-repository", str(model_repo),
                  "--http-port", "0", "--grpc-port", "0"])
    try:
        ready = {w["address"] for w in get_json(proc, "/v2/cluster")["workers"] if w["state"] == "ready"}
        assert ready == {"local", proc.ready["workers"][0]["address"]}
        ok = {"INPUT": np.zeros((1, 64), dtype=np.float32)}
        assert grpcclient.InferenceServerClient(grpc_url(proc)).infer("mlp", grpc_inputs(ok)).as_numpy("OUTPUT").shape == (1, 10)
    finally:
        proc.stop()


def test_sequences_keep_their_state_on_the_local_replica(served: Proc) -> None:
    """``accumulate`` (implicit state): two interleaved sequences, each its own running sum."""
    client = grpcclient.InferenceServerClient(grpc_url(served))
    sums = {"a": 0, 7: 0}
    for step in range(4):
        for k, seq in enumerate(sums):
            value = 10 * (k + 1) + step
            sums[seq] += value
            tensor = grpcclient.InferInput("INPUT", [1, 1], "INT32")
            tensor.set_data_from_numpy(np.array([[value]], dtype=np.int32))
            result = client.infer("accumulate", [tensor], sequence_id=seq, sequence_start=step == 0,
                                  sequence_end=step == 3)
            assert int(result.as_numpy("OUTPUT")[0][0]) == sums[seq], (seq, step)


def test_a_decoupled_model_streams_from_the_local_replica(served: Proc) -> None:
    """repeat_int32 through serve's gRPC stream: each response as the model sends it, then the final one."""
    stream = Stream(grpc_url(served))
    stream.send("repeat_int32", repeat_inputs([5, 6, 7], delay_ms=10), "r", empty_final=True)
    stream.send("repeat_int32", repeat_inputs([1, 2], delay_ms=[0]), "bad", empty_final=True)  # DELAY too short
    got = stream.finish()
    mine = stream.of("r")
    assert [r.values[0] for r in mine[:-1] if r.values] == [5, 6, 7], got
    assert [r.final for r in mine] == [False, False, False, True]
    assert any(r.error for r in got), got  # the model's refusal, in-stream as a worker reports it
    (local,) = get_json(served, "/v2/models/repeat_int32/stats?workers=true")["workers"]
    assert local["address"] == "local"
