"""Large inference messages over gRPC through ``infergate up``: their tensors
stay out of protobuf on the way through (``protos.wire``), and what comes
back is what the model computes, byte for byte.

- ``cnn`` (FP32 [N, 3, 32, 32], 12 KiB a row): batches of 8 rows (96 KiB a
  request) alone and many at once (the batcher joins and splits them), each
  equal to ONNX Runtime in this process;
- ``identity_string``: a 1 MiB BYTES tensor in and out, sync and aio clients;
- a large request with a raw entry too many, and large bytes that are no
  protobuf message: INVALID_ARGUMENT in the words of the small ones.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcclient_aio
from tritonclient.grpc import service_pb2, service_pb2_grpc

from protos import wire
from tests.harness import Proc, start
from tests.integration.gateway.e2e_cluster import grpc_url

pytestmark = pytest.mark.timeout(240)
ROWS = 8


@pytest.fixture(scope="module")
def cluster(model_repo: Path) -> Iterator[Proc]:
    proc = start(["up", "--workers", "1", "--model-repository", str(model_repo), "--http-port", "0", "--grpc-port", "0"])
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def cnn(model_repo: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(model_repo / "cnn" / "1" / "model.onnx"), providers=["CPUExecutionProvider"])


def images(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((ROWS, 3, 32, 32)).astype(np.float32)


def cnn_input(module: object, data: np.ndarray) -> object:
    tensor = module.InferInput("IMAGE", list(data.shape), "FP32")  # type: ignore[attr-defined]
    tensor.set_data_from_numpy(data)
    return tensor


def test_a_large_fp32_request_answers_what_the_model_computes(cluster: Proc, cnn: ort.InferenceSession) -> None:
    data = images(1)
    assert data.nbytes >= wire.SPLIT_MIN_BYTES  # the large-message path, not the plain one
    client = grpcclient.InferenceServerClient(grpc_url(cluster))
    try:
        got = client.infer("cnn", [cnn_input(grpcclient, data)]).as_numpy("PROBS")
    finally:
        client.close()
    np.testing.assert_allclose(got, cnn.run(["PROBS"], {"IMAGE": data})[0], rtol=1e-5, atol=1e-6)


def test_many_large_requests_at_once_are_joined_and_split_back(cluster: Proc, cnn: ort.InferenceSession) -> None:
    async def run() -> list[np.ndarray]:
        client = grpcclient_aio.InferenceServerClient(grpc_url(cluster))
        try:
            answers = await asyncio.gather(*(
                client.infer("cnn", [cnn_input(grpcclient_aio, images(seed))]) for seed in range(10, 26)
            ))  # fmt: skip
        finally:
            await client.close()
        return [a.as_numpy("PROBS") for a in answers]

    for seed, got in zip(range(10, 26), asyncio.run(run())):
        want = cnn.run(["PROBS"], {"IMAGE": images(seed)})[0]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"request {seed}")


def test_a_large_bytes_tensor_crosses_both_ways_byte_for_byte(cluster: Proc) -> None:
    words = np.array([chr(0x61 + i % 26).encode() * (1000 + i) for i in range(600)], dtype=np.object_)  # ~0.8 MiB

    def tensor(module: object) -> object:
        t = module.InferInput("INPUT0", list(words.shape), "BYTES")  # type: ignore[attr-defined]
        t.set_data_from_numpy(words)
        return t

    client = grpcclient.InferenceServerClient(grpc_url(cluster))
    try:
        got = client.infer("identity_string", [tensor(grpcclient)]).as_numpy("OUTPUT0")
    finally:
        client.close()
    assert got.tolist() == words.tolist()

    async def run_aio() -> np.ndarray:
        aio = grpcclient_aio.InferenceServerClient(grpc_url(cluster))
        try:
            return (await aio.infer("identity_string", [tensor(grpcclient_aio)])).as_numpy("OUTPUT0")
        finally:
            await aio.close()

    assert asyncio.run(run_aio()).tolist() == words.tolist()


def test_a_large_request_with_a_raw_entry_too_many_is_invalid_argument(cluster: Proc) -> None:
    pb = service_pb2.ModelInferRequest(model_name="cnn")
    pb.inputs.add(name="IMAGE", datatype="FP32", shape=[ROWS, 3, 32, 32])
    pb.raw_input_contents.extend([images(2).tobytes(), b"extra"])
    with grpc.insecure_channel(grpc_url(cluster)) as channel:
        with pytest.raises(grpc.RpcError) as caught:
            service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(pb, timeout=60)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "raw_input_contents has 2 entries for 1 inputs" in caught.value.details()


def test_large_bytes_that_are_no_message_are_invalid_argument(cluster: Proc) -> None:
    # Field 1 (model_name) claims 2**28 bytes; far fewer follow.
    corrupt = b"\x0a\x80\x80\x80\x80\x01" + b"\x00" * (2 * wire.SPLIT_MIN_BYTES)
    with grpc.insecure_channel(grpc_url(cluster)) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")  # bytes in, bytes out
        with pytest.raises(grpc.RpcError) as caught:
            call(corrupt, timeout=60)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid protobuf message" in caught.value.details()
