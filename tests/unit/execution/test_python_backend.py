"""The Python backend (execution/backends/python.py) and a decoupled model's
request pipeline (``LoadedModel.stream``), on model.py files written here:
Triton's ``initialize`` args, ordinary and decoupled execution, errors,
cancellation and the instance it frees, ``finalize``, and the
``triton_python_backend_utils`` module's presence. No sockets."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2

from protos.errors import Internal, InvalidArgument, Unsupported
from execution.backends import python_api
from execution.backends.base import BackendOptions, ConfigBackends, Placement, StreamEvent
from execution.backends.python import UTILS_MODULE, PythonBackend, PythonInstance
from execution.model import LoadedModel

CPU = Placement("cpu")

ORDINARY = '''
import json
import triton_python_backend_utils as pb_utils

SEEN = {}

class TritonPythonModel:
    def initialize(self, args):
        SEEN["args"] = args
        self.config = json.loads(args["model_config"])

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            if x[0] < 0:
                responses.append(pb_utils.InferenceResponse(
                    output_tensors=[], error=pb_utils.TritonError("X must be >= 0", pb_utils.TritonError.INVALID_ARG)))
            elif x[0] == 99:
                raise pb_utils.TritonModelException("ninety-nine")
            else:
                responses.append(pb_utils.InferenceResponse(output_tensors=[
                    pb_utils.Tensor("Y", x * 2), pb_utils.Tensor("EXTRA", x)]))
        return responses

    def finalize(self):
        SEEN["finalized"] = True
'''

DECOUPLED = '''
import time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        request = requests[0]
        n = int(pb_utils.get_input_tensor_by_name(request, "X").as_numpy()[0])
        sender = request.get_response_sender()
        if n == -1:
            return None  # drops the sender without the final flag
        if n == -2:
            raise ValueError("minus two")
        for i in range(n):
            if request.is_cancelled():
                return None
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.array([i], np.int32))]))
            if n > 100:
                time.sleep(0.01)
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''

CONFIG = '''
name: "%s"
backend: "python"
max_batch_size: 0
input { name: "X" data_type: TYPE_INT32 dims: [ 1 ] }
output { name: "Y" data_type: TYPE_INT32 dims: [ 1 ] }
%s
'''


def write_model(root: Path, name: str, source: str, decoupled: bool) -> tuple[Path, mc.ModelConfig]:
    extra = "model_transaction_policy { decoupled: true }" if decoupled else ""
    if not decoupled:
        extra += '\noutput { name: "EXTRA" data_type: TYPE_INT32 dims: [ 1 ] }'
    config = text_format.Parse(CONFIG % (name, extra), mc.ModelConfig())
    (root / name / "1").mkdir(parents=True)
    (root / name / "1" / "model.py").write_text(source)
    return root / name, config


@pytest.fixture
def backend() -> Iterator[PythonBackend]:
    backend = PythonBackend(BackendOptions())
    yield backend
    backend.close()


def load(backend: PythonBackend, model_dir: Path, config: mc.ModelConfig, count: int = 1) -> LoadedModel:
    config = backend.complete_config(config, model_dir / "1")
    instances = [backend.load(model_dir, model_dir / "1", config, CPU) for _ in range(count)]
    return LoadedModel(config, 1, instances, max_queue_size=8)


def request(model: str, x: int, request_id: str = "r", outputs: tuple[str, ...] = ()) -> service_pb2.ModelInferRequest:
    req = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    req.inputs.add(name="X", datatype="INT32", shape=[1])
    req.raw_input_contents.append(np.array([x], np.int32).tobytes())
    for name in outputs:
        req.outputs.add(name=name)
    req.parameters["flag"].bool_param = True
    return req


def close_now(model: LoadedModel) -> None:
    """Close and wait for each instance's thread (finalize included): no model outlives its test."""
    instances = list(model._instances)
    model.close()
    for instance in instances:
        assert isinstance(instance, PythonInstance)
        instance._thread.shutdown(wait=True)


async def test_ordinary_model_gets_tritons_args_and_answers(backend: PythonBackend, tmp_path: Path) -> None:
    model_dir, config = write_model(tmp_path, "twice", ORDINARY, decoupled=False)
    model = load(backend, model_dir, config)
    module = next(m for n, m in sys.modules.items() if n.startswith("_infergate_python_model_") and hasattr(m, "SEEN"))
    args = module.SEEN["args"]
    assert {k: args[k] for k in ("model_name", "model_version", "model_instance_kind", "model_instance_name",
                                 "model_instance_device_id", "model_repository")} == {
        "model_name": "twice", "model_version": "1", "model_instance_kind": "CPU",
        "model_instance_name": "twice_0_0", "model_instance_device_id": "0", "model_repository": str(model_dir),
    }  # fmt: skip
    as_json = json.loads(args["model_config"])
    assert as_json["input"][0] == {**as_json["input"][0], "name": "X", "data_type": "TYPE_INT32", "dims": [1]}
    assert as_json["model_transaction_policy"] == {"decoupled": False}
    response = await model.infer(request("twice", 21, outputs=("Y",)))
    assert [o.name for o in response.outputs] == ["Y"]
    assert np.frombuffer(response.raw_output_contents[0], np.int32).tolist() == [42]
    with pytest.raises(InvalidArgument, match="X must be >= 0"):
        await model.infer(request("twice", -1))
    with pytest.raises(Internal, match="^TritonModelException: ninety-nine$"):
        await model.infer(request("twice", 99))
    stats = model.stats
    assert (stats.success.count, stats.fail.count) == (1, 2)
    close_now(model)
    assert module.SEEN["finalized"]


async def collect(model: LoadedModel, req: service_pb2.ModelInferRequest) -> list[StreamEvent]:
    return [event async for event in model.stream(req)]


async def test_decoupled_stream_and_unary_refusal(backend: PythonBackend, tmp_path: Path) -> None:
    model = load(backend, *write_model(tmp_path, "count", DECOUPLED, decoupled=True))
    events = await collect(model, request("count", 3))
    assert [(e.outputs["Y"].tolist() if e.outputs else None, e.final) for e in events] == [
        ([0], False), ([1], False), ([2], False), (None, True)]
    assert await collect(model, request("count", 0)) == [StreamEvent({}, True)]
    with pytest.raises(Unsupported, match="^ModelInfer RPC doesn't support models with decoupled transaction policy$"):
        await model.infer(request("count", 1))
    with pytest.raises(Internal, match="^ValueError: minus two$"):
        await collect(model, request("count", -2))
    with pytest.raises(Internal, match="released request 'gone' without sending its final response"):
        await asyncio.wait_for(collect(model, request("count", -1, "gone")), 10)
    assert (model.stats.success.count, model.stats.fail.count, model.inflight) == (2, 2, 0)
    close_now(model)


async def test_cancel_reaches_the_model_and_frees_the_instance(backend: PythonBackend, tmp_path: Path) -> None:
    model = load(backend, *write_model(tmp_path, "long", DECOUPLED, decoupled=True))
    stream = model.stream(request("long", 10_000))
    first = await stream.__anext__()
    assert first.outputs["Y"].tolist() == [0] and model.inflight == 1
    await stream.aclose()  # the consumer went away
    # In flight until execute notices is_cancelled() and returns (within one 10 ms step).
    await asyncio.wait_for(model.drain(10), 10)
    assert model.inflight == 0 and model.stats.fail.count == 1
    # The one instance is free again.
    assert len(await asyncio.wait_for(collect(model, request("long", 2)), 10)) == 3
    close_now(model)


def test_complete_config_needs_a_signature_and_model_file(backend: PythonBackend, tmp_path: Path) -> None:
    model_dir, config = write_model(tmp_path, "m", ORDINARY, decoupled=False)
    bare = mc.ModelConfig(name="m", backend="python")
    with pytest.raises(InvalidArgument, match="must list its inputs and outputs"):
        backend.complete_config(bare, model_dir / "1")
    (model_dir / "1" / "model.py").unlink()
    with pytest.raises(InvalidArgument, match="no model.py"):
        backend.complete_config(config, model_dir / "1")


def test_bad_model_files_fail_the_load(backend: PythonBackend, tmp_path: Path) -> None:
    for name, source, words in [
        ("noclass", "x = 1\n", "defines no class TritonPythonModel"),
        ("broken", "import nonexistent_module_xyz\n", "ModuleNotFoundError"),
        ("badinit", "class TritonPythonModel:\n    def initialize(self, args):\n        raise RuntimeError('no')\n",
         "RuntimeError: no"),
    ]:
        model_dir, config = write_model(tmp_path, name, source, decoupled=False)
        with pytest.raises(InvalidArgument, match=words):
            backend.load(model_dir, model_dir / "1", config, CPU)
    assert python_api.MODULE_NAME not in sys.modules


def test_utils_module_is_present_only_while_models_are(backend: PythonBackend, tmp_path: Path) -> None:
    assert python_api.MODULE_NAME not in sys.modules
    model_dir, config = write_model(tmp_path, "m", ORDINARY, decoupled=False)
    instance = backend.load(model_dir, model_dir / "1", config, CPU)
    assert sys.modules[python_api.MODULE_NAME] is python_api
    instance.close()
    instance._thread.shutdown(wait=True)
    assert python_api.MODULE_NAME not in sys.modules


def test_another_module_of_that_name_is_not_shadowed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, python_api.MODULE_NAME, type(sys)("triton_python_backend_utils"))
    with pytest.raises(InvalidArgument, match="already imported"):
        UTILS_MODULE.acquire()


def test_python_configs_go_to_the_python_backend() -> None:
    backends = ConfigBackends(BackendOptions())
    try:
        assert isinstance(backends.for_config(mc.ModelConfig(backend="python")), PythonBackend)
        assert backends.for_config(mc.ModelConfig(backend="onnxruntime")) is None
        assert backends.for_config(mc.ModelConfig()) is None
    finally:
        backends.close()


def test_instance_runs_on_its_own_thread(backend: PythonBackend, tmp_path: Path) -> None:
    source = ("import threading\nimport triton_python_backend_utils as pb_utils\nTHREADS = []\n"
              "class TritonPythonModel:\n    def execute(self, requests):\n"
              "        THREADS.append(threading.current_thread().name)\n"
              "        x = pb_utils.get_input_tensor_by_name(requests[0], 'X').as_numpy()\n"
              "        return [pb_utils.InferenceResponse([pb_utils.Tensor('Y', x), pb_utils.Tensor('EXTRA', x)])]\n")
    model = load(backend, *write_model(tmp_path, "t", source, decoupled=False))
    instance = model._instances[0]
    assert isinstance(instance, PythonInstance)
    asyncio.run(model.infer(request("t", 1)))
    module = next(m for n, m in sys.modules.items() if n.startswith("_infergate_python_model_") and hasattr(m, "THREADS"))
    assert module.THREADS[0].startswith("python-model-t_0_0") and module.THREADS[0] != threading.current_thread().name
    close_now(model)
