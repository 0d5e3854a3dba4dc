"""Top-K strings of Triton's classification extension, computed at the gateway."""

from __future__ import annotations

import numpy as np
import pytest

from gateway.requests.classification import LabelFiles, classify, top_k
from gateway.types import Tensor
from protos import codec
from protos.errors import InvalidArgument


def test_strings_are_tritons() -> None:
    assert top_k(np.array([0.1, 0.7, 0.2], dtype=np.float32), 2, ["a", "b"]) == ["0.700000:1:b", "0.200000:2"]
    assert top_k(np.array([3, 9, 9], dtype=np.int32), 3, []) == ["9:1", "9:2", "3:0"]  # ties in index order


def test_unbatched_shape_and_unsupported_type() -> None:
    tensor = Tensor("OUT", "INT64", (2, 2), np.array([[1, 5], [7, 2]], dtype=np.int64).tobytes())
    out = classify(tensor, 2, [], batched=False)
    assert out.datatype == "BYTES" and out.shape == (2,)
    assert codec.deserialize_bytes_tensor(out.data).tolist() == [b"7:2", b"5:1"]
    with pytest.raises(InvalidArgument, match="unsupported type 'FP16'"):
        classify(Tensor("OUT", "FP16", (1,), b"\0\0"), 1, [], batched=False)


def test_label_files_read_from_the_repository(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "labels.txt").write_text("cat\ndog\n")
    assert LabelFiles(str(tmp_path)).labels("m", "labels.txt") == ["cat", "dog"]
    assert LabelFiles(str(tmp_path)).labels("m", "missing.txt") == []
    assert LabelFiles("").labels("m", "labels.txt") == []
