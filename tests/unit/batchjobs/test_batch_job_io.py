"""Batch job readers and writers, without a server: every format, ranges, bad rows, reassembly."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
import pytest

from batchjobs.rows import Chunk
from batchjobs.sinks import ChunkResult, open_sink
from batchjobs.sources import BatchInputError, NpyReader, count_lines, open_source
from loadtest.inputs import TensorSpec

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

MLP_IN = TensorSpec("INPUT", "FP32", (64,))
MLP_OUT = TensorSpec("OUTPUT", "FP32", (10,))
A = TensorSpec("INPUT0", "INT32", (16,))
B = TensorSpec("INPUT1", "INT32", (16,))
IMAGE = TensorSpec("IMAGE", "FP32", (3, 4, 4))
TOKENS = TensorSpec("TOKENS", "INT64", (-1,))
HIDDEN = TensorSpec("HIDDEN", "FP32", (-1, 4))


def rows_of(chunks: list[Chunk], name: str) -> dict[int, np.ndarray]:
    out: dict[int, np.ndarray] = {}
    for chunk in chunks:
        for group in chunk.groups:
            for row, value in zip(group.rows.tolist(), group.tensors[name]):
                out[row] = value
    return out


# --- sources -------------------------------------------------------------------


def test_npy_source_reads_only_requested_ranges(tmp_path: Path) -> None:
    data = np.random.default_rng(0).standard_normal((1000, 64)).astype(np.float32)
    np.save(tmp_path / "in.npy", data)
    source = open_source(tmp_path / "in.npy", [MLP_IN])
    assert source.n_rows == 1000
    chunks = list(source.chunks([(0, 100), (500, 750), (990, 1000)]))
    source.close()
    assert [(c.start, c.stop) for c in chunks] == [(0, 100), (500, 750), (990, 1000)]
    got = rows_of(chunks, "INPUT")
    assert sorted(got) == [*range(100), *range(500, 750), *range(990, 1000)]
    np.testing.assert_array_equal(np.stack([got[r] for r in range(500, 750)]), data[500:750])


@pytest.mark.parametrize("compression", [zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED])
def test_npz_source_one_array_per_input(tmp_path: Path, compression: int) -> None:
    a = np.arange(50 * 16, dtype=np.int32).reshape(50, 16)
    b = -a
    path = tmp_path / "in.npz"
    (np.savez_compressed if compression == zipfile.ZIP_DEFLATED else np.savez)(path, INPUT0=a, INPUT1=b, EXTRA=a)
    source = open_source(path, [A, B])
    chunks = list(source.chunks([(10, 20), (40, 50)]))
    source.close()
    got = np.stack(list(rows_of(chunks, "INPUT1").values()))
    np.testing.assert_array_equal(got, np.concatenate([b[10:20], b[40:50]]))


def test_numpy_source_refuses_unusable_files(tmp_path: Path) -> None:
    np.save(tmp_path / "short.npy", np.zeros((5, 63), np.float32))
    with pytest.raises(BatchInputError, match=r"shape \[63\] does not match the model's \[64\]"):
        open_source(tmp_path / "short.npy", [MLP_IN])
    np.save(tmp_path / "ints.npy", np.zeros((5, 16), np.float32))
    with pytest.raises(BatchInputError, match="the model has 2 inputs"):
        open_source(tmp_path / "ints.npy", [A, B])
    np.savez(tmp_path / "missing.npz", INPUT0=np.zeros((5, 16), np.int32))
    with pytest.raises(BatchInputError, match="no array 'INPUT1'"):
        open_source(tmp_path / "missing.npz", [A, B])
    np.save(tmp_path / "floats.npy", np.zeros((5, 7), np.float32))
    with pytest.raises(BatchInputError, match="cannot use float32 values as INT64"):
        open_source(tmp_path / "floats.npy", [TOKENS])
    with pytest.raises(BatchInputError, match="unknown format"):
        open_source(tmp_path / "in.csv", [MLP_IN])


def test_npy_reader_handles_fortran_free_big_endian(tmp_path: Path) -> None:
    data = np.arange(12, dtype=">f4").reshape(4, 3)
    np.save(tmp_path / "be.npy", data)
    with open(tmp_path / "be.npy", "rb") as f:
        np.testing.assert_array_equal(NpyReader(f, "be").read(1, 3), data[1:3])


def test_jsonl_source_streams_lines_and_reports_bad_ones(tmp_path: Path) -> None:
    lines = [
        json.dumps({"TOKENS": [1, 2, 3]}),
        "{broken",
        json.dumps({"OTHER": [1]}),
        "",
        json.dumps([4, 5]),  # a bare list for a single-input model
        json.dumps({"TOKENS": [[1, 2], [3]]}),
        json.dumps({"TOKENS": ["a"]}),
        json.dumps({"TOKENS": [7, 8, 9]}),
    ]
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines))  # no newline after the last line
    assert count_lines(path) == 8
    source = open_source(path, [TOKENS])
    [first, second] = source.chunks([(0, 4), (4, 8)])
    source.close()
    assert first.bad[1].startswith("not valid JSON") and first.bad[2] == "missing input 'TOKENS'"
    assert first.bad[3] == "empty line"
    assert "uneven lengths" in second.bad[5] and "expected numbers" in second.bad[6]
    assert [g.rows.tolist() for g in second.groups] == [[4], [7]]
    assert rows_of([first, second], "TOKENS")[7].tolist() == [7, 8, 9]


def write_parquet(path: Path, table: pa.Table, row_group_size: int) -> None:
    pq.write_table(table, path, row_group_size=row_group_size)


def test_parquet_source_nested_lists_and_ranges_across_row_groups(tmp_path: Path) -> None:
    images = np.random.default_rng(1).standard_normal((300, 3, 4, 4)).astype(np.float32)
    write_parquet(tmp_path / "in.parquet", pa.table({"IMAGE": pa.array(images.tolist())}), row_group_size=64)
    source = open_source(tmp_path / "in.parquet", [IMAGE])
    assert source.n_rows == 300
    chunks = list(source.chunks([(0, 10), (60, 200), (290, 300)]))
    source.close()
    got = rows_of(chunks, "IMAGE")
    assert sorted(got) == [*range(10), *range(60, 200), *range(290, 300)]
    np.testing.assert_array_equal(np.stack([got[r] for r in range(60, 200)]), images[60:200])


def test_parquet_source_flat_lists_nulls_and_ragged_rows(tmp_path: Path) -> None:
    flat = [list(range(48)), None, list(range(48))]
    tokens = [[1, 2, 3], [4], None]
    write_parquet(tmp_path / "in.parquet", pa.table({"IMAGE": flat, "TOKENS": tokens}), row_group_size=2)
    source = open_source(tmp_path / "in.parquet", [IMAGE, TOKENS])
    [chunk] = source.chunks([(0, 3)])
    source.close()
    assert chunk.bad == {1: "IMAGE: null value", 2: "TOKENS: null value"}
    [group] = chunk.groups
    assert group.rows.tolist() == [0]
    assert group.tensors["IMAGE"].shape == (1, 3, 4, 4)  # a flat list of prod(dims) fits the dims


def test_parquet_source_missing_column(tmp_path: Path) -> None:
    write_parquet(tmp_path / "in.parquet", pa.table({"X": [1, 2]}), row_group_size=2)
    with pytest.raises(BatchInputError, match="no column 'TOKENS'"):
        open_source(tmp_path / "in.parquet", [TOKENS])


# --- sinks ---------------------------------------------------------------------


def mlp_results(outputs: np.ndarray, chunk_rows: int, bad: set[int]) -> list[ChunkResult]:
    results = []
    for start in range(0, len(outputs), chunk_rows):
        stop = min(start + chunk_rows, len(outputs))
        rows = np.array([r for r in range(start, stop) if r not in bad], dtype=np.int64)
        # Two requests per chunk, finishing in reverse order.
        half = len(rows) // 2
        parts = [(rows[half:], {"OUTPUT": outputs[rows[half:]]}), (rows[:half], {"OUTPUT": outputs[rows[:half]]})]
        results.append(ChunkResult(start, stop, parts, {r: f"bad {r}" for r in bad if start <= r < stop}))
    return results[::-1]  # chunks finish out of order too


@pytest.mark.parametrize("fmt", ["npy", "npz", "jsonl", "parquet"])
def test_sinks_reassemble_out_of_order_chunks_in_row_order(tmp_path: Path, fmt: str) -> None:
    outputs = np.random.default_rng(2).standard_normal((250, 10)).astype(np.float32)
    work = tmp_path / "out.partial"
    work.mkdir()
    sink = open_sink(fmt, work, [MLP_OUT], len(outputs))
    for result in mlp_results(outputs, 64, bad={5, 130}):
        assert sink.write(result) == {}
    target = tmp_path / f"out.{fmt}"
    sink.finish(target)
    sink.close()
    expected = outputs.copy()
    if fmt == "npy":
        got = np.load(target)
    elif fmt == "npz":
        got = np.load(target)["OUTPUT"]
    elif fmt == "jsonl":
        lines = [json.loads(line) for line in target.read_text().splitlines()]
        assert lines[5] == {"error": "bad 5"} and lines[130] == {"error": "bad 130"}
        got = np.array([line.get("OUTPUT", [0.0] * 10) for line in lines], dtype=np.float32)
    else:
        table = pq.read_table(target)
        assert table.column("OUTPUT").null_count == 2 and table.column("OUTPUT")[130].as_py() is None
        got = np.array([v if v is not None else [0.0] * 10 for v in table.column("OUTPUT").to_pylist()], np.float32)
    expected[[5, 130]] = 0.0  # bad rows: zeros in NumPy outputs
    np.testing.assert_array_equal(got, expected)


def test_parquet_sink_variable_shapes(tmp_path: Path) -> None:
    work = tmp_path / "w"
    work.mkdir()
    sink = open_sink("parquet", work, [HIDDEN], 4)
    a = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)  # rows 0 and 3: 3 tokens
    b = np.ones((1, 1, 4), np.float32)  # row 1: 1 token
    sink.write(ChunkResult(0, 4, [(np.array([0, 3]), {"HIDDEN": a}), (np.array([1]), {"HIDDEN": b})], {2: "x"}))
    sink.finish(tmp_path / "out.parquet")
    values = pq.read_table(tmp_path / "out.parquet").column("HIDDEN").to_pylist()
    assert values[0] == a[0].tolist() and values[3] == a[1].tolist()
    assert values[1] == b[0].tolist() and values[2] is None


def test_npy_sink_rejects_a_second_shape_for_variable_dims(tmp_path: Path) -> None:
    work = tmp_path / "w"
    work.mkdir()
    sink = open_sink("npy", work, [HIDDEN], 3)
    first = sink.write(ChunkResult(0, 2, [(np.array([0, 1]), {"HIDDEN": np.ones((2, 5, 4), np.float32)})]))
    second = sink.write(ChunkResult(2, 3, [(np.array([2]), {"HIDDEN": np.ones((1, 6, 4), np.float32)})]))
    sink.finish(tmp_path / "out.npy")
    assert first == {} and list(second) == [2] and "differs" in second[2]
    out = np.load(tmp_path / "out.npy")
    assert out.shape == (3, 5, 4) and out[:2].all() and not out[2].any()


def test_npy_sink_resumes_into_its_own_file(tmp_path: Path) -> None:
    work = tmp_path / "w"
    work.mkdir()
    sink = open_sink("npy", work, [MLP_OUT], 4)
    sink.write(ChunkResult(0, 2, [(np.array([0, 1]), {"OUTPUT": np.full((2, 10), 7, np.float32)})]))
    sink.close()
    again = open_sink("npy", work, [MLP_OUT], 4)  # a resumed job reopens the same file
    again.write(ChunkResult(2, 4, [(np.array([2, 3]), {"OUTPUT": np.full((2, 10), 9, np.float32)})]))
    again.finish(tmp_path / "out.npy")
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy")[:, 0], [7, 7, 9, 9])
    with pytest.raises(BatchInputError, match="does not belong to this job"):
        np.save(work / "OUTPUT.npy", np.zeros((5, 10), np.float32))
        open_sink("npy", work, [MLP_OUT], 4)


def test_npy_output_needs_a_single_output(tmp_path: Path) -> None:
    with pytest.raises(BatchInputError, match="the model has 2 outputs"):
        open_sink("npy", tmp_path, [MLP_OUT, HIDDEN], 4)


def test_parts_sink_refuses_to_assemble_with_a_gap(tmp_path: Path) -> None:
    sink = open_sink("jsonl", tmp_path, [MLP_OUT], 4)
    sink.write(ChunkResult(0, 2, [(np.array([0, 1]), {"OUTPUT": np.zeros((2, 10), np.float32)})]))
    with pytest.raises(ValueError, match="end at row 2 of 4"):
        sink.finish(tmp_path / "out.jsonl")
