"""The batch job's pipeline with a fake server: bad-row search, stop and resume, fatal errors."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pytest

from batchjobs.client import BatchJobError, Isolation, RowsRejected
from batchjobs.job import BatchJob, JobConfig, work_dir_of
from loadtest.inputs import ModelSignature, TensorSpec

X = TensorSpec("X", "FP32", (4,))
Y = TensorSpec("Y", "FP32", (4,))
N_ROWS = 1000


class MergingServer:
    """Doubles X. Like a server that batches concurrent requests together, it fails
    every request in flight while any of them holds a bad row (X[0] < 0)."""

    def __init__(self, on_call: int = 0, action: str = "", job: BatchJob | None = None) -> None:
        self.retried = 0
        self.calls = 0
        self.rows_sent = 0
        self.on_call, self.action, self.job = on_call, action, job
        self._in_flight: list[bool] = []

    async def signature(self) -> ModelSignature:
        return ModelSignature("double", "1", 8, (X,), (Y,))

    async def infer(self, tensors: Mapping[str, np.ndarray], outputs: Sequence[TensorSpec],
                    batched: bool) -> dict[str, np.ndarray]:
        self.calls += 1
        if self.calls == self.on_call:
            if self.action == "stop":
                assert self.job is not None
                self.job.request_stop()
            elif self.action == "fail":
                raise BatchJobError("the server went away")
        x = tensors["X"]
        self.rows_sent += len(x)
        bad = bool((x[:, 0] < 0).any())
        self._in_flight.append(bad)
        try:
            for _ in range(3):
                await asyncio.sleep(0)  # let concurrent requests overlap
            if any(self._in_flight):
                raise RowsRejected("INVALID_ARGUMENT: negative input")
        finally:
            self._in_flight.remove(bad)
        return {"Y": x * 2}

    async def close(self) -> None:
        pass


@pytest.fixture()
def data(tmp_path: Path) -> np.ndarray:
    x = np.random.default_rng(0).random((N_ROWS, 4), dtype=np.float32)
    np.save(tmp_path / "in.npy", x)
    return x


def config(tmp_path: Path, **changes: object) -> JobConfig:
    base = dict(model="double", input=tmp_path / "in.npy", output=tmp_path / "out.npy", concurrency=4, chunk_rows=64,
                progress=False)
    return JobConfig(**{**base, **changes})  # type: ignore[arg-type]


async def run(cfg: JobConfig, server: MergingServer) -> tuple[BatchJob, object]:
    job = BatchJob(cfg, client=server)
    server.job = job
    return job, await job.run()


async def test_bad_rows_are_found_even_when_the_server_merges_requests(tmp_path: Path, data: np.ndarray) -> None:
    bad = [5, 300, 301, 777]
    data[bad, 0] = -1.0
    np.save(tmp_path / "in.npy", data)
    _, report = await run(config(tmp_path), MergingServer())
    assert report.status == "done" and report.bad_rows == 4
    errors = [json.loads(line) for line in (tmp_path / "out.npy.errors.jsonl").read_text().splitlines()]
    assert [e["row"] for e in errors] == bad
    assert all("negative input" in e["error"] for e in errors)
    out = np.load(tmp_path / "out.npy")
    expected = data * 2
    expected[bad] = 0.0
    np.testing.assert_array_equal(out, expected)


async def test_stop_keeps_finished_chunks_and_resume_repeats_little(tmp_path: Path, data: np.ndarray) -> None:
    first = MergingServer(on_call=40, action="stop")
    _, report = await run(config(tmp_path), first)
    assert report.status == "interrupted"
    assert 0 < report.done_rows < N_ROWS and report.done_rows % 64 == 0
    assert not (tmp_path / "out.npy").exists() and work_dir_of(tmp_path / "out.npy").is_dir()

    second = MergingServer()
    _, resumed = await run(config(tmp_path, resume=True, concurrency=8), second)
    assert resumed.status == "done" and resumed.resumed_rows == report.done_rows
    assert second.rows_sent == N_ROWS - report.done_rows, "only unfinished chunks are sent again"
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), data * 2)
    assert not work_dir_of(tmp_path / "out.npy").exists()


async def test_fatal_error_keeps_committed_work(tmp_path: Path, data: np.ndarray) -> None:
    with pytest.raises(BatchJobError, match="the server went away"):
        await run(config(tmp_path), MergingServer(on_call=60, action="fail"))
    checkpoint = json.loads((work_dir_of(tmp_path / "out.npy") / "checkpoint.json").read_text())
    assert checkpoint["done"], "chunks finished before the failure stay done"
    with pytest.raises(BatchJobError, match="--resume"):
        await run(config(tmp_path), MergingServer())  # neither resume nor overwrite: refuse to clobber
    _, report = await run(config(tmp_path, resume=True), MergingServer())
    assert report.status == "done"
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), data * 2)


async def test_fail_fast_names_the_row(tmp_path: Path, data: np.ndarray) -> None:
    data[130, 0] = -1.0
    np.save(tmp_path / "in.npy", data)
    with pytest.raises(BatchJobError, match="row 130: INVALID_ARGUMENT"):
        await run(config(tmp_path, fail_fast=True), MergingServer())


async def test_isolation_drains_shared_work_and_holds_new_work() -> None:
    isolation = Isolation()
    events: list[str] = []
    release = asyncio.Event()

    async def shared(name: str) -> None:
        await isolation.enter_shared()
        events.append(f"{name} in")
        await release.wait()
        events.append(f"{name} out")
        isolation.leave_shared()

    async def exclusive() -> None:
        async with isolation.exclusive():
            events.append("exclusive")

    first = asyncio.create_task(shared("a"))
    await asyncio.sleep(0)
    alone = asyncio.create_task(exclusive())
    await asyncio.sleep(0)
    late = asyncio.create_task(shared("b"))  # arrives while the exclusive holder waits
    for _ in range(5):
        await asyncio.sleep(0)
    assert events == ["a in"]
    release.set()
    await asyncio.gather(first, alone, late)
    assert events == ["a in", "a out", "exclusive", "b in", "b out"]


async def test_resume_after_a_crash_during_clean_up_keeps_the_output(tmp_path: Path, data: np.ndarray,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import batchjobs.job as batch_job

    with monkeypatch.context() as patched:
        patched.setattr(batch_job.shutil, "rmtree", lambda *a, **k: None)  # "crash" before the clean-up
        await run(config(tmp_path), MergingServer())
    finished = (tmp_path / "out.npy").read_bytes()
    assert (work_dir_of(tmp_path / "out.npy") / "checkpoint.json").exists()
    server = MergingServer()
    _, report = await run(config(tmp_path, resume=True), server)
    assert report.status == "done" and server.rows_sent == 0
    assert (tmp_path / "out.npy").read_bytes() == finished
    assert not work_dir_of(tmp_path / "out.npy").exists()
