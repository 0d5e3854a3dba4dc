"""Tests for gateway/replicas/worker_client.py's reading of a worker's errors: which
failures are the worker's, the request's, load, or the replica leaving."""

from __future__ import annotations

import grpc
import pytest

from gateway.replicas.worker_client import WorkerClient
from gateway.replicas.errors import ModelNotReady, WorkerBusy, WorkerUnreachable
from protos.errors import DeadlineExceeded, Internal, InvalidArgument, ModelNotFound, Unavailable
from tests.unit.gateway.routing.test_router import request


@pytest.mark.parametrize(
    ("code", "connected", "expected"),
    [
        (grpc.StatusCode.UNAVAILABLE, False, WorkerUnreachable),
        (grpc.StatusCode.INTERNAL, False, WorkerUnreachable),  # stream torn down with the connection
        (grpc.StatusCode.UNAVAILABLE, True, Unavailable),  # the worker itself said so
        (grpc.StatusCode.INTERNAL, True, Internal),
        (grpc.StatusCode.INVALID_ARGUMENT, False, InvalidArgument),
        (grpc.StatusCode.NOT_FOUND, True, ModelNotFound),
        (grpc.StatusCode.DEADLINE_EXCEEDED, False, DeadlineExceeded),
    ],
)
async def test_worker_client_error_mapping(
    code: grpc.StatusCode, connected: bool, expected: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = WorkerClient("127.0.0.1:1", headers={"Triton-Access-Token": "t"})
    monkeypatch.setattr(client, "connected", lambda lane="data": connected)
    try:
        error = client._map_error(grpc.aio.AioRpcError(code, details="boom"))
        assert type(error) is expected
        assert "boom" in str(error)
        assert client._metadata == (("triton-access-token", "t"),)
    finally:
        await client.close()


@pytest.mark.parametrize(
    ("details", "trailing", "retry_after_s"),
    [
        ("queue is full", (("retry-after", "2"),), 2.0),
        ("queue is full", (("grpc-retry-pushback-ms", "250"), ("retry-after", "1")), 0.25),
        ("Exceeds maximum queue size for model 'm' (8 waiting)", (), 1.0),  # Triton's words, no hint
    ],
)
async def test_worker_client_maps_a_refusal_with_a_hint_to_busy(
    details: str, trailing: tuple[tuple[str, str], ...], retry_after_s: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = WorkerClient("127.0.0.1:1")
    monkeypatch.setattr(client, "connected", lambda lane="data": True)
    try:
        metadata = grpc.aio.Metadata(*trailing)
        error = client._map_error(grpc.aio.AioRpcError(
            grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), metadata, details=details))
        assert type(error) is WorkerBusy and error.retry_after_s == retry_after_s
    finally:
        await client.close()


async def test_worker_client_closed_is_unreachable() -> None:
    client = WorkerClient("127.0.0.1:1")
    await client.close()
    assert client.closed
    with pytest.raises(WorkerUnreachable):
        await client.infer(request(), 1.0)


async def test_worker_client_takes_a_workers_cancellation_as_its_fault(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stopping worker cancels the calls it holds; the connection is still up, and the batch must go elsewhere."""
    client = WorkerClient("127.0.0.1:1")
    monkeypatch.setattr(client, "connected", lambda lane="data": True)
    try:
        error = client._map_error(grpc.aio.AioRpcError(
            grpc.StatusCode.CANCELLED, grpc.aio.Metadata(), grpc.aio.Metadata(), details="CANCELLED"))
        assert type(error) is WorkerUnreachable
    finally:
        await client.close()


async def test_worker_client_takes_tritons_shutdown_refusal_as_the_model_leaving(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton refuses new requests while it stops with UNAVAILABLE on a live connection: the replica is
    going (its batches move, its circuit is not charged), as when it unloads the model."""
    client = WorkerClient("127.0.0.1:1")
    monkeypatch.setattr(client, "connected", lambda lane="data": True)
    try:
        error = client._map_error(grpc.aio.AioRpcError(
            grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
            details="[request id: <id_unknown>] Server is stopping, scheduler for model has stopped accepting "
                    "new inference requests"))
        assert type(error) is ModelNotReady
        plain = client._map_error(grpc.aio.AioRpcError(
            grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details="overloaded"))
        assert type(plain) is not ModelNotReady
    finally:
        await client.close()
