"""Running one batch on a peer group: one gateway call per rank (tensor
parallel) or one call to the first stage (pipeline), raw tensor bytes both
ways, no numpy on the gateway.

Every rank gets the batch's inputs; rank 0 (or the pipeline, through its
last stage) answers with the requested outputs. The first rank call that
fails cancels the others at once -- their ranks would otherwise wait on the
failed rank's parts until the deadline -- and the failure is raised for the
caller to rerun the batch on another copy.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from tritonclient.grpc import service_pb2

from gateway.fleet.cluster import Cluster
from gateway.parallel.groups import PeerGroup
from gateway.replicas.replica import group_member
from protos.collective_pb2 import RunRequest, RunResponse, Tensor
from protos.errors import Internal, InvalidArgument, Unavailable

DEFAULT_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class PeerResult:
    response: service_pb2.ModelInferResponse
    calls: int
    peer_bytes: int
    bytes_sent: int
    bytes_received: int
    remote_s: float


async def run_on_group(
    cluster: Cluster,
    group: PeerGroup,
    kind: str,
    request: service_pb2.ModelInferRequest,
    version: str,
    output_names: list[str],
    deadline: float | None,
) -> PeerResult:
    loop = asyncio.get_running_loop()
    timeout_s = DEFAULT_TIMEOUT_S if deadline is None else max(deadline - loop.time(), 0.001)
    inputs = [Tensor(name=t.name, datatype=t.datatype, shape=list(t.shape), raw=raw)
              for t, raw in zip(request.inputs, request.raw_input_contents)]
    batch_id = next(group.batches)
    members = group.members[:1] if kind == "pipeline" else group.members
    calls = []
    for rank, address in enumerate(members):
        worker = cluster.worker(address)
        if worker is None:
            raise Unavailable(f"group {group.id}: worker {address} left the cluster")
        call = RunRequest(group_id=group.id, epoch=group.epoch, batch_id=batch_id, rank=rank, inputs=inputs,
                          outputs=output_names if rank == 0 else [])
        calls.append(group_member(worker.client).run_group(call, timeout_s))
    started = time.perf_counter()
    group.inflight += 1
    try:
        answers = await _all(calls)
    finally:
        group.inflight -= 1
    remote_s = time.perf_counter() - started
    first = answers[0]
    response = service_pb2.ModelInferResponse(model_name=request.model_name, model_version=version, id=request.id)
    by_name = {t.name: t for t in first.outputs}
    for name in output_names:
        tensor = by_name.get(name)
        if tensor is None:
            raise Internal(f"group {group.id} answered without output '{name}'")
        response.outputs.add(name=name, datatype=tensor.datatype, shape=list(tensor.shape))
        response.raw_output_contents.append(tensor.raw)
    sent = sum(len(t.raw) for t in inputs) * len(members)
    received = sum(len(t.raw) for t in first.outputs)
    return PeerResult(response, len(members), sum(a.peer_bytes for a in answers), sent, received, remote_s)


async def _all(calls: list) -> list[RunResponse]:  # type: ignore[type-arg]
    """Every rank's answer; on the first failure, cancel the rest and raise it."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    failed = [t for t in tasks if t in done and not t.cancelled() and t.exception() is not None]
    if failed:
        # A request the model refuses fails on every rank alike; prefer a
        # request fault (not the group's) so it is not rerun.
        errors = [t.exception() for t in failed]
        raise next((e for e in errors if isinstance(e, InvalidArgument)), errors[0])  # type: ignore[misc]
    return [t.result() for t in tasks]
