"""Running shards on workers: the ``ShardRunner`` a gateway gives
``PlanExecutor``, and the numpy <-> ``ModelInferRequest`` conversions around it.

Each shard call is one routed ``ModelInfer`` of the shard's model name, so
the router picks among the workers that host a copy of that shard (one per
replica group) and retries another copy when one fails. Shards carry no
state between calls: every call sends the shard its inputs in full, which is
what lets any copy of a rank serve any request.

Rank outputs that a plan joins with collective ``none`` (not ``per_rank``)
are taken from the segment's first rank only, so other ranks are not asked
for them; a rank left with nothing to return is not called at all.

Timing: the time a request spends waiting on remote calls is measured per
segment (first call sent to last answer); the rest of the plan's wall time
is the gateway's side of the collectives -- encoding, decoding, summing and
concatenating between segments.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
from tritonclient.grpc import service_pb2

from gateway.batching.assembly import Sender
from protos import codec
from protos.errors import Internal
from splitter.plan import Collective, Plan, Shard


def needed_outputs(plan: Plan) -> dict[str, tuple[str, ...]]:
    """Per shard, the outputs the plan actually reads from it."""
    needed: dict[str, tuple[str, ...]] = {}
    for segment in plan.segments:
        first_only = {b.name for b in segment.boundaries if b.collective is Collective.NONE and not b.per_rank}
        for index, shard in enumerate(segment.shards):
            names = [spec.name for spec in shard.outputs]
            if index > 0:
                names = [name for name in names if name not in first_only]
            needed[shard.name] = tuple(names)
    return needed


def arrays_from_request(request: service_pb2.ModelInferRequest) -> dict[str, np.ndarray]:
    """The inputs of a batch request (raw contents, as the gateway builds them) as arrays."""
    if len(request.raw_input_contents) != len(request.inputs):
        raise Internal(f"batch request for '{request.model_name}' lacks raw contents for some inputs")
    return {
        tensor.name: codec.decode(tensor.datatype, list(tensor.shape), raw, name=tensor.name)
        for tensor, raw in zip(request.inputs, request.raw_input_contents)
    }


def arrays_from_response(response: service_pb2.ModelInferResponse) -> dict[str, np.ndarray]:
    if len(response.raw_output_contents) != len(response.outputs):
        raise Internal(f"worker answered shard '{response.model_name}' without raw contents for some outputs")
    return {
        tensor.name: codec.decode(tensor.datatype, list(tensor.shape), raw, name=tensor.name, role="output")
        for tensor, raw in zip(response.outputs, response.raw_output_contents)
    }


def response_from_arrays(
    request: service_pb2.ModelInferRequest, version: str, outputs: Mapping[str, np.ndarray], order: list[str]
) -> service_pb2.ModelInferResponse:
    """The logical model's answer: the requested outputs (all, in ``order``, when none are named)."""
    names = [out.name for out in request.outputs] or order
    response = service_pb2.ModelInferResponse(model_name=request.model_name, model_version=version, id=request.id)
    for name in names:
        datatype, shape, raw = codec.encode(outputs[name])
        response.outputs.add(name=name, datatype=datatype, shape=shape)
        response.raw_output_contents.append(raw)
    return response


@dataclass(slots=True)
class CallTiming:
    """What one plan run spent: remote time per segment and bytes each way."""

    started: float = field(default_factory=time.perf_counter)
    # segment index -> [first call sent, last answer received]
    segments: dict[int, list[float]] = field(default_factory=dict)
    calls: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0

    def remote_s(self) -> float:
        return sum(end - start for start, end in self.segments.values())

    def note(self, segment: int, start: float, end: float) -> None:
        span = self.segments.get(segment)
        if span is None:
            self.segments[segment] = [start, end]
        else:
            span[0] = min(span[0], start)
            span[1] = max(span[1], end)


class RemoteShards:
    """A ``ShardRunner`` that sends each shard call through ``sender`` (the router).

    One instance serves one plan run: it carries that run's deadline and timing.
    """

    def __init__(self, sender: Sender, needed: Mapping[str, tuple[str, ...]], deadline: float | None) -> None:
        self._sender = sender
        self._needed = needed
        self._deadline = deadline
        self.timing = CallTiming()

    async def __call__(self, shard: Shard, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        wanted = self._needed.get(shard.name, tuple(spec.name for spec in shard.outputs))
        if not wanted:
            return {}
        request = service_pb2.ModelInferRequest(model_name=shard.name)
        for spec in shard.inputs:
            datatype, shape, raw = codec.encode(inputs[spec.name])
            request.inputs.add(name=spec.name, datatype=datatype, shape=shape)
            request.raw_input_contents.append(raw)
            self.timing.bytes_sent += len(raw)
        for name in wanted:
            request.outputs.add(name=name)
        start = time.perf_counter()
        response = await self._sender.infer(shard.name, "", request, self._deadline)
        self.timing.note(shard.segment, start, time.perf_counter())
        self.timing.calls += 1
        self.timing.bytes_received += sum(len(raw) for raw in response.raw_output_contents)
        outputs = arrays_from_response(response)
        missing = [name for name in wanted if name not in outputs]
        if missing:
            raise Internal(f"shard '{shard.name}' answered without outputs {missing}")
        return outputs
