"""Tests for gateway/replicas/local.py: a repository's models run in this
process behind the worker client's interface: the index, a decoupled model's
stream (gateway/replicas/in_process.py), inference equal to the model, a request's fault kept a
request's fault, load with an override, unload, a model that fails to load
leaving the others served, statistics, and close."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from pathlib import Path

import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from gateway.replicas.local import LocalOptions, LocalReplica
from gateway.replicas.errors import ModelStreamError
from protos.triton_words import is_final
from models.build import EXAMPLE_MODELS, build_repository
from models.python_models import build_python_models
from protos import codec
from protos.errors import InvalidArgument, ModelNotFound, Unavailable


@pytest.fixture
async def replica(tmp_path: Path) -> AsyncIterator[LocalReplica]:
    build_repository(tmp_path, tuple(m for m in EXAMPLE_MODELS if m.name in ("simple", "mlp")), ensembles=())
    build_python_models(tmp_path)
    (tmp_path / "broken" / "1").mkdir(parents=True)
    (tmp_path / "broken" / "1" / "model.onnx").write_bytes(b"not a model")
    local = LocalReplica(LocalOptions(tmp_path, device="cpu"))
    await local.start()
    try:
        yield local
    finally:
        await local.close()


def mlp_request(rows: np.ndarray) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="mlp", id="r1")
    request.inputs.add(name="INPUT", datatype="FP32", shape=list(rows.shape))
    request.raw_input_contents.append(rows.tobytes())
    return request


async def test_index_serves_every_model_but_the_one_that_failed(replica: LocalReplica) -> None:
    assert await replica.server_ready()
    index = {e.name: e.state for e in await replica.repository_index()}
    assert index["mlp"] == index["simple"] == index["square_int32"] == index["repeat_int32"] == "READY"
    assert index["broken"] == "UNAVAILABLE"  # failed to load; the others serve


async def test_a_decoupled_model_streams_in_process(replica: LocalReplica) -> None:
    request = service_pb2.ModelInferRequest(model_name="square_int32", id="s1")
    request.inputs.add(name="IN", datatype="INT32", shape=[1])
    request.raw_input_contents.append(np.array([3], np.int32).tobytes())
    async with aclosing(replica.stream(request, 10.0)) as responses:
        got = [(r.id, is_final(r), [codec.decode(o.datatype, list(o.shape), raw).tolist()
                                    for o, raw in zip(r.outputs, r.raw_output_contents)]) for r, _ in
               [item async for item in responses]]
    assert got == [("s1", False, [[3]])] * 3 + [("s1", True, [])]
    bad = service_pb2.ModelInferRequest(model_name="nope", id="s2")
    with pytest.raises(ModelStreamError, match="unknown model"):
        async with aclosing(replica.stream(bad, 10.0)) as responses:
            [item async for item in responses]


async def test_infer_answers_as_the_model_and_a_bad_request_is_the_requests_fault(replica: LocalReplica) -> None:
    rows = np.random.default_rng(0).standard_normal((3, 64), dtype=np.float32)
    response = await replica.infer(mlp_request(rows))
    assert response.id == "r1" and response.model_name == "mlp"
    out = codec.decode(response.outputs[0].datatype, list(response.outputs[0].shape), response.raw_output_contents[0])
    assert out.shape == (3, 10) and np.isfinite(out).all()
    with pytest.raises(InvalidArgument):
        await replica.infer(mlp_request(rows[:, :63].copy()))
    with pytest.raises(ModelNotFound):
        await replica.infer(service_pb2.ModelInferRequest(model_name="nope"))
    stats = (await replica.model_statistics("mlp")).model_stats[0]
    assert stats.execution_count == 1 and stats.inference_stats.fail.count == 1
    metadata = await replica.model_metadata("mlp")
    assert metadata.inputs[0].name == "INPUT" and list(metadata.versions) == ["1"]


async def test_unload_load_and_close(replica: LocalReplica) -> None:
    await replica.unload("simple")
    assert not await replica.model_ready("simple")
    await replica.load("simple")
    assert await replica.model_ready("simple")
    await replica.close()
    with pytest.raises(Unavailable):
        await replica.infer(mlp_request(np.zeros((1, 64), np.float32)))
