"""``initial_state`` of a stateful model's ``sequence_batching.state``
(execution/sequences.py): zeros, or a ``data_file`` read from the model's
``initial_state/`` directory at load, each mistake refused naming the state."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tritonclient.grpc import model_config_pb2 as mc

from models.sequences import accumulate, accumulate_seeded
from protos.errors import InvalidArgument
from execution.sequences import SequenceBook, SequenceFlags, SequenceSettings, server_filled_inputs


def _seeded(tmp_path: Path, data: bytes | None, data_file: str = "seed.bin") -> mc.ModelConfig:
    _, config = accumulate_seeded()
    config.sequence_batching.state[0].initial_state[0].data_file = data_file
    if data is not None:
        (tmp_path / "initial_state").mkdir(exist_ok=True)
        (tmp_path / "initial_state" / "seed.bin").write_bytes(data)
    return config


def _start_state(settings: SequenceSettings, batched: bool = True) -> np.ndarray:
    book = SequenceBook("m", settings, batched)
    flags = SequenceFlags(corrid=1, start=True, end=False)
    return book.feeds(book.open(flags), flags, 1)["ACC_IN"]


def test_a_data_file_is_the_state_at_start(tmp_path: Path) -> None:
    settings = SequenceSettings.from_config(_seeded(tmp_path, np.array([42], dtype="<i4").tobytes()), tmp_path)
    assert settings is not None
    assert _start_state(settings).tolist() == [[42]]
    assert _start_state(settings, batched=False).tolist() == [42]


def test_zero_data_and_no_initial_state_start_from_zeros(tmp_path: Path) -> None:
    _, config = accumulate()
    settings = SequenceSettings.from_config(config, tmp_path)
    assert settings is not None and _start_state(settings).tolist() == [[0]]
    del config.sequence_batching.state[0].initial_state[:]
    settings = SequenceSettings.from_config(config)
    assert settings is not None and _start_state(settings).tolist() == [[0]]


@pytest.mark.parametrize(
    ("data", "data_file", "message"),
    [
        (None, "seed.bin", r"cannot read initial_state/seed.bin"),
        (b"\x01\x00", "seed.bin", r"initial_state/seed.bin does not hold a INT32\[1\] tensor"),
        (b"\x01\x00\x00\x00", "../config.pbtxt", r"must name a file inside 'initial_state/'"),
    ],
)
def test_a_bad_data_file_is_refused_naming_the_state(tmp_path: Path, data: bytes | None, data_file: str,
                                                      message: str) -> None:
    with pytest.raises(InvalidArgument, match=rf"model 'accumulate_seeded': state 'ACC_IN'.*{message}"):
        SequenceSettings.from_config(_seeded(tmp_path, data, data_file), tmp_path)


def test_a_data_file_needs_the_model_directory_and_a_matching_type(tmp_path: Path) -> None:
    config = _seeded(tmp_path, np.array([1], dtype="<i4").tobytes())
    with pytest.raises(InvalidArgument, match="needs the model directory"):
        SequenceSettings.from_config(config)
    assert server_filled_inputs(config) == {"ACC_IN"}  # names only: no file is read
    config.sequence_batching.state[0].initial_state[0].data_type = mc.TYPE_FP32
    with pytest.raises(InvalidArgument, match="must have the state's data_type and dims"):
        SequenceSettings.from_config(config, tmp_path)
    config.sequence_batching.state[0].initial_state.add(name="second", data_type=mc.TYPE_INT32, zero_data=True)
    with pytest.raises(InvalidArgument, match="at most one is allowed"):
        SequenceSettings.from_config(config, tmp_path)
