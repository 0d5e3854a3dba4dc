"""``infergate split`` end to end, in-process."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from infergate.cli import main
from splitter import Plan
from tests.fixtures import model_families, split_graphs


@pytest.fixture
def model_path(tmp_path: Path) -> Path:
    path = tmp_path / "repo" / "encoder" / "1" / "model.onnx"
    path.parent.mkdir(parents=True)
    onnx.save(split_graphs.transformer(), str(path))
    return path


def test_tensor_parallel_with_verify(model_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert main(["split", str(model_path), "--tensor-parallel", "2", "-o", str(out), "--verify"]) == 0
    plan = Plan.from_json((out / "plan.json").read_bytes())
    assert plan.model == "encoder" and plan.tensor_parallel == 2
    for shard in plan.shards():
        assert (out / shard.path).is_file() and (out / shard.name / "config.pbtxt").is_file()
    text = capsys.readouterr().out
    assert "then allreduce_sum" in text
    assert "max abs error" in text and ": OK" in text
    assert "rank 0 50." in text


def test_pipeline_parallel_with_name(model_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "pp"
    assert main(["split", str(model_path), "--pp", "3", "-o", str(out), "--name", "enc", "--verify"]) == 0
    plan = Plan.from_json((out / "plan.json").read_bytes())
    assert [s.name for s in plan.shards()] == ["enc.pp3.s0", "enc.pp3.s1", "enc.pp3.s2"]
    assert "enc.pp3.s2" in capsys.readouterr().out


def test_verify_failure_exits_one(model_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # fp32 reassociation leaves a nonzero difference, which a zero tolerance rejects
    assert main(["split", str(model_path), "--tp", "2", "-o", str(tmp_path / "o"), "--verify", "--tolerance", "0"]) == 1
    assert "FAILED" in capsys.readouterr().out


def test_errors_exit_two(model_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["split", str(tmp_path / "missing.onnx"), "--tp", "2", "-o", str(tmp_path / "o")]) == 2
    assert main(["split", str(model_path), "--pp", "99", "-o", str(tmp_path / "o")]) == 2
    assert "cannot cut into 99 stages" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["split", str(model_path), "--tp", "2", "--pp", "2", "-o", str(tmp_path / "o")])


def test_declared_shapes_and_values(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "vad.onnx"
    onnx.save(model_families.recurrent(), str(model))
    np.save(tmp_path / "sr.npy", np.array(model_families.SAMPLE_RATE, dtype=np.int64))
    assert main(["split", str(model), "--tp", "2", "-o", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert "Reshape" in err and "--input-values" in err and "sr" in err
    args = ["split", str(model), "--tp", "2", "-o", str(tmp_path / "out"), "--verify",
            "--input-shape", "audio=batch,samples:256", "--input-values", f"sr={tmp_path / 'sr.npy'}"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "probed at: batch=2, samples=256" in out
    verified = [line for line in out.splitlines() if line.startswith("verify on audio")]
    assert len(verified) >= 2 and any("audio[1, 256]" in line for line in verified), out
    assert "verify: " in out and ": OK" in out
    assert main([*args[:-4], "--input-shape", "audio=batch"]) == 2
    assert "1 dims given, the model's input has 2" in capsys.readouterr().err


def test_typical_sizes_from_the_repository_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "repo" / "rec" / "1" / "model.onnx"
    path.parent.mkdir(parents=True)
    onnx.save(model_families.recognizer(), str(path))
    (path.parent.parent / "config.pbtxt").write_text(
        'name: "rec"\nmax_batch_size: 4\ninput { name: "image" data_type: TYPE_FP32 dims: [3, 48, 320] }\n')
    assert main(["split", str(path), "--pp", "2", "-o", str(tmp_path / "out"), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "image[" in out and ", 48, 320]" in out, out
    plan = Plan.from_json((tmp_path / "out" / "plan.json").read_bytes())
    assert plan.shards()[1].inputs[0].shape == (-1, -1, 240)
