"""Declared input shapes and values of a logical model (``input_shapes`` /
``input_values`` in the gateway config): parsed like ``infergate split``'s
``--input-shape`` / ``--input-values``, value files relative to the config
file, bad entries refused with the key named."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gateway.config import load_config
from gateway.parallel.logical import LogicalSpec, ParallelConfigError


def test_config_keys_reach_the_splitter_hints(tmp_path: Path) -> None:
    np.save(tmp_path / "sr.npy", np.array(16000, dtype=np.int64))
    (tmp_path / "gateway.yaml").write_text(
        "models:\n"
        "  vad_tp2:\n"
        "    from: vad\n"
        "    tensor_parallel: 2\n"
        "    input_shapes: {audio: 'batch,samples:256', state: [2, batch, 64]}\n"
        "    input_values: {sr: sr.npy}\n")
    config = load_config(tmp_path / "gateway.yaml")
    assert "input_shapes" not in config.batching_settings("vad_tp2")
    spec = LogicalSpec.from_settings("vad_tp2", config.logical_models()["vad_tp2"])
    hints = spec.hints()
    assert hints.shapes == {"audio": ("batch", ("samples", 256)), "state": (2, "batch", 64)}
    assert int(hints.values["sr"]) == 16000


@pytest.mark.parametrize("settings, words", [
    ({"input_shapes": {"x": "batch,wide:many"}}, "input_shapes: bad dimension 'wide:many'"),
    ({"input_shapes": ["x"]}, "input_shapes and input_values map input names"),
])
def test_bad_declarations_name_the_key(settings: dict, words: str) -> None:
    with pytest.raises(ParallelConfigError, match=words):
        LogicalSpec.from_settings("m", {"from": "src", **settings})


def test_a_missing_values_file_names_the_key(tmp_path: Path) -> None:
    spec = LogicalSpec.from_settings("m", {"from": "src", "input_values": {"sr": str(tmp_path / "none.npy")}})
    with pytest.raises(ParallelConfigError, match=r"models.m.input_values: input values for 'sr': cannot read"):
        spec.hints()
