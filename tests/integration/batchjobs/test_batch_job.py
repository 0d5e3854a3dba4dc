"""``infergate batch`` against a real local cluster (``infergate up``, two workers).

Outputs are compared with ONNX Runtime run directly on the model files; an
interrupted job (SIGTERM, SIGKILL) resumed with ``--resume`` must produce
the same file as an uninterrupted one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from tests.harness import ROOT, Proc, infergate_cmd, start

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

JOB_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def cluster(model_repo: Path) -> Iterator[Proc]:
    proc = start(["up", "--workers", "2", "--model-repository", str(model_repo),
                  "--http-port", "0", "--grpc-port", "0"])
    try:
        yield proc
    finally:
        proc.stop()


def url(cluster: Proc) -> str:
    return f"127.0.0.1:{cluster.ready['grpc_port']}"


def batch_cmd(cluster: Proc, model: str, inp: Path, out: Path, *extra: str) -> list[str]:
    return infergate_cmd("batch", "-m", model, "-i", str(inp), "-o", str(out), "-u", url(cluster), "--no-progress",
                         *extra)


def run_batch(cluster: Proc, model: str, inp: Path, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(batch_cmd(cluster, model, inp, out, *extra), cwd=ROOT, capture_output=True, text=True,
                          timeout=JOB_TIMEOUT_S)


def reference(model_repo: Path, model: str, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(str(model_repo / model / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def test_npy_round_trip_keeps_row_order(cluster: Proc, model_repo: Path, tmp_path: Path) -> None:
    x = np.random.default_rng(0).standard_normal((3001, 64)).astype(np.float32)
    np.save(tmp_path / "in.npy", x)
    report = tmp_path / "report.json"
    result = run_batch(cluster, "mlp", tmp_path / "in.npy", tmp_path / "out.npy", "--chunk-rows", "512",
                       "--concurrency", "4", "--report", str(report))
    assert result.returncode == 0, result.stderr
    (expected,) = reference(model_repo, "mlp", {"INPUT": x})
    got = np.load(tmp_path / "out.npy")
    assert got.shape == (3001, 10) and got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    summary = json.loads(report.read_text())
    assert summary["status"] == "done" and summary["rows"] == 3001 and summary["bad_rows"] == 0
    assert not (tmp_path / "out.npy.partial").exists(), "the work directory is removed when done"


def test_npz_two_inputs_two_outputs(cluster: Proc, model_repo: Path, tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    a, b = (rng.integers(-1000, 1000, (203, 16), dtype=np.int32) for _ in range(2))
    np.savez(tmp_path / "in.npz", INPUT0=a, INPUT1=b)
    result = run_batch(cluster, "simple", tmp_path / "in.npz", tmp_path / "out.npz")
    assert result.returncode == 0, result.stderr
    out = np.load(tmp_path / "out.npz")
    np.testing.assert_array_equal(out["OUTPUT0"], a + b)
    np.testing.assert_array_equal(out["OUTPUT1"], a - b)


def test_parquet_round_trip_nested_lists(cluster: Proc, model_repo: Path, tmp_path: Path) -> None:
    images = np.random.default_rng(2).random((70, 3, 32, 32), dtype=np.float32)
    pq.write_table(pa.table({"IMAGE": pa.array(images.tolist(), type=pa.list_(pa.list_(pa.list_(pa.float32()))))}),
                   tmp_path / "in.parquet", row_group_size=32)
    result = run_batch(cluster, "cnn", tmp_path / "in.parquet", tmp_path / "out.parquet", "--chunk-rows", "64")
    assert result.returncode == 0, result.stderr
    (expected,) = reference(model_repo, "cnn", {"IMAGE": images})
    table = pq.read_table(tmp_path / "out.parquet")
    assert table.column_names == ["PROBS"] and table.num_rows == 70
    np.testing.assert_allclose(np.array(table.column("PROBS").to_pylist(), np.float32), expected, rtol=1e-4, atol=1e-6)


def test_jsonl_variable_lengths_and_bad_rows(cluster: Proc, model_repo: Path, tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    rows: list[np.ndarray | None] = [rng.integers(0, 1000, int(n)) for n in rng.integers(3, 12, 40)]
    lines = [json.dumps({"TOKENS": r.tolist()}) for r in rows]
    lines[7] = json.dumps({"TOKENS": [1, 2, 5000]})  # outside the vocabulary: the model refuses it
    lines[20] = "{not json"
    rows[7] = rows[20] = None
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    result = run_batch(cluster, "encoder", tmp_path / "in.jsonl", tmp_path / "out.jsonl", "--batch-size", "4")
    assert result.returncode == 3, result.stderr  # done, with bad rows
    assert "2 bad rows" in result.stderr
    errors = [json.loads(line) for line in (tmp_path / "out.jsonl.errors.jsonl").read_text().splitlines()]
    assert [e["row"] for e in errors] == [7, 20]
    assert "INVALID_ARGUMENT" in errors[0]["error"] and "not valid JSON" in errors[1]["error"]
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(out) == 40 and "error" in out[7] and "error" in out[20]
    for i, tokens in enumerate(rows):
        if tokens is None:
            continue
        (expected,) = reference(model_repo, "encoder", {"TOKENS": tokens[np.newaxis]})
        np.testing.assert_allclose(np.array(out[i]["HIDDEN"], np.float32), expected[0], rtol=1e-4, atol=1e-5)


def test_fail_fast_stops_at_the_first_bad_row(cluster: Proc, tmp_path: Path) -> None:
    (tmp_path / "in.jsonl").write_text('{"INPUT": [0.5]}\n')  # 1 value where 64 are needed
    result = run_batch(cluster, "mlp", tmp_path / "in.jsonl", tmp_path / "out.jsonl", "--fail-fast")
    assert result.returncode == 1
    assert "row 0: INPUT: shape [1] does not match the model's [64]" in result.stderr
    assert not (tmp_path / "out.jsonl").exists()


def test_refuses_to_overwrite_or_mix_jobs(cluster: Proc, tmp_path: Path) -> None:
    np.save(tmp_path / "in.npy", np.zeros((10, 64), np.float32))
    (tmp_path / "out.npy").write_bytes(b"precious")
    result = run_batch(cluster, "mlp", tmp_path / "in.npy", tmp_path / "out.npy")
    assert result.returncode == 1 and "--overwrite" in result.stderr
    assert (tmp_path / "out.npy").read_bytes() == b"precious"
    result = run_batch(cluster, "nope", tmp_path / "in.npy", tmp_path / "x.npy")
    assert result.returncode == 1 and "NOT_FOUND" in result.stderr


def checkpoint_rows(work: Path) -> int:
    try:
        done = json.loads((work / "checkpoint.json").read_text())["done"]
    except (OSError, ValueError):
        return 0  # not written yet, or being replaced
    return sum(b - a for a, b in done)


@pytest.mark.parametrize(("fmt", "sig"), [("npy", signal.SIGTERM), ("parquet", signal.SIGKILL)])
def test_interrupted_job_resumes_to_the_same_file(cluster: Proc, tmp_path: Path, fmt: str, sig: int) -> None:
    n = 12_000
    x = np.random.default_rng(4).standard_normal((n, 64)).astype(np.float32)
    np.save(tmp_path / "in.npy", x)
    chunking = ("--chunk-rows", "512")
    whole, resumed = tmp_path / f"whole.{fmt}", tmp_path / f"resumed.{fmt}"
    result = run_batch(cluster, "mlp", tmp_path / "in.npy", whole, *chunking)
    assert result.returncode == 0, result.stderr

    # A deliberately slow run (one small request at a time), interrupted once it has committed work.
    slow = subprocess.Popen(batch_cmd(cluster, "mlp", tmp_path / "in.npy", resumed, *chunking, "--concurrency", "1",
                                      "--batch-size", "4"),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    work = tmp_path / f"resumed.{fmt}.partial"
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while checkpoint_rows(work) == 0:
        assert slow.poll() is None, slow.communicate()[1]
        assert time.monotonic() < deadline, "no chunk was committed in time"
        time.sleep(0.02)  # polling a condition (the checkpoint), not a sleep standing in for readiness
    os.kill(slow.pid, sig)
    _, stderr = slow.communicate(timeout=JOB_TIMEOUT_S)
    if sig == signal.SIGTERM:
        assert slow.returncode == 143, stderr
        assert "rerun with --resume" in stderr
    else:
        assert slow.returncode == -signal.SIGKILL
    done = checkpoint_rows(work)
    assert 0 < done < n, "the interrupted run left part of the job done"
    assert not resumed.exists()

    result = run_batch(cluster, "mlp", tmp_path / "in.npy", resumed, "--resume", "--report", str(tmp_path / "r.json"))
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "r.json").read_text())["resumed_rows"] == done
    assert resumed.read_bytes() == whole.read_bytes()
    assert not work.exists()
