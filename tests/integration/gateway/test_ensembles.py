"""The example ``classify`` ensemble (preprocess -> cnn -> postprocess) run by a
real gateway with its steps on different workers: worker A serves
``preprocess``, ``postprocess`` and the ensemble's config, worker B serves
``cnn``. Its answers must equal the three ONNX models run by hand with ONNX
Runtime, over HTTP and gRPC; it has its own metadata, config, readiness and
statistics; a worker refuses to run it; a lost step fails it naming the step.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aiogrpc
import tritonclient.http as httpclient
from google.protobuf import json_format
from tritonclient.utils import InferenceServerException

from tests.harness import Proc, start, start_worker, worker_url

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def cluster(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Proc]]:
    repo_a, repo_b = tmp_path_factory.mktemp("ensemble-a"), tmp_path_factory.mktemp("ensemble-b")
    for name in ("preprocess", "postprocess", "classify"):
        shutil.copytree(model_repo / name, repo_a / name)
    shutil.copytree(model_repo / "cnn", repo_b / "cnn")
    procs: dict[str, Proc] = {}
    try:
        procs["a"] = start_worker(repo_a)
        procs["b"] = start_worker(repo_b)
        procs["gateway"] = start(["gateway", "--worker", worker_url(procs["a"]), "--worker", worker_url(procs["b"]),
                                  "--http-port", "0", "--grpc-port", "0"])
        yield procs
    finally:
        for proc in reversed(list(procs.values())):
            proc.stop(check=False)


def by_hand(model_repo: Path, images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    def run(name: str, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        session = ort.InferenceSession(str(model_repo / name / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
        return session.run(None, feeds)

    (pixels,) = run("preprocess", {"IMAGE": images})
    (probs,) = run("cnn", {"IMAGE": pixels})
    scores, classes = run("postprocess", {"PROBS": probs})
    return scores, classes


def _images(seed: int, rows: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (rows, 32, 32, 3), dtype=np.uint8)


def _input(module, images: np.ndarray):
    inp = module.InferInput("IMAGE", list(images.shape), "UINT8")
    inp.set_data_from_numpy(images)
    return inp


def test_the_ensemble_equals_its_steps_run_by_hand(cluster: dict[str, Proc], model_repo: Path) -> None:
    gw = cluster["gateway"]
    images = _images(0, 3)
    want_scores, want_classes = by_hand(model_repo, images)
    with grpcclient.InferenceServerClient(f"127.0.0.1:{gw.ready['grpc_port']}") as client:
        result = client.infer("classify", [_input(grpcclient, images)])
        np.testing.assert_allclose(result.as_numpy("SCORES"), want_scores, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(result.as_numpy("CLASSES"), want_classes)
    http = httpclient.InferenceServerClient(f"127.0.0.1:{gw.ready['http_port']}")
    try:
        result = http.infer("classify", [_input(httpclient, images)],
                            outputs=[httpclient.InferRequestedOutput("CLASSES", binary_data=False)])
        np.testing.assert_array_equal(result.as_numpy("CLASSES"), want_classes)
        assert result.as_numpy("SCORES") is None
    finally:
        http.close()


def test_concurrent_requests_batch_through_the_steps(cluster: dict[str, Proc], model_repo: Path) -> None:
    gw = cluster["gateway"]
    batches = [_images(10 + i, 1) for i in range(8)]

    async def run() -> list:
        async with aiogrpc.InferenceServerClient(f"127.0.0.1:{gw.ready['grpc_port']}") as client:
            return await asyncio.gather(*(client.infer("classify", [_input(aiogrpc, b)]) for b in batches))

    results = asyncio.run(run())
    for images, result in zip(batches, results):
        np.testing.assert_array_equal(result.as_numpy("CLASSES"), by_hand(model_repo, images)[1])
    with grpcclient.InferenceServerClient(f"127.0.0.1:{gw.ready['grpc_port']}") as client:
        ens = client.get_inference_statistics("classify").model_stats[0]
        cnn = client.get_inference_statistics("cnn").model_stats[0]
    assert ens.inference_count >= 8 + 3 and ens.inference_stats.success.count >= 9
    assert cnn.inference_count >= ens.inference_count  # every ensemble row went through the cnn step


def test_metadata_config_and_readiness_are_the_ensembles(cluster: dict[str, Proc]) -> None:
    gw = cluster["gateway"]
    with grpcclient.InferenceServerClient(f"127.0.0.1:{gw.ready['grpc_port']}") as client:
        assert client.is_model_ready("classify")
        md = client.get_model_metadata("classify")
        assert md.platform == "ensemble"
        assert [(t.name, t.datatype, list(t.shape)) for t in md.inputs] == [("IMAGE", "UINT8", [-1, 32, 32, 3])]
        assert [t.name for t in md.outputs] == ["SCORES", "CLASSES"]
        config = client.get_model_config("classify").config
        assert [s.model_name for s in config.ensemble_scheduling.step] == ["preprocess", "cnn", "postprocess"]


def _stats(client, module) -> list[dict]:
    """The statistics of ``classify`` as plain dicts (HTTP answers JSON, gRPC a protobuf)."""
    got = client.get_inference_statistics("classify")
    if module is httpclient:
        return got["model_stats"]
    return [json_format.MessageToDict(s, preserving_proto_field_name=True) for s in got.model_stats]


def _count(entry: dict, *path: str) -> int:
    for key in path:
        entry = entry.get(key, {})
    return int(entry or 0)


def test_statistics_fill_the_ensemble_and_break_it_down_by_step(cluster: dict[str, Proc]) -> None:
    """Triton's shape for the ensemble's own entry; after it, each step's share of the work."""
    gw = cluster["gateway"]
    paths = [("inference_count",), ("execution_count",), ("inference_stats", "success", "count"),
             ("inference_stats", "queue", "count"), ("inference_stats", "compute_infer", "count"),
             ("inference_stats", "compute_infer", "ns")]
    for module, url in ((grpcclient, f"127.0.0.1:{gw.ready['grpc_port']}"),
                        (httpclient, f"127.0.0.1:{gw.ready['http_port']}")):
        client = module.InferenceServerClient(url)
        try:
            before = _stats(client, module)
            for rows in (1, 2):
                client.infer("classify", [_input(module, _images(20 + rows, rows))])
            after = _stats(client, module)
        finally:
            client.close()
        assert [(s["name"], s.get("version")) for s in after] == [
            ("classify", "1"), ("preprocess", "1"), ("cnn", "1"), ("postprocess", "1")]
        assert len(before) == len(after)
        for old, new in zip(before, after):
            rows, requests, success, queue, computed, compute_ns = (_count(new, *p) - _count(old, *p) for p in paths)
            assert (rows, requests, success, queue, computed) == (3, 2, 2, 2, 2), (module.__name__, new)
            assert compute_ns > 0
        ensemble = after[0]
        steps_compute = sum(_count(s, "inference_stats", "compute_infer", "ns") for s in after[1:])
        # As in Triton, the ensemble's compute is its steps' compute.
        assert _count(ensemble, "inference_stats", "compute_infer", "ns") == steps_compute
        assert {int(b["batch_size"]) for b in ensemble["batch_stats"]} >= {1, 2}


def test_a_worker_refuses_to_run_an_ensemble(cluster: dict[str, Proc]) -> None:
    with grpcclient.InferenceServerClient(worker_url(cluster["a"])) as client:
        with pytest.raises(InferenceServerException, match="is run by the gateway") as info:
            client.infer("classify", [_input(grpcclient, _images(1, 1))])
    assert info.value.status() == "StatusCode.UNIMPLEMENTED"


def test_bad_input_is_the_ensembles_error(cluster: dict[str, Proc]) -> None:
    gw = cluster["gateway"]
    with grpcclient.InferenceServerClient(f"127.0.0.1:{gw.ready['grpc_port']}") as client:
        wrong = grpcclient.InferInput("IMAGE", [1, 32, 32, 3], "FP32")
        wrong.set_data_from_numpy(np.zeros((1, 32, 32, 3), dtype=np.float32))
        with pytest.raises(InferenceServerException, match="classify") as info:
            client.infer("classify", [wrong])
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"


def test_strict_readiness_waits_for_every_step_of_an_ensemble(model_repo: Path, tmp_path: Path) -> None:
    """A strict gateway (the default) before an explicit-mode worker: loading ``classify`` without its
    ``cnn`` step asks it to serve an ensemble it cannot run, so it is not ready until ``cnn`` loads."""
    for name in ("preprocess", "cnn", "postprocess", "classify"):
        shutil.copytree(model_repo / name, tmp_path / name)
    worker = start_worker(tmp_path, "--model-control-mode", "explicit")
    gateway = None
    try:
        gateway = start(["gateway", "--worker", worker_url(worker), "--http-port", "0", "--grpc-port", "0",
                         "--strict-readiness", "true"])
        http = httpclient.InferenceServerClient(f"127.0.0.1:{gateway.ready['http_port']}")
        grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{gateway.ready['grpc_port']}")
        try:
            def ready() -> tuple[bool, bool]:
                return http.is_server_ready(), grpc.is_server_ready()

            assert ready() == (True, True)  # asked to serve nothing yet
            for name in ("preprocess", "postprocess", "classify"):
                grpc.load_model(name)  # a load answers once the gateway's view has the model
            assert ready() == (False, False)
            assert not grpc.is_model_ready("classify")
            http.load_model("cnn")
            assert ready() == (True, True)
            assert grpc.is_model_ready("classify")
            grpc.unload_model("cnn")  # no longer asked for, but the ensemble still needs it
            assert ready() == (False, False)
        finally:
            http.close()
            grpc.close()
    finally:
        if gateway is not None:
            gateway.stop()
        worker.stop()


def test_a_lost_step_makes_it_unready_and_its_error_names_the_step(cluster: dict[str, Proc]) -> None:
    """Last: stops worker B (the cnn)."""
    gw = cluster["gateway"]
    cluster["b"].stop()
    with grpcclient.InferenceServerClient(f"127.0.0.1:{gw.ready['grpc_port']}") as client:
        deadline = time.monotonic() + 60
        while client.is_model_ready("classify"):  # polled: the gateway's probes notice the worker is gone
            assert time.monotonic() < deadline, "classify still ready with its cnn step gone"
            time.sleep(0.1)
        with pytest.raises(InferenceServerException, match=r"in ensemble 'classify' step 1 \('cnn'\)") as info:
            client.infer("classify", [_input(grpcclient, _images(2, 1))])
    assert info.value.status() == "StatusCode.UNAVAILABLE"
