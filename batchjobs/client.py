"""The gRPC client of an offline batch job (KServe v2 ``ModelInfer``).

Owns one channel to the gateway (or any KServe v2 / Triton server), the
model's signature (``ModelMetadata`` + ``ModelConfig``), and the sorting of
failures into three kinds, because each needs a different answer:

- transient (``UNAVAILABLE``, ``RESOURCE_EXHAUSTED``, deadlines, transport):
  retried with exponential backoff (inference is idempotent); still failing
  after ``retries`` tries, the job stops and can be resumed;
- about the rows (``INVALID_ARGUMENT``, ``OUT_OF_RANGE``, ``INTERNAL``...):
  :class:`RowsRejected`, which the job answers by splitting the batch to
  find the bad rows;
- about the job (unknown model, missing credentials): :class:`BatchJobError`.

:class:`Isolation` lets the search for bad rows run alone: a server that
batches concurrent requests together (the gateway does) fails every request
of a batch that holds one bad row, so a row is only called bad after it
failed with none of the job's other requests in flight.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Protocol

import grpc
import numpy as np
from tritonclient.grpc import service_pb2, service_pb2_grpc

from loadtest.inputs import ModelSignature, TensorSpec, make_signature
from protos import codec
from protos.errors import InferGateError

log = logging.getLogger(__name__)

_GRPC_OPTIONS = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
_TRANSIENT = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.ABORTED, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED,
})
_ABOUT_ROWS = frozenset({
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.INTERNAL,
})
_MAX_BACKOFF_S = 5.0


class BatchJobError(Exception):
    """The job cannot go on; finished work is kept and ``--resume`` continues it."""


class RowsRejected(Exception):
    """The server refused these rows (not the job); one of them, at least, is bad."""


class JobClient(Protocol):
    """What a batch job needs from a server connection (a seam for tests)."""

    retried: int

    async def signature(self) -> ModelSignature: ...

    async def infer(self, tensors: Mapping[str, np.ndarray], outputs: Sequence[TensorSpec],
                    batched: bool) -> dict[str, np.ndarray]: ...

    async def close(self) -> None: ...


class BatchClient:
    def __init__(self, url: str, model: str, version: str = "", *, headers: Sequence[tuple[str, str]] = (),
                 timeout_s: float = 60.0, retries: int = 5, backoff_s: float = 0.05) -> None:
        self.model = model
        self.version = version
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.retried = 0  # transient failures retried, for the report
        # gRPC metadata keys must be lower case.
        self._metadata = tuple((k.lower(), v) for k, v in headers) or None
        self._channel = grpc.aio.insecure_channel(url, options=_GRPC_OPTIONS)
        self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)

    async def signature(self) -> ModelSignature:
        try:
            metadata = await self._stub.ModelMetadata(
                service_pb2.ModelMetadataRequest(name=self.model, version=self.version),
                timeout=self.timeout_s, metadata=self._metadata, wait_for_ready=False)
        except grpc.aio.AioRpcError as exc:
            raise BatchJobError(f"model {self.model!r}: {exc.code().name}: {exc.details()}") from None
        try:
            config = await self._stub.ModelConfig(
                service_pb2.ModelConfigRequest(name=self.model, version=self.version),
                timeout=self.timeout_s, metadata=self._metadata)
            max_batch: int | None = config.config.max_batch_size
        except grpc.aio.AioRpcError:
            max_batch = None
        return make_signature(metadata, max_batch)

    async def infer(self, tensors: Mapping[str, np.ndarray], outputs: Sequence[TensorSpec],
                    batched: bool) -> dict[str, np.ndarray]:
        """Outputs for the rows stacked in ``tensors`` (a batch dim even when the model has none)."""
        rows = len(next(iter(tensors.values())))
        request = service_pb2.ModelInferRequest(model_name=self.model, model_version=self.version)
        for name, values in tensors.items():
            if not batched:
                values = values[0]  # one row per request, sent without a batch dim
            datatype, shape, raw = codec.encode(values)
            request.inputs.add(name=name, datatype=datatype, shape=shape)
            request.raw_input_contents.append(raw)
        for spec in outputs:
            request.outputs.add(name=spec.name)
        response = await self._send(request)
        return self._decode(response, outputs, rows, batched)

    async def _send(self, request: service_pb2.ModelInferRequest) -> service_pb2.ModelInferResponse:
        delay_s = self.backoff_s
        for attempt in range(self.retries + 1):
            try:
                return await self._stub.ModelInfer(request, timeout=self.timeout_s, metadata=self._metadata)
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                if code in _ABOUT_ROWS:
                    raise RowsRejected(f"{code.name}: {exc.details()}") from None
                if code not in _TRANSIENT:
                    raise BatchJobError(f"the server refused the job: {code.name}: {exc.details()}") from None
                if attempt == self.retries:
                    raise BatchJobError(
                        f"still failing after {self.retries} retries: {code.name}: {exc.details()}") from None
                self.retried += 1
                log.debug("transient %s (attempt %d), retrying in %.2fs", code.name, attempt + 1, delay_s)
                await asyncio.sleep(delay_s)
                delay_s = min(delay_s * 2, _MAX_BACKOFF_S)
        raise AssertionError("unreachable")

    def _decode(self, response: service_pb2.ModelInferResponse, outputs: Sequence[TensorSpec], rows: int,
                batched: bool) -> dict[str, np.ndarray]:
        raw_by_name = {t.name: (t, raw) for t, raw in zip(response.outputs, response.raw_output_contents)}
        result: dict[str, np.ndarray] = {}
        for spec in outputs:
            if spec.name not in raw_by_name:
                raise BatchJobError(f"the server's response has no output {spec.name!r} (raw contents expected)")
            tensor, raw = raw_by_name[spec.name]
            try:
                values = codec.decode(tensor.datatype, list(tensor.shape), raw, name=spec.name, role="output")
            except InferGateError as exc:
                raise BatchJobError(f"bad response: {exc.message}") from None
            if not batched:
                values = values[np.newaxis]
            if values.shape[:1] != (rows,):
                raise BatchJobError(f"output {spec.name} has {values.shape[:1]} rows for {rows} sent")
            result[spec.name] = values
        return result

    async def close(self) -> None:
        await self._channel.close()


class Isolation:
    """Shared request slots that one exclusive holder can empty and keep empty.

    ``enter_shared``/``leave_shared`` wrap each ordinary request; ``exclusive()``
    closes the gate to new ones, waits for those in flight to finish, and
    holds until its block ends. One exclusive holder at a time.
    """

    def __init__(self) -> None:
        self._shared = 0
        self._gate = asyncio.Event()  # set: ordinary requests may start
        self._gate.set()
        self._drained = asyncio.Event()  # set: no ordinary request in flight
        self._drained.set()
        self._lock = asyncio.Lock()

    async def enter_shared(self) -> None:
        # Re-checked after every wake-up, then counted with no await in between:
        # an exclusive holder that closed the gate meanwhile is never overtaken.
        while not self._gate.is_set():
            await self._gate.wait()
        self._shared += 1
        self._drained.clear()

    def leave_shared(self) -> None:
        self._shared -= 1
        if self._shared == 0:
            self._drained.set()

    @asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        async with self._lock:
            self._gate.clear()
            try:
                await self._drained.wait()
                yield
            finally:
                self._gate.set()
