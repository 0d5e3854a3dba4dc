"""Batch job bookkeeping: row ranges, checkpoints, row checks and grouping, progress."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

from batchjobs.checkpoint import Checkpoint, CheckpointError, JobFingerprint, RangeSet, chunk_ranges
from batchjobs.job import MAX_CHUNK_ROWS, auto_chunk_rows
from batchjobs.progress import Progress, format_duration
from batchjobs.rows import RowError, convert, make_chunk
from loadtest.inputs import TensorSpec

FP32_64 = TensorSpec("INPUT", "FP32", (64,))
TOKENS = TensorSpec("TOKENS", "INT64", (-1,))


def fingerprint(**changes: object) -> JobFingerprint:
    base = dict(input_path="/data/in.npy", input_size=1000, input_mtime_ns=5, model="mlp", model_version="",
                n_rows=1000, chunk_rows=100, output_format="npy", outputs=("OUTPUT",))
    return JobFingerprint(**{**base, **changes})  # type: ignore[arg-type]


# --- ranges and checkpoints ----------------------------------------------------


def test_range_set_merges_adjacent_and_overlapping_ranges() -> None:
    done = RangeSet()
    for start, stop in [(200, 300), (0, 100), (100, 200), (500, 600), (550, 700), (400, 450)]:
        done.add(start, stop)
    assert done.ranges() == [(0, 300), (400, 450), (500, 700)]
    assert done.total() == 300 + 50 + 200
    assert done.covers(0, 300) and done.covers(520, 690)
    assert not done.covers(250, 410)
    assert not done.covers(450, 500)


def test_range_set_bridging_range_joins_neighbours() -> None:
    done = RangeSet([(0, 10), (20, 30), (40, 50)])
    done.add(5, 45)
    assert done.ranges() == [(0, 50)]


def test_chunk_ranges_cover_every_row_once() -> None:
    assert list(chunk_ranges(25, 10)) == [(0, 10), (10, 20), (20, 25)]
    assert list(chunk_ranges(0, 10)) == []


def test_checkpoint_round_trip_and_pending(tmp_path: Path) -> None:
    ckpt = Checkpoint(tmp_path / "checkpoint.json", fingerprint())
    ckpt.done.add(100, 200)
    ckpt.done.add(900, 1000)
    ckpt.save()
    loaded = Checkpoint.load(tmp_path / "checkpoint.json")
    assert loaded.fingerprint == fingerprint()
    assert loaded.done.ranges() == [(100, 200), (900, 1000)]
    assert loaded.pending() == [(0, 100)] + [(s, s + 100) for s in range(200, 900, 100)]
    assert not list(tmp_path.glob(".*tmp*")), "the temporary file is renamed into place"


def test_checkpoint_rejects_garbage(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    path.write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        Checkpoint.load(path)
    path.write_text('{"version": 99}')
    with pytest.raises(CheckpointError, match="unknown format"):
        Checkpoint.load(path)


def test_fingerprint_differences_name_the_fields() -> None:
    assert fingerprint().differences(fingerprint()) == []
    assert fingerprint(input_size=1).differences(fingerprint()) == ["input_size"]
    assert fingerprint(model="cnn", outputs=("PROBS",)).differences(fingerprint()) == ["model", "outputs"]


def test_auto_chunk_rows_targets_a_few_mebibytes() -> None:
    assert auto_chunk_rows([FP32_64]) == MAX_CHUNK_ROWS  # 256 B rows
    cnn = auto_chunk_rows([TensorSpec("IMAGE", "FP32", (3, 32, 32))])
    assert cnn % 64 == 0 and 64 <= cnn * 3 * 32 * 32 * 4 // 1024 <= 4096  # about 4 MiB
    assert auto_chunk_rows([TensorSpec("BIG", "FP32", (4096, 4096))]) == 64  # never below 64 rows


# --- row checks and grouping ---------------------------------------------------


def test_convert_allows_safe_casts_and_refuses_meaning_changes() -> None:
    assert convert(np.arange(3), FP32_64).dtype == np.float32  # JSON ints for a float input
    assert convert(np.zeros(2, np.float64), FP32_64).dtype == np.float32
    assert convert(np.arange(3, dtype=np.int64), TensorSpec("I", "INT32", (3,))).dtype == np.int32
    with pytest.raises(RowError, match="cannot use float64 values as INT64"):
        convert(np.zeros(2), TOKENS)
    with pytest.raises(RowError):
        convert(np.array(["a"]), FP32_64)


def test_stacked_chunk_is_one_group_without_the_bad_rows() -> None:
    values = np.arange(10 * 64, dtype=np.float64).reshape(10, 64)
    chunk = make_chunk(100, 110, {"INPUT": values}, {103: "reader said so"}, [FP32_64])
    assert chunk.bad == {103: "reader said so"}
    [group] = chunk.groups
    assert group.rows.tolist() == [100, 101, 102, 104, 105, 106, 107, 108, 109]
    assert group.tensors["INPUT"].dtype == np.float32
    np.testing.assert_array_equal(group.tensors["INPUT"][3], values[4].astype(np.float32))


def test_stacked_chunk_with_wrong_dims_makes_every_row_bad() -> None:
    chunk = make_chunk(0, 4, {"INPUT": np.zeros((4, 63), np.float32)}, {}, [FP32_64])
    assert chunk.groups == []
    assert sorted(chunk.bad) == [0, 1, 2, 3]
    assert "shape [63] does not match the model's [64]" in chunk.bad[0]


def test_integer_range_is_checked_per_row() -> None:
    spec = TensorSpec("I", "INT32", (2,))
    values = np.array([[1, 2], [2**40, 0], [3, 4]], dtype=np.int64)
    chunk = make_chunk(0, 3, {"I": values}, {}, [spec])
    assert list(chunk.bad) == [1] and "out of range for INT32" in chunk.bad[1]
    assert chunk.groups[0].rows.tolist() == [0, 2]


def test_per_row_chunk_groups_rows_by_shape_in_row_order() -> None:
    rows = [np.arange(3), np.arange(5), None, np.arange(3) + 1, np.array([1.5]), np.arange(5) * 2]
    chunk = make_chunk(10, 16, {"TOKENS": rows}, {}, [TOKENS])
    assert chunk.bad == {12: "TOKENS: missing value", 14: "TOKENS: cannot use float64 values as INT64"}
    assert [g.rows.tolist() for g in chunk.groups] == [[10, 13], [11, 15]]
    assert chunk.groups[0].tensors["TOKENS"].shape == (2, 3)
    np.testing.assert_array_equal(chunk.groups[1].tensors["TOKENS"][1], np.arange(5) * 2)


def test_per_row_chunk_checks_every_input() -> None:
    specs = [TensorSpec("A", "INT32", (2,)), TensorSpec("B", "INT32", (2,))]
    chunk = make_chunk(0, 2, {"A": [np.array([1, 2]), np.array([1, 2])], "B": [np.array([1, 2]), np.array([1])]},
                       {}, specs)
    assert list(chunk.bad) == [1] and chunk.bad[1].startswith("B: shape [1]")
    assert chunk.groups[0].rows.tolist() == [0]


# --- progress ------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_progress_rate_eta_and_lines() -> None:
    clock, out = FakeClock(), io.StringIO()
    progress = Progress(10_000, done=1_000, label="mlp", stream=out, clock=clock)
    for _ in range(4):
        clock.now += 1.0
        progress.advance(500)
    assert progress.rate() == pytest.approx(500.0)
    line = progress.line()
    assert "3,000/10,000 rows" in line and "500 rows/s" in line and "ETA 0:00:14" in line
    assert out.getvalue() == ""  # not a terminal: a line every 5 s at most
    clock.now += 5.0
    progress.advance(500, bad=2)
    assert out.getvalue().count("\n") == 1 and "bad 2" in out.getvalue()


def test_progress_rate_forgets_old_samples() -> None:
    clock = FakeClock()
    progress = Progress(10**6, stream=io.StringIO(), clock=clock)
    clock.now += 1.0
    progress.advance(100_000)  # a fast start ...
    for _ in range(30):
        clock.now += 1.0
        progress.advance(100)  # ... then slow: the estimate follows the recent window
    assert progress.rate() == pytest.approx(100.0)


def test_format_duration() -> None:
    assert format_duration(0) == "0:00:00"
    assert format_duration(3725.4) == "1:02:05"


def test_errors_of_uncommitted_chunks_are_dropped_on_resume(tmp_path: Path) -> None:
    from batchjobs.checkpoint import commit_chunk, keep_errors_of_done, publish_errors

    ckpt = Checkpoint(tmp_path / "checkpoint.json", fingerprint())
    errors = tmp_path / "errors.jsonl"
    commit_chunk(ckpt, 100, 200, {150: "late", 120: "early"}, errors)
    commit_chunk(ckpt, 0, 100, {}, errors)
    with open(errors, "ab") as f:  # a chunk whose commit never happened, its last line cut short
        f.write(b'{"row": 250, "error": "x"}\n{"row": 260, "err')
    assert keep_errors_of_done(errors, Checkpoint.load(tmp_path / "checkpoint.json")) == 2
    published = publish_errors(errors, tmp_path / "out.npy")
    assert published == str(tmp_path / "out.npy.errors.jsonl")
    assert [json.loads(line)["row"] for line in Path(published).read_text().splitlines()] == [120, 150]
