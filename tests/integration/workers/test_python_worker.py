"""An ordinary (not decoupled) Python-backend model on a real ``infergate
worker`` started with ``--backend sim``: a config with ``backend: "python"``
runs its ``model.py`` whatever ``--backend`` says. Pushed with load-with-override
(``config`` + ``file:1/model.py``), answered over unary ``ModelInfer`` and
over ``ModelStreamInfer``, its model errors mapped to gRPC codes, and unloaded.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.harness import Proc, start_worker, worker_url
from tests.integration.workers.decoupled_client import Stream, infer_inputs

pytestmark = pytest.mark.timeout(60)

MODEL_PY = b'''
import json
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.dtype = pb_utils.triton_string_to_numpy(pb_utils.get_output_config_by_name(config, "SUM")["data_type"])

    def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "A").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "B").as_numpy()
            if (b == 0).any():
                error = pb_utils.TritonError("B must not hold zeros", pb_utils.TritonError.INVALID_ARG)
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=error))
                continue
            if (b < 0).any():
                raise ValueError("negative B")
            outputs = [pb_utils.Tensor("SUM", (a + b).astype(self.dtype)), pb_utils.Tensor("QUOT", a // b)]
            if json.loads(request.parameters()).get("echo_id"):
                outputs = [pb_utils.Tensor("SUM", np.full_like(a, len(request.request_id()))), outputs[1]]
            responses.append(pb_utils.InferenceResponse(output_tensors=outputs))
        return responses
'''

CONFIG = {
    "backend": "python",
    "max_batch_size": 4,
    "input": [{"name": "A", "data_type": "TYPE_INT32", "dims": [2]}, {"name": "B", "data_type": "TYPE_INT32", "dims": [2]}],
    "output": [{"name": "SUM", "data_type": "TYPE_INT32", "dims": [2]}, {"name": "QUOT", "data_type": "TYPE_INT32", "dims": [2]}],
    "instance_group": [{"count": 1, "kind": "KIND_CPU"}],
}


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    empty = tmp_path_factory.mktemp("empty-repo")
    proc = start_worker(empty, "--backend", "sim", "--model-control-mode", "explicit")
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(worker: Proc) -> Iterator[grpcclient.InferenceServerClient]:
    client = grpcclient.InferenceServerClient(worker_url(worker))
    client.load_model("adder", config=json.dumps(CONFIG), files={"file:1/model.py": MODEL_PY})
    yield client
    client.close()


def feeds(a: list[list[int]], b: list[list[int]]) -> dict[str, np.ndarray]:
    return {"A": np.array(a, dtype=np.int32), "B": np.array(b, dtype=np.int32)}


def test_unary_infer_runs_model_py(client: grpcclient.InferenceServerClient) -> None:
    assert client.get_model_metadata("adder").platform == "python"
    result = client.infer("adder", infer_inputs(feeds([[7, 9], [1, 2]], [[2, 3], [1, 1]])))
    assert result.as_numpy("SUM").tolist() == [[9, 12], [2, 3]]
    assert result.as_numpy("QUOT").tolist() == [[3, 3], [1, 2]]
    only = client.infer("adder", infer_inputs(feeds([[4, 4]], [[2, 2]])), outputs=[grpcclient.InferRequestedOutput("QUOT")])
    assert [o.name for o in only.get_response().outputs] == ["QUOT"]


def test_model_reads_the_request_id_and_parameters(client: grpcclient.InferenceServerClient) -> None:
    result = client.infer("adder", infer_inputs(feeds([[1, 1]], [[1, 1]])), request_id="abcde",
                          parameters={"echo_id": True})
    assert result.as_numpy("SUM").tolist() == [[5, 5]]  # len("abcde"), from request_id()


def test_model_errors_map_to_codes(client: grpcclient.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException) as err:
        client.infer("adder", infer_inputs(feeds([[1, 1]], [[0, 1]])))
    assert (err.value.status(), err.value.message()) == ("StatusCode.INVALID_ARGUMENT", "B must not hold zeros")
    with pytest.raises(InferenceServerException) as err:
        client.infer("adder", infer_inputs(feeds([[1, 1]], [[-1, 1]])))
    assert (err.value.status(), err.value.message()) == ("StatusCode.INTERNAL", "ValueError: negative B")
    assert client.infer("adder", infer_inputs(feeds([[1, 1]], [[1, 1]]))).as_numpy("SUM").tolist() == [[2, 2]]


def test_ordinary_model_over_the_stream(client: grpcclient.InferenceServerClient) -> None:
    stream = Stream(client)
    stream.client.async_stream_infer("adder", infer_inputs(feeds([[5, 6]], [[1, 2]])), request_id="one")
    received = stream.close()
    assert [(r.request_id, r.outputs["SUM"].tolist()) for r in received] == [("one", [[6, 8]])]


def test_unload_and_reload(client: grpcclient.InferenceServerClient, tmp_path: Path) -> None:
    client.unload_model("adder")
    assert not client.is_model_ready("adder")
    client.load_model("adder", config=json.dumps(CONFIG), files={"file:1/model.py": MODEL_PY})
    assert client.infer("adder", infer_inputs(feeds([[1, 2]], [[3, 4]]))).as_numpy("SUM").tolist() == [[4, 6]]
