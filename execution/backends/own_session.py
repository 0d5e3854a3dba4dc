"""One ONNX Runtime session a model instance owns alone: the generation and
embedding backends' (each instance runs its own steps on its own thread).

Its threads are the instance's (one intra-op thread on a GPU, where the
device does the work), with no spinning, so an idle instance costs no CPU;
on a GPU the CPU provider stays as the fallback for nodes CUDA does not
run. A file ONNX Runtime cannot load is the model's fault (``InvalidArgument``
naming the file).
"""

from __future__ import annotations

from pathlib import Path

import onnxruntime as ort

from execution.backends.base import Placement
from protos.errors import InvalidArgument

_CUDA, _CPU = "CUDAExecutionProvider", "CPUExecutionProvider"


def own_session(path: Path, version_dir: Path, placement: Placement, cpu_threads: int) -> ort.InferenceSession:
    """The session of ``path`` for one instance at ``placement`` (``cpu_threads`` intra-op threads on the CPU)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1 if placement.kind == "cuda" else cpu_threads
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    providers: list[str | tuple[str, dict[str, str]]] = [_CPU]
    if placement.kind == "cuda":
        providers = [(_CUDA, {"device_id": str(placement.device_id)}), _CPU]
    try:
        return ort.InferenceSession(str(path), options, providers=providers)
    except Exception as exc:  # ONNX Runtime's own exception types for bad files
        raise InvalidArgument(f"ONNX Runtime cannot load {version_dir.name}/{path.name}: {exc}") from None
