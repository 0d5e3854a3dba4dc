"""Integration tests of an ``infergate worker`` process's lifecycle: SIGTERM
lets the request in flight finish, explicit model-control mode loads only the
named models and a stop is prompt; the gRPC health service follows along."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import onnx
import pytest
import tritonclient.grpc as grpcclient
from grpc_health.v1 import health_pb2, health_pb2_grpc
from onnx import TensorProto, helper, numpy_helper
from tritonclient.utils import InferenceServerException

from tests.harness import start_worker, worker_url
from tests.integration.workers.test_worker import example_inputs, good_simple, infer_inputs, status_of

pytestmark = pytest.mark.timeout(120)

RNG = np.random.default_rng(11)


def slow_model(layers: int = 600, size: int = 512) -> onnx.ModelProto:
    """Long enough to catch in flight: MatMul+Relu layers on [size, size] (about half a second of a fast core)."""
    nodes, x = [], "X"
    for i in range(layers):
        out = "Y" if i == layers - 1 else f"r{i}"
        nodes += [helper.make_node("MatMul", [x, "W"], [f"m{i}"]), helper.make_node("Relu", [f"m{i}"], [out])]
        x = out
    weight = numpy_helper.from_array(np.eye(size, dtype=np.float32), "W")
    graph = helper.make_graph(
        nodes,
        "slow",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [size, size])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [size, size])],
        [weight],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc to see the worker compute")
def test_sigterm_lets_the_request_in_flight_finish(tmp_path: Path) -> None:
    (tmp_path / "slow" / "1").mkdir(parents=True)
    (tmp_path / "slow" / "1" / "model.onnx").write_bytes(slow_model().SerializeToString())
    (tmp_path / "slow" / "config.pbtxt").write_text('instance_group { kind: KIND_CPU }\n')  # rest auto-completed
    proc = start_worker(tmp_path, "--intra-op-threads", "1")
    try:
        x = RNG.random((512, 512), dtype=np.float32)
        with grpcclient.InferenceServerClient(worker_url(proc)) as client, ThreadPoolExecutor(1) as pool:
            tensor = grpcclient.InferInput("X", [512, 512], "FP32")
            tensor.set_data_from_numpy(x)
            # Start counting once the worker is idle: it may still finish starting up
            # after its ready file, and that CPU must not pass for the request's.
            baseline, settle_by = cpu_seconds(proc.pid), time.monotonic() + 30
            while True:
                time.sleep(0.05)
                now = cpu_seconds(proc.pid)
                if now - baseline < 0.005 or time.monotonic() > settle_by:
                    break
                baseline = now
            pending = pool.submit(client.infer, "slow", [tensor])
            # The request is in flight once the worker burns CPU on it (it is idle otherwise).
            deadline = time.monotonic() + 60
            while cpu_seconds(proc.pid) - baseline < 0.2:
                assert not pending.done(), f"the request finished before SIGTERM: make slow_model slower ({pending.exception()!r})"
                assert time.monotonic() < deadline, "the worker never started computing"
                time.sleep(0.01)
            proc.popen.send_signal(signal.SIGTERM)
            result = pending.result(timeout=90)
        np.testing.assert_allclose(result.as_numpy("Y"), x, rtol=1e-6)
        assert proc.popen.wait(timeout=60) == 0  # it exits on that one signal, cleanly
    finally:
        proc.stop()


def test_explicit_mode_loads_only_named_models_and_stops_promptly(model_repo: Path) -> None:
    proc = start_worker(model_repo, "--model-control-mode", "explicit", "--load-model", "simple", "--grace-period", "20")
    try:
        with grpcclient.InferenceServerClient(worker_url(proc)) as client:
            rows = {m["name"]: m.get("state", "") for m in client.get_model_repository_index(as_json=True)["models"]}
            assert rows == {
                "simple": "READY", "mlp": "", "cnn": "", "encoder": "", "identity_string": "", "string_to_int": "",
                "preprocess": "", "postprocess": "", "classify": "",
                "simple_sequence": "", "simple_dyna_sequence": "", "simple_string_dyna_sequence": "", "accumulate": "",
                "accumulate_seeded": "", "square_int32": "", "repeat_int32": "", "tiny_lm": "",
            }
            good_simple(client)
            with pytest.raises(InferenceServerException) as info:
                client.infer("mlp", infer_inputs(example_inputs("mlp", 1)))
            assert status_of(info) == "StatusCode.NOT_FOUND"
            client.load_model("mlp")
            assert client.infer("mlp", infer_inputs(example_inputs("mlp", 1))).as_numpy("OUTPUT").shape == (1, 10)
        # A health watcher holds a call open; shutdown must not wait the whole grace period for it.
        with grpc.insecure_channel(worker_url(proc)) as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            started = time.monotonic()
            proc.popen.send_signal(signal.SIGTERM)
            statuses = [reply.status for reply in _drain(watch)]
            assert health_pb2.HealthCheckResponse.NOT_SERVING in statuses
            assert proc.popen.wait(timeout=30) == 0
            assert time.monotonic() - started < 15
    finally:
        proc.stop()


def _drain(watch: Iterator[health_pb2.HealthCheckResponse]) -> Iterator[health_pb2.HealthCheckResponse]:
    """Replies until the server ends the watch (it cancels it on shutdown)."""
    try:
        yield from watch
    except grpc.RpcError:
        return
