"""Triton's semantics through real processes: strict readiness, a ``specific``
version policy with a version missing on disk, and model control (Triton's
``--model-control-mode``, load-with-override rules, staging errors).

Every check runs with the real ``tritonclient``, HTTP and gRPC. The module's
repository holds ``simple``, ``versioned`` (only ``3/`` on disk, policy
``specific [1, 3]``) and ``broken`` (a config that does not parse).
"""

from __future__ import annotations

import http.client
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from google.protobuf import json_format
from tritonclient.utils import InferenceServerException

from tests.harness import Proc, start, start_worker, worker_url

pytestmark = pytest.mark.timeout(180)

REFUSED = "explicit model load / unload is not allowed if polling is enabled"


@pytest.fixture(scope="module")
def repo(model_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("triton-semantics")
    shutil.copytree(model_repo / "simple", root / "simple")
    versioned = root / "versioned"
    (versioned / "3").mkdir(parents=True)
    shutil.copy(model_repo / "simple" / "1" / "model.onnx", versioned / "3" / "model.onnx")
    config = (model_repo / "simple" / "config.pbtxt").read_text().replace('name: "simple"', 'name: "versioned"')
    (versioned / "config.pbtxt").write_text(config + "version_policy { specific { versions: [1, 3] } }\n")
    (root / "broken" / "1").mkdir(parents=True)
    (root / "broken" / "config.pbtxt").write_text("this is not a model config\n")
    return root


@pytest.fixture(scope="module")
def explicit(repo: Path) -> Iterator[Proc]:
    """A gateway (strict readiness, explicit model control: the defaults) before an explicit-mode worker."""
    worker = start_worker(repo, "--model-control-mode", "explicit")
    gateway = None
    try:
        gateway = start(["gateway", "--worker", worker_url(worker), "--http-port", "0", "--grpc-port", "0"])
        yield gateway
    finally:
        if gateway is not None:
            gateway.stop()
        worker.stop()


def clients(proc: Proc) -> tuple[httpclient.InferenceServerClient, grpcclient.InferenceServerClient]:
    return (httpclient.InferenceServerClient(f"127.0.0.1:{proc.ready['http_port']}"),
            grpcclient.InferenceServerClient(f"127.0.0.1:{proc.ready['grpc_port']}"))


def readiness(proc: Proc) -> tuple[bool, bool]:
    """(/v2/health/ready, gRPC ServerReady)."""
    http_, grpc_ = clients(proc)
    return http_.is_server_ready(), grpc_.is_server_ready()


def simple_inputs(http: bool) -> list:
    module = httpclient if http else grpcclient
    inputs = [module.InferInput(name, [1, 16], "INT32") for name in ("INPUT0", "INPUT1")]
    for i in inputs:
        i.set_data_from_numpy(np.arange(16, dtype=np.int32).reshape(1, 16))
    return inputs


# ---- readiness -----------------------------------------------------------------


def test_an_empty_explicit_mode_server_is_ready(explicit: Proc) -> None:
    http_, _ = clients(explicit)
    assert [m["name"] for m in http_.get_model_repository_index() if m.get("state") == "READY"] == []
    assert readiness(explicit) == (True, True)


def test_a_model_that_failed_to_load_makes_a_strict_server_unready(explicit: Proc) -> None:
    http_, grpc_ = clients(explicit)
    with pytest.raises(InferenceServerException, match="broken"):
        http_.load_model("broken")
    assert readiness(explicit) == (False, False)
    http_.unload_model("broken")  # no longer asked for: ready again
    assert readiness(explicit) == (True, True)
    grpc_.load_model("simple")
    assert readiness(explicit) == (True, True)
    grpc_.unload_model("simple")


# ---- version policy --------------------------------------------------------------


def test_specific_version_policy_serves_the_versions_on_disk(explicit: Proc) -> None:
    http_, grpc_ = clients(explicit)
    http_.load_model("versioned")
    try:
        rows = {(m["version"], m["state"]): m.get("reason", "") for m in http_.get_model_repository_index()
                if m["name"] == "versioned"}
        assert set(rows) == {("3", "READY"), ("1", "UNAVAILABLE")}
        assert "version directory is not present" in rows[("1", "UNAVAILABLE")]
        grpc_rows = {(m.version, m.state) for m in grpc_.get_model_repository_index().models if m.name == "versioned"}
        assert grpc_rows == set(rows)
        for client in (http_, grpc_):
            assert client.is_model_ready("versioned", "3") and client.is_model_ready("versioned")
            assert not client.is_model_ready("versioned", "1")
        result = grpc_.infer("versioned", simple_inputs(False), model_version="3")
        assert result.as_numpy("OUTPUT0").tolist() == [list(range(0, 32, 2))]
        assert readiness(explicit) == (True, True)  # a missing version does not make the model unservable
    finally:
        http_.unload_model("versioned")


# ---- model control ---------------------------------------------------------------


def _config_json(client: grpcclient.InferenceServerClient, name: str, max_batch_size: int) -> str:
    config = client.get_model_config(name).config
    config.max_batch_size = max_batch_size
    return json_format.MessageToJson(config, preserving_proto_field_name=True)


def test_a_load_without_config_keeps_the_earlier_override(explicit: Proc) -> None:
    http_, grpc_ = clients(explicit)
    grpc_.load_model("simple")
    try:
        http_.load_model("simple", config=_config_json(grpc_, "simple", 4))
        assert grpc_.get_model_config("simple").config.max_batch_size == 4
        grpc_.load_model("simple")
        http_.load_model("simple")
        assert grpc_.get_model_config("simple").config.max_batch_size == 4
        assert http_.get_model_config("simple")["max_batch_size"] == 4
    finally:
        grpc_.unload_model("simple")


def test_file_override_rules_and_staging_errors(explicit: Proc, repo: Path) -> None:
    http_, grpc_ = clients(explicit)
    onnx = (repo / "simple" / "1" / "model.onnx").read_bytes()
    for client in (http_, grpc_):
        # What Triton's client sees; Triton writes "Load parameter 'config' must be specified ..." to its log.
        with pytest.raises(InferenceServerException,
                           match="failed to load 'custom', failed to poll from model repository$") as info:
            client.load_model("custom", files={"file:1/model.onnx": onnx})
        assert info.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")
    grpc_.load_model("simple")
    config = _config_json(grpc_, "simple", 8).replace('"simple"', '"custom"')
    grpc_.unload_model("simple")
    long_name = "x" * 256
    for client in (http_, grpc_):
        with pytest.raises(InferenceServerException, match=f"cannot write override file '1/{long_name}'.*too long") as info:
            client.load_model("custom", config=config, files={f"file:1/{long_name}": b"1", "file:1/model.onnx": onnx})
        assert info.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")
    assert readiness(explicit) == (True, True)


@pytest.fixture
def no_model_control(repo: Path, tmp_path: Path) -> Iterator[Proc]:
    """`infergate up`: model control none, strict readiness off, `simple` placed by the gateway's config;
    the worker loads its whole repository at start (`broken` fails)."""
    config = tmp_path / "gateway.yaml"
    config.write_text("models:\n  simple: {replicas: 1}\n")
    proc = start(["up", "--workers", "1", "--model-repository", str(repo), "--http-port", "0", "--grpc-port", "0",
                  "--config", str(config), "--model-control-mode", "none", "--strict-readiness", "false"])
    yield proc
    proc.stop()


def test_model_control_none_refuses_client_loads_but_placement_works(no_model_control: Proc) -> None:
    http_, grpc_ = clients(no_model_control)
    assert readiness(no_model_control) == (True, True)  # `broken` failed, but readiness is not strict
    assert http_.infer("simple", simple_inputs(True)).as_numpy("OUTPUT1").tolist() == [[0] * 16]
    for call in (lambda: http_.load_model("simple"), lambda: http_.unload_model("simple")):
        with pytest.raises(InferenceServerException, match=REFUSED) as info:
            call()
        assert info.value.status() == "503"
    for call in (lambda: grpc_.load_model("simple"), lambda: grpc_.unload_model("simple")):
        with pytest.raises(InferenceServerException, match=REFUSED) as info:
            call()
        assert info.value.status() == "StatusCode.UNAVAILABLE"
    assert grpc_.is_model_ready("simple")


# ---- shutting down -----------------------------------------------------------------


def _get(conn: http.client.HTTPConnection, path: str) -> tuple[int, str]:
    conn.request("GET", path)
    response = conn.getresponse()
    return response.status, response.read().decode()


def _until(condition: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)  # polling a condition, not standing in for one


def _worker_busy(conn: http.client.HTTPConnection) -> bool:
    lines = _get(conn, "/metrics")[1].splitlines()
    return any(line.startswith("infergate_worker_inflight_batches{") and float(line.rsplit(" ", 1)[1]) > 0
               for line in lines)


def test_a_shutting_down_server_is_not_ready(repo: Path) -> None:
    """A request keeps the gateway draining; on a kept-alive connection readiness turns false."""
    worker = start_worker(repo, "--backend", "sim", "--sim-latency-ms", "4000")
    gateway = start(["gateway", "--worker", worker_url(worker), "--http-port", "0", "--grpc-port", "0",
                     "--strict-readiness", "false"])  # `broken` failed at the worker's start
    try:
        conn = http.client.HTTPConnection("127.0.0.1", gateway.ready["http_port"], timeout=30)
        assert _get(conn, "/v2/health/ready")[0] == 200
        assert readiness(gateway) == (True, True)
        outcome: list[object] = []
        _, grpc_ = clients(gateway)

        def infer() -> None:  # a client of its own: tritonclient's HTTP client stays on its thread
            client = httpclient.InferenceServerClient(f"127.0.0.1:{gateway.ready['http_port']}")
            outcome.append(client.infer("simple", simple_inputs(True)))
            client.close()

        running = threading.Thread(target=infer)
        running.start()
        metrics = http.client.HTTPConnection("127.0.0.1", gateway.ready["http_port"], timeout=30)
        _until(lambda: _worker_busy(metrics))
        gateway.popen.send_signal(signal.SIGTERM)
        _until(lambda: _get(conn, "/v2/health/ready")[0] != 200)
        assert _get(conn, "/v2/health/ready")[0] == 503
        try:
            assert not grpc_.is_server_ready()
        except InferenceServerException as e:  # or refused outright: the gRPC server takes no new calls
            assert e.status() == "StatusCode.UNAVAILABLE"
        running.join(60)
        assert outcome and outcome[0].as_numpy("OUTPUT0") is not None  # answered while draining
        assert gateway.popen.wait(60) == 0
    finally:
        gateway.stop()
        worker.stop()
