"""The worker's collective service between real worker processes: two
workers holding ``encoder``'s TP2 shards run a batch as one group, each
called once, exchanging partial sums over their own streams with the
cluster's worker token; rank 0's answer equals the unsplit model. Four
workers holding TP4 shards sum as a ring: every rank ends with the same
bytes, and each sends 2(N-1)/N of each summed tensor, not N-1 copies. Calls
without the token are refused, an unknown group answers UNAVAILABLE, and a
rank whose peer died fails at once rather than at its deadline.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import numpy as np
import onnx
import onnxruntime as ort
import pytest

from gateway.parallel.groups import steps_by_slot
from protos import codec
from protos.collective_pb2 import RunRequest, SetupGroupRequest, TeardownGroupRequest, Tensor
from protos.collective_pb2_grpc import CollectiveStub
from splitter import split_tensor_parallel, write_split
from tests.harness import Proc, start_worker, worker_url

pytestmark = pytest.mark.timeout(120)

TOKEN = "peer-secret"
GROUP = "encoder_tp2/0/test"


@pytest.fixture(scope="module")
def split(model_repo: Path, tmp_path_factory: pytest.TempPathFactory):
    model = onnx.load(str(model_repo / "encoder" / "1" / "model.onnx"))
    result = split_tensor_parallel(model, 2, name="encoder_tp2")
    repo = tmp_path_factory.mktemp("tp2-shards")
    write_split(result, repo)
    return result.plan, repo, model_repo / "encoder" / "1" / "model.onnx"


@contextmanager
def start_group(repo: Path, tmp_path: Path, n: int) -> Iterator[list[Proc]]:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    procs: list[Proc] = []
    try:
        for _ in range(n):
            procs.append(start_worker(repo, "--auth-token-file", str(token_file), "--intra-op-threads", "1"))
        yield procs
    finally:
        for proc in procs:
            proc.stop(check=proc.popen.poll() is None)  # a worker a test killed has no clean exit to check


@pytest.fixture
def workers(split, tmp_path: Path) -> Iterator[list[Proc]]:
    with start_group(split[1], tmp_path, 2) as procs:
        yield procs


def stub(proc: Proc) -> tuple[grpc.Channel, CollectiveStub]:
    channel = grpc.insecure_channel(worker_url(proc))
    return channel, CollectiveStub(channel)


AUTH = (("authorization", f"Bearer {TOKEN}"),)


def set_up(procs: list[Proc], plan, epoch: int = 1) -> None:
    steps = steps_by_slot(plan)
    peers = [worker_url(p) for p in procs]
    for rank, proc in enumerate(procs):
        channel, s = stub(proc)
        with channel:
            s.SetupGroup(SetupGroupRequest(group_id=GROUP, epoch=epoch, rank=rank, peers=peers, kind="tensor",
                                           steps=list(steps[rank])), metadata=AUTH, timeout=10)


def run_request(x: np.ndarray, rank: int, batch_id: int, every_rank: bool = False) -> RunRequest:
    datatype, shape, raw = codec.encode(x)
    return RunRequest(group_id=GROUP, epoch=1, batch_id=batch_id, rank=rank,
                      inputs=[Tensor(name="TOKENS", datatype=datatype, shape=shape, raw=raw)],
                      outputs=["HIDDEN"] if rank == 0 or every_rank else [])


def test_a_group_of_two_workers_equals_the_unsplit_model(split, workers: list[Proc]) -> None:
    plan, _, source = split
    set_up(workers, plan)
    session = ort.InferenceSession(str(source), providers=["CPUExecutionProvider"])
    channels = [stub(p) for p in workers]
    try:
        for batch_id, (rows, seq) in enumerate([(1, 5), (3, 17), (8, 9)], start=1):
            x = np.random.default_rng(batch_id).integers(0, 100, size=(rows, seq)).astype(np.int64)
            futures = [s.Run.future(run_request(x, rank, batch_id), metadata=AUTH, timeout=30)
                       for rank, (_, s) in enumerate(channels)]
            first, second = (f.result() for f in futures)
            (out,) = first.outputs
            got = codec.decode(out.datatype, list(out.shape), out.raw)
            np.testing.assert_allclose(got, session.run(["HIDDEN"], {"TOKENS": x})[0], atol=1e-4, rtol=0)
            assert not second.outputs
            assert first.peer_bytes > 0 and second.peer_bytes == first.peer_bytes  # each sends its partials once
        known = channels[0][1].TeardownGroup(TeardownGroupRequest(group_id=GROUP), metadata=AUTH, timeout=10)
        assert known.known
    finally:
        for channel, _ in channels:
            channel.close()


def test_calls_without_the_token_are_refused_and_unknown_groups_unavailable(workers: list[Proc]) -> None:
    channel, s = stub(workers[0])
    with channel:
        with pytest.raises(grpc.RpcError) as refused:
            s.SetupGroup(SetupGroupRequest(group_id=GROUP, epoch=1, rank=0, peers=["x"], kind="tensor"), timeout=10)
        assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as unknown:
            s.Run(run_request(np.zeros((1, 3), np.int64), 0, 1), metadata=AUTH, timeout=10)
        assert unknown.value.code() is grpc.StatusCode.UNAVAILABLE
        assert "not set up" in (unknown.value.details() or "")


def test_a_rank_whose_peer_died_fails_fast(split, workers: list[Proc]) -> None:
    set_up(workers, split[0])
    workers[1].kill()
    channel, s = stub(workers[0])
    with channel:
        with pytest.raises(grpc.RpcError) as failed:
            s.Run(run_request(np.zeros((1, 3), np.int64), 0, 1), metadata=AUTH, timeout=60)
    # UNAVAILABLE names the peer: the send failed; a rank that waited for
    # its deadline would have answered DEADLINE_EXCEEDED.
    assert failed.value.code() is grpc.StatusCode.UNAVAILABLE, failed.value.details()
    assert "peer" in (failed.value.details() or "")


def test_four_ranks_sum_as_a_ring_and_end_with_the_same_bytes(model_repo: Path, tmp_path: Path) -> None:
    source = model_repo / "encoder" / "1" / "model.onnx"
    result = split_tensor_parallel(onnx.load(str(source)), 4, name="encoder_tp4")
    write_split(result, tmp_path / "shards")
    collectives = [b.collective.value for seg in result.plan.segments for b in seg.boundaries]
    session = ort.InferenceSession(str(source), providers=["CPUExecutionProvider"])
    with start_group(tmp_path / "shards", tmp_path, 4) as procs:
        set_up(procs, result.plan)
        channels = [stub(p) for p in procs]
        try:
            rows, seq = 2, 12
            x = np.random.default_rng(4).integers(0, 100, size=(rows, seq)).astype(np.int64)
            futures = [s.Run.future(run_request(x, rank, 1, every_rank=True), metadata=AUTH, timeout=60)
                       for rank, (_, s) in enumerate(channels)]
            answers = [f.result() for f in futures]
        finally:
            for channel, _ in channels:
                channel.close()
    outputs = [a.outputs[0].raw for a in answers]
    assert all(raw == outputs[0] for raw in outputs[1:])  # the ring hands every rank the same sums
    (out,) = answers[0].outputs
    got = codec.decode(out.datatype, list(out.shape), out.raw)
    np.testing.assert_allclose(got, session.run(["HIDDEN"], {"TOKENS": x})[0], atol=1e-4, rtol=0)
    # Each summed activation [rows, seq, 64] fp32: 2(N-1)/N of it out per rank on the ring (a direct
    # exchange would send N-1 whole copies); a gathered one: this rank's quarter to 3 peers.
    whole = rows * seq * 64 * 4
    ring = collectives.count("allreduce_sum") * 2 * 3 * whole // 4
    gathered = collectives.count("allgather") * 3 * whole // 4
    assert collectives.count("allreduce_sum") >= 2
    assert [a.peer_bytes for a in answers] == [ring + gathered] * 4
