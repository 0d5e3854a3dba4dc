"""A real Triton Inference Server (tests/triton_harness.py) serving our example
models through Python-backend copies (models/triton.py).

Checks what the gateway will rely on when it drives Triton: health, metadata
and config, inference equal to ONNX Runtime run directly (gRPC and HTTP, one
row and several), statistics, explicit unload/load, load-with-override of a
model that is not in the repository, error codes, and the harness's own
restricted-protocol and kill paths.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.utils import InferenceServerException

from models.triton import build_triton_repository, config_json, python_backend_config, python_model_source
from tests.triton_harness import SHM_DIR, TritonProc, process_group_members, start_triton, triton_available

AVAILABLE, REASON = triton_available()

pytestmark = [
    pytest.mark.triton,
    pytest.mark.timeout(180),
    pytest.mark.skipif(not AVAILABLE, reason=f"no real Triton here: {REASON}"),
]

SERVED = ["simple", "mlp"]
GrpcClient = grpcclient.InferenceServerClient
HttpClient = httpclient.InferenceServerClient
Client = Any  # GrpcClient or HttpClient
Module = Any  # the tritonclient.grpc or tritonclient.http module


@pytest.fixture(scope="module")
def triton_repo(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    dst = tmp_path_factory.mktemp("triton-models")
    assert build_triton_repository(model_repo, dst, SERVED) == sorted(SERVED)
    return dst


@pytest.fixture(scope="module")
def triton(triton_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonProc]:
    proc = start_triton(triton_repo, models=SERVED, workdir=tmp_path_factory.mktemp("triton-run"))
    try:
        yield proc
    finally:
        proc.stop()  # asserts exit status 0


@pytest.fixture(scope="module")
def grpc_client(triton: TritonProc) -> Iterator[GrpcClient]:
    client = grpcclient.InferenceServerClient(triton.grpc_url)
    yield client
    client.close()


@pytest.fixture(scope="module")
def http_client(triton: TritonProc) -> Iterator[HttpClient]:
    client = httpclient.InferenceServerClient(triton.http_url)
    yield client
    client.close()


@pytest.fixture(params=["grpc", "http"])
def proto(request: pytest.FixtureRequest) -> tuple[Module, Client]:
    if request.param == "grpc":
        return grpcclient, request.getfixturevalue("grpc_client")
    return httpclient, request.getfixturevalue("http_client")


def onnx_config(model_repo: Path, name: str) -> mc.ModelConfig:
    return text_format.Parse((model_repo / name / "config.pbtxt").read_text(), mc.ModelConfig())


def random_inputs(name: str, rows: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    if name == "simple":
        return {n: rng.integers(-1000, 1000, size=(rows, 16), dtype=np.int32) for n in ("INPUT0", "INPUT1")}
    return {"INPUT": rng.standard_normal((rows, 64)).astype(np.float32)}


def reference(model_repo: Path, name: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(str(model_repo / name / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds)))


def infer(module: Module, client: Client, model: str, feeds: dict[str, np.ndarray], **kwargs: Any) -> Any:
    inputs = []
    for name, array in feeds.items():
        tensor = module.InferInput(name, list(array.shape), "INT32" if array.dtype == np.int32 else "FP32")
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return client.infer(model, inputs, **kwargs)


def assert_matches(result: Any, expected: dict[str, np.ndarray]) -> None:
    for name, want in expected.items():
        got = result.as_numpy(name)
        assert got is not None, f"no output {name}"
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# --- the generated repository (no server) ---------------------------------


def test_generated_config_mirrors_onnx_config(model_repo: Path, triton_repo: Path) -> None:
    for name in SERVED:
        original = onnx_config(model_repo, name)
        generated = text_format.Parse((triton_repo / name / "config.pbtxt").read_text(), mc.ModelConfig())
        assert generated.backend == "python" and not generated.platform
        assert generated.max_batch_size == original.max_batch_size
        assert list(generated.input) == list(original.input)
        assert list(generated.output) == list(original.output)
        assert generated.HasField("dynamic_batching") == original.HasField("dynamic_batching")
        assert [g.kind for g in generated.instance_group] == [mc.ModelInstanceGroup.KIND_CPU]
        onnx_file = Path(name, "1", "model.onnx")
        assert (triton_repo / onnx_file).read_bytes() == (model_repo / onnx_file).read_bytes()
        compile((triton_repo / name / "1" / "model.py").read_text(), "model.py", "exec")
    assert not (triton_repo / "cnn").exists()


def test_unknown_model_is_refused(model_repo: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="nope"):
        build_triton_repository(model_repo, tmp_path, ["mlp", "nope"])
    assert not (tmp_path / "mlp").exists()


def test_bad_harness_options_raise_before_starting(triton_repo: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="explicit"):
        start_triton(triton_repo, models=["mlp"], explicit=False, workdir=tmp_path)
    with pytest.raises(ValueError, match="bogus"):
        start_triton(triton_repo, restricted_grpc={"bogus": ("k", "v")}, workdir=tmp_path)
    assert list(tmp_path.iterdir()) == []


# --- one server for the module ---------------------------------------------


def test_server_and_models_ready(proto: tuple[Module, Client]) -> None:
    _, client = proto
    assert client.is_server_live() and client.is_server_ready()
    for name in SERVED:
        assert client.is_model_ready(name)
    assert not client.is_model_ready("cnn")  # in the repository, not loaded in explicit mode


def test_metadata_and_config(grpc_client: GrpcClient, http_client: HttpClient, model_repo: Path) -> None:
    for name in SERVED:
        original = onnx_config(model_repo, name)
        meta = grpc_client.get_model_metadata(name)
        assert meta.platform == "python"
        assert [(t.name, list(t.shape)) for t in meta.inputs] == [(t.name, [-1, *t.dims]) for t in original.input]
        datatypes = [mc.DataType.Name(t.data_type).removeprefix("TYPE_") for t in original.output]
        assert [t.datatype for t in meta.outputs] == datatypes
        config = grpc_client.get_model_config(name).config
        assert config.backend == "python" and config.max_batch_size == original.max_batch_size
        assert config.HasField("dynamic_batching") == original.HasField("dynamic_batching")
        http_config = http_client.get_model_config(name)
        assert http_config["max_batch_size"] == original.max_batch_size
        assert [i["name"] for i in http_client.get_model_metadata(name)["inputs"]] == [t.name for t in original.input]


@pytest.mark.parametrize("model", SERVED)
@pytest.mark.parametrize("rows", [1, 5])
def test_infer_equals_onnxruntime(proto: tuple[Module, Client], model_repo: Path, model: str, rows: int) -> None:
    module, client = proto
    feeds = random_inputs(model, rows, seed=rows)
    assert_matches(infer(module, client, model, feeds), reference(model_repo, model, feeds))


def test_requested_output_only(grpc_client: GrpcClient) -> None:
    feeds = random_inputs("simple", 2)
    result = infer(grpcclient, grpc_client, "simple", feeds, outputs=[grpcclient.InferRequestedOutput("OUTPUT1")])
    assert [o.name for o in result.get_response().outputs] == ["OUTPUT1"]
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), feeds["INPUT0"] - feeds["INPUT1"])


def test_statistics_move(grpc_client: GrpcClient, http_client: HttpClient) -> None:
    def counts() -> tuple[int, int, int]:
        stats = grpc_client.get_inference_statistics("mlp").model_stats[0]
        return stats.inference_stats.success.count, stats.inference_count, stats.execution_count

    before = counts()
    for rows in (1, 2, 4):
        infer(grpcclient, grpc_client, "mlp", random_inputs("mlp", rows))
    after = counts()
    # Sequential requests: three executions, seven rows.
    assert (after[0] - before[0], after[1] - before[1], after[2] - before[2]) == (3, 7, 3)
    http_stats = http_client.get_inference_statistics("mlp")["model_stats"][0]
    assert int(http_stats["inference_count"]) == after[1]


def test_explicit_unload_and_load(grpc_client: GrpcClient, http_client: HttpClient, model_repo: Path) -> None:
    feeds = random_inputs("simple", 3)
    grpc_client.unload_model("simple")
    assert not grpc_client.is_model_ready("simple")
    with pytest.raises(InferenceServerException) as err:
        infer(grpcclient, grpc_client, "simple", feeds)
    assert err.value.status() == "StatusCode.NOT_FOUND"
    http_client.load_model("simple")  # load is synchronous: ready when it returns
    assert grpc_client.is_model_ready("simple")
    assert_matches(infer(grpcclient, grpc_client, "simple", feeds), reference(model_repo, "simple", feeds))
    index = {m.name: m.state for m in grpc_client.get_model_repository_index().models}
    assert index["simple"] == "READY" and index["mlp"] == "READY"


def override_files(model_repo: Path, source: str) -> dict[str, bytes]:
    return {
        "file:1/model.py": python_model_source().encode(),
        "file:1/model.onnx": (model_repo / source / "1" / "model.onnx").read_bytes(),
    }


def test_load_with_override(grpc_client: GrpcClient, model_repo: Path) -> None:
    config = python_backend_config(onnx_config(model_repo, "mlp"))
    config.name = "mlp_pushed"
    assert not grpc_client.is_model_ready("mlp_pushed")
    grpc_client.load_model("mlp_pushed", config=config_json(config), files=override_files(model_repo, "mlp"))
    try:
        assert grpc_client.is_model_ready("mlp_pushed")
        feeds = random_inputs("mlp", 3, seed=7)
        assert_matches(infer(grpcclient, grpc_client, "mlp_pushed", feeds), reference(model_repo, "mlp", feeds))
    finally:
        grpc_client.unload_model("mlp_pushed")
    assert not grpc_client.is_model_ready("mlp_pushed")


def test_dynamic_batch_is_split_back(triton: TritonProc, grpc_client: GrpcClient, model_repo: Path) -> None:
    # Triton holds requests until the preferred batch (6 rows) is reached, so
    # the three requests below run as one execution of model.py's batch path.
    config = python_backend_config(onnx_config(model_repo, "mlp"))
    config.name = "mlp_batched"
    config.dynamic_batching.preferred_batch_size[:] = [6]
    config.dynamic_batching.max_queue_delay_microseconds = 60_000_000
    grpc_client.load_model("mlp_batched", config=config_json(config), files=override_files(model_repo, "mlp"))
    try:
        feeds = [random_inputs("mlp", rows, seed=rows) for rows in (1, 2, 3)]

        def send(feed: dict[str, np.ndarray]) -> np.ndarray:
            client = grpcclient.InferenceServerClient(triton.grpc_url)
            try:
                return infer(grpcclient, client, "mlp_batched", feed).as_numpy("OUTPUT")
            finally:
                client.close()

        with ThreadPoolExecutor(len(feeds)) as pool:
            outputs = list(pool.map(send, feeds))
        for feed, got in zip(feeds, outputs):
            np.testing.assert_allclose(got, reference(model_repo, "mlp", feed)["OUTPUT"], rtol=1e-5, atol=1e-6)
        stats = grpc_client.get_inference_statistics("mlp_batched").model_stats[0]
        assert (stats.inference_count, stats.execution_count) == (6, 1)
    finally:
        grpc_client.unload_model("mlp_batched")


def test_bad_requests(grpc_client: GrpcClient, http_client: HttpClient) -> None:
    fp32, int32 = np.float32, np.int32
    cases: list[tuple[Module, Client, str, np.ndarray, str]] = [
        (grpcclient, grpc_client, "mlp", np.zeros((1, 63), fp32), "StatusCode.INVALID_ARGUMENT"),  # shape
        (grpcclient, grpc_client, "mlp", np.zeros((65, 64), fp32), "StatusCode.INVALID_ARGUMENT"),  # > max_batch_size
        (grpcclient, grpc_client, "mlp", np.zeros((1, 64), int32), "StatusCode.INVALID_ARGUMENT"),  # dtype
        (grpcclient, grpc_client, "nope", np.zeros((1, 64), fp32), "StatusCode.NOT_FOUND"),
        (httpclient, http_client, "mlp", np.zeros((1, 63), fp32), "400"),
        (httpclient, http_client, "nope", np.zeros((1, 64), fp32), "400"),
    ]
    for module, client, model, array, status in cases:
        with pytest.raises(InferenceServerException) as err:
            infer(module, client, model, {"INPUT": array})
        assert err.value.status() == status, err.value.message()
    assert grpc_client.is_model_ready("mlp")


# --- servers of their own ---------------------------------------------------


def test_restricted_grpc_protocols(triton_repo: Path, tmp_path: Path) -> None:
    token = ("access-token", "SECRET")
    restricted = {"model-repository": token, "statistics": token}
    with start_triton(triton_repo, models=[], restricted_grpc=restricted, workdir=tmp_path) as proc:
        assert proc.grpc_headers == {"triton-grpc-protocol-access-token": "SECRET"}
        assert any(a == "--grpc-restricted-protocol=model-repository,statistics:access-token=SECRET" for a in proc.args)
        client = grpcclient.InferenceServerClient(proc.grpc_url)
        try:
            assert client.is_server_ready()  # health is not restricted
            for headers in (None, {"triton-grpc-protocol-access-token": "wrong"}, {"access-token": "SECRET"}):
                with pytest.raises(InferenceServerException) as err:
                    client.get_model_repository_index(headers=headers)
                assert err.value.status() == "StatusCode.UNAVAILABLE"
            assert client.get_model_repository_index(headers=proc.grpc_headers).models
            client.load_model("simple", headers=proc.grpc_headers)
            assert client.is_model_ready("simple")  # metadata is not restricted
        finally:
            client.close()


def test_kill_takes_stubs_and_shared_memory(triton_repo: Path, tmp_path: Path) -> None:
    proc = start_triton(triton_repo, models=["simple"], workdir=tmp_path)
    assert list(SHM_DIR.glob(f"{proc.shm_prefix}*")), "the Python backend stub maps its shared memory"
    assert len(process_group_members(proc.pid)) >= 2, "the model's stub runs in the server's process group"
    proc.kill()
    assert proc.popen.returncode == -signal.SIGKILL
    assert process_group_members(proc.pid) == []
    assert not list(SHM_DIR.glob(f"{proc.shm_prefix}*"))
