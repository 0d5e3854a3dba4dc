"""Tests for execution/backends/onnx.py's session layouts: ``cpu_sessions=shared``
(the CPU instances of one model version share one session using every core,
with concurrent runs on it) and ``per_instance`` (a session each)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np
import pytest
from tritonclient.grpc import model_config_pb2 as mc

from execution.backends.base import BackendOptions, Placement, create_backend
from execution.backends.onnx import OnnxBackend, default_intra_op_threads
from protos.errors import InvalidArgument
from tests.unit.execution.test_worker_onnx import add_model, write_model


def backend(cpu_sessions: str, **options: int) -> OnnxBackend:
    made = create_backend("onnx", BackendOptions(device="cpu", extra={"cpu_sessions": cpu_sessions}, **options))
    assert isinstance(made, OnnxBackend)
    return made


def config_of(made: OnnxBackend, version_dir: Path) -> mc.ModelConfig:
    return made.complete_config(mc.ModelConfig(name="add"), version_dir)


async def test_shared_instances_run_concurrently_on_one_session(tmp_path: Path) -> None:
    version_dir = write_model(tmp_path / "add", add_model())
    made = backend("shared", execution_threads=4)
    try:
        assert made.intra_op_threads == default_intra_op_threads(os.cpu_count() or 1, "cpu", "shared")
        config = config_of(made, version_dir)
        instances = [made.load(tmp_path / "add", version_dir, config, Placement("cpu")) for _ in range(4)]
        assert len({id(i._session) for i in instances}) == 1
        a = np.arange(8, dtype=np.float32).reshape(2, 4)
        results = await asyncio.gather(*(i.infer({"A": a, "B": a * k}, ["Y"]) for k, i in enumerate(instances)))
        for k, out in enumerate(results):
            np.testing.assert_array_equal(out["Y"], a + a * k)
        # Closing one instance leaves the others running on the session.
        instances[0].close()
        np.testing.assert_array_equal((await instances[1].infer({"A": a, "B": a}, ["Y"]))["Y"], a + a)
        # A reload of changed bytes or config gets a session of its own.
        other = config_of(made, version_dir)
        other.max_batch_size = 2
        assert made.load(tmp_path / "add", version_dir, other, Placement("cpu"))._session is not instances[1]._session
    finally:
        made.close()


def test_per_instance_sessions_are_apart(tmp_path: Path) -> None:
    version_dir = write_model(tmp_path / "add", add_model())
    made = backend("per_instance")
    try:
        config = config_of(made, version_dir)
        first, second = (made.load(tmp_path / "add", version_dir, config, Placement("cpu")) for _ in range(2))
        assert first._session is not second._session
        assert made.cpu_instances == made.execution_threads
    finally:
        made.close()


def test_layout_defaults_and_refusals() -> None:
    assert default_intra_op_threads(16, "cpu", "shared") == 16
    assert default_intra_op_threads(16, "cpu", "per_instance") == 4
    assert default_intra_op_threads(16, "cuda", "shared") == 1
    with pytest.raises(InvalidArgument, match="cpu_sessions=wide"):
        backend("wide")


async def test_adaptive_runs_alone_on_the_wide_session_and_side_by_side_on_narrow_ones(tmp_path: Path) -> None:
    version_dir = write_model(tmp_path / "add", add_model())
    made = backend("adaptive")
    try:
        config = config_of(made, version_dir)
        first, second = (made.load(tmp_path / "add", version_dir, config, Placement("cpu")) for _ in range(2))
        assert first._wide is second._wide and first._session is not second._session
        used: list[object] = []
        for instance in (first, second):
            run = instance._run

            def spy(inputs, names, session, run=run):  # type: ignore[no-untyped-def]
                used.append(session)
                return run(inputs, names, session)

            instance._run = spy  # type: ignore[method-assign]
        a = np.ones((1, 4), np.float32)
        await first.infer({"A": a, "B": a}, ["Y"])  # alone: the wide session
        await asyncio.gather(first.infer({"A": a, "B": a}, ["Y"]), second.infer({"A": a, "B": a}, ["Y"]))
        assert used[0] is first._wide
        assert used[1] is first._wide and used[2] is second._session  # the second started beside the first
    finally:
        made.close()


async def test_adaptive_keeps_narrow_sessions_just_after_runs_met(tmp_path: Path) -> None:
    """Under load the instances' runs can all end in one turn of the event loop;
    the next batch then finds nothing running but must not take every core."""
    version_dir = write_model(tmp_path / "add", add_model())
    made = backend("adaptive")
    now = [100.0]
    made._activity.clock = lambda: now[0]
    try:
        config = config_of(made, version_dir)
        first, second = (made.load(tmp_path / "add", version_dir, config, Placement("cpu")) for _ in range(2))
        used: list[object] = []
        for instance in (first, second):
            run = instance._run

            def spy(inputs, names, session, run=run):  # type: ignore[no-untyped-def]
                used.append(session)
                now[0] += 0.010  # each run takes 10 ms of the fake clock
                return run(inputs, names, session)

            instance._run = spy  # type: ignore[method-assign]
        a = np.ones((1, 4), np.float32)
        await asyncio.gather(first.infer({"A": a, "B": a}, ["Y"]), second.infer({"A": a, "B": a}, ["Y"]))
        # Met: the second started beside the first (the pool's threads may log the two in either order).
        assert sorted(map(id, used)) == sorted(map(id, (first._wide, second._session)))
        await first.infer({"A": a, "B": a}, ["Y"])  # at once after: narrow, though nothing runs
        assert used[2] is first._session
        now[0] += 0.015  # no run met another for longer than the last run took: every core again
        await second.infer({"A": a, "B": a}, ["Y"])
        assert used[3] is first._wide
    finally:
        made.close()
