"""Tests for models/python_models.py: the decoupled Python-backend examples'
configs (Triton's example configs) and the files ``models build`` writes."""

from __future__ import annotations

from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from models.python_models import PYTHON_MODEL_NAMES, build_python_models, model_source


def test_build_writes_config_and_model_py(tmp_path: Path) -> None:
    assert build_python_models(tmp_path) == ["square_int32", "repeat_int32"] == list(PYTHON_MODEL_NAMES)
    for name in PYTHON_MODEL_NAMES:
        config = text_format.Parse((tmp_path / name / "config.pbtxt").read_text(), mc.ModelConfig())
        assert config.name == name and config.backend == "python" and not config.platform
        assert config.max_batch_size == 0 and config.model_transaction_policy.decoupled
        assert [(g.count, g.kind) for g in config.instance_group] == [(2, mc.ModelInstanceGroup.KIND_CPU)]
        source = (tmp_path / name / "1" / "model.py").read_text()
        assert source == model_source(name)
        compile(source, "model.py", "exec")
        assert "import triton_python_backend_utils as pb_utils" in source


def test_signatures_are_tritons_examples(tmp_path: Path) -> None:
    build_python_models(tmp_path)

    def signature(name: str) -> tuple[list[tuple[str, int, list[int]]], list[tuple[str, int, list[int]]]]:
        config = text_format.Parse((tmp_path / name / "config.pbtxt").read_text(), mc.ModelConfig())
        return ([(t.name, t.data_type, list(t.dims)) for t in config.input],
                [(t.name, t.data_type, list(t.dims)) for t in config.output])

    assert signature("square_int32") == ([("IN", mc.TYPE_INT32, [1])], [("OUT", mc.TYPE_INT32, [1])])
    assert signature("repeat_int32") == (
        [("IN", mc.TYPE_INT32, [-1]), ("DELAY", mc.TYPE_UINT32, [-1]), ("WAIT", mc.TYPE_UINT32, [1])],
        [("OUT", mc.TYPE_INT32, [1]), ("IDX", mc.TYPE_UINT32, [1])],
    )


def test_build_only_the_named_and_is_idempotent(tmp_path: Path) -> None:
    assert build_python_models(tmp_path, ("repeat_int32",)) == ["repeat_int32"]
    assert not (tmp_path / "square_int32").exists()
    written = (tmp_path / "repeat_int32" / "1" / "model.py").stat().st_mtime_ns
    build_python_models(tmp_path, ("repeat_int32",))
    assert (tmp_path / "repeat_int32" / "1" / "model.py").stat().st_mtime_ns == written
