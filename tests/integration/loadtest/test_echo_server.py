"""``loadtest.echo_server``, the bench's Python ceiling: a real process that
copies a worker's model and answers every call with that worker's reply."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tests.harness import start, start_worker, worker_url

pytestmark = pytest.mark.timeout(120)


def test_echo_server_answers_with_the_copied_models_reply(model_repo: Path) -> None:
    worker = start_worker(model_repo)
    try:
        echo = start(["--like", worker_url(worker), "--model", "mlp"], module="loadtest.echo_server")
        try:
            url = f"127.0.0.1:{echo.ready['grpc_port']}"
            with grpcclient.InferenceServerClient(worker_url(worker)) as real, grpcclient.InferenceServerClient(url) as client:
                assert client.is_server_ready()
                assert client.get_model_metadata("mlp") == real.get_model_metadata("mlp")
                assert client.get_model_config("mlp") == real.get_model_config("mlp")
                tensor = grpcclient.InferInput("INPUT", [1, 64], "FP32")
                tensor.set_data_from_numpy(np.ones((1, 64), np.float32))  # not read: the reply is prebuilt
                zeros = grpcclient.InferInput("INPUT", [1, 64], "FP32")
                zeros.set_data_from_numpy(np.zeros((1, 64), np.float32))
                got = client.infer("mlp", [tensor]).as_numpy("OUTPUT")
                np.testing.assert_array_equal(got, real.infer("mlp", [zeros]).as_numpy("OUTPUT"))
        finally:
            echo.stop()
    finally:
        worker.stop()
