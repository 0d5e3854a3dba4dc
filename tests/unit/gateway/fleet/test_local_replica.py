"""Tests for gateway/fleet/local_replica.py: a repository's models run in this
process behind the worker client's interface: the index (decoupled models
left to workers), inference equal to the model, a request's fault kept a
request's fault, load with an override, unload, a model that fails to load
leaving the others served, statistics, and close."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from gateway.fleet.local_replica import LocalOptions, LocalReplica
from models.build import EXAMPLE_MODELS, build_repository
from models.python_models import build_python_models
from protos import codec
from protos.errors import InvalidArgument, ModelNotFound, Unavailable, Unsupported


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


async def test_index_serves_onnx_models_and_leaves_decoupled_ones_to_workers(replica: LocalReplica) -> None:
    assert await replica.server_ready()
    index = {e.name: e.state for e in await replica.repository_index()}
    assert index["mlp"] == index["simple"] == "READY"
    assert "repeat_int32" not in index and "square_int32" not in index  # decoupled: streams go to workers
    assert index["broken"] == "UNAVAILABLE"  # failed to load; the others serve
    with pytest.raises(Unsupported, match="decoupled"):
        await replica.load("repeat_int32")


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
