"""Turns a batch of requests into one worker call and the reply back into
one response per request (the "batch -> run -> unbatch" steps of the path).

Inputs concatenate along dim 0 as bytes and outputs split by row counts as
bytes: row-major tensors need no numpy round trip.
"""

from __future__ import annotations

import logging
from typing import Protocol

from tritonclient.grpc import service_pb2

from gateway.types import InferRequest, InferResponse, Tensor
from protos import codec, wire
from protos.errors import Internal

log = logging.getLogger(__name__)


class Sender(Protocol):
    """Sends one ModelInferRequest to some replica (the router)."""

    async def infer(
        self, model: str, version: str, request: service_pb2.ModelInferRequest, deadline: float | None
    ) -> service_pb2.ModelInferResponse: ...


def build_batch_request(
    model: str, version: str, batch: list[InferRequest], rows: list[int], batched: bool, *, raw_aside: bool = True
) -> service_pb2.ModelInferRequest | wire.RawInferRequest:
    """One ModelInferRequest carrying every row of ``batch`` (inputs already in model order).

    Large inputs (:data:`protos.wire.SPLIT_MIN_BYTES` together or more) stay
    out of the message when ``raw_aside`` (a ``protos.wire.RawInferRequest``,
    which the worker client serializes with one join): a request's tensors
    reach the worker without being copied into protobuf. Callers that read
    the message's contents themselves pass ``raw_aside=False``.
    """
    first = batch[0]
    pb = service_pb2.ModelInferRequest(model_name=model, model_version=version)
    single = len(batch) == 1
    if single:
        pb.id = first.id
    total = sum(rows)
    raws: list[bytes | memoryview] = []
    for index, tensor in enumerate(first.inputs):
        shape = [total, *tensor.shape[1:]] if batched else list(tensor.shape)
        pb.inputs.add(name=tensor.name, datatype=tensor.datatype, shape=shape)
        raws.append(tensor.data if single else codec.concat_rows([r.inputs[index].data for r in batch]))
    for out in first.outputs:
        pb.outputs.add(name=out.name)
    if raw_aside and sum(memoryview(r).nbytes for r in raws) >= wire.SPLIT_MIN_BYTES:
        return wire.RawInferRequest(pb, raws)
    pb.raw_input_contents.extend(r if isinstance(r, bytes) else bytes(r) for r in raws)
    return pb


def split_batch_response(
    response: service_pb2.ModelInferResponse, batch: list[InferRequest], rows: list[int], batched: bool
) -> list[InferResponse]:
    """Split every output of ``response`` back into one InferResponse per request."""
    if len(response.raw_output_contents) != len(response.outputs):
        raise Internal(
            f"worker answered model '{response.model_name}' with {len(response.outputs)} outputs "
            f"but {len(response.raw_output_contents)} raw contents"
        )
    per_request: list[list[Tensor]] = [[] for _ in batch]
    for out, raw in zip(response.outputs, response.raw_output_contents):
        shape = tuple(out.shape)
        if len(batch) == 1:
            per_request[0].append(Tensor(out.name, out.datatype, shape, raw))
            continue
        if not batched or not shape or shape[0] != sum(rows):
            raise Internal(
                f"worker returned output '{out.name}' of shape {list(shape)} for a batch of {sum(rows)} rows"
            )
        parts = codec.split_rows(out.datatype, shape, raw, rows)
        for i, (part, n) in enumerate(zip(parts, rows)):
            per_request[i].append(Tensor(out.name, out.datatype, (n, *shape[1:]), part))
    return [
        InferResponse(model=r.model, version=response.model_version or r.version, id=r.id, outputs=outs)
        for r, outs in zip(batch, per_request)
    ]
