"""In-process ONNX Runtime, the ceiling a server's figures are read against:
``session.run`` on sessions built by the worker's own ONNX backend (so with
the server's session options: intra-op threads, no spinning, sequential
execution, every graph optimisation), timed in this process.

Two layouts, both the ``adaptive`` default's own sessions on the CPU:

* ``wide``: one session on every core, one run at a time (what a lone
  request takes);
* ``side_by_side``: one narrow session per execution thread (cores/4, at
  least 1, intra-op threads each), each run in a loop on its own thread
  (``session.run`` releases the GIL), as the worker runs batches under load.

A level reports the figures of an ``infergate bench`` level (``rps`` is rows
per second here, ``p50_ms`` one run's median time, ``avg_batch`` the batch)
so it takes its turn among the servers.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from tritonclient.grpc import model_config_pb2 as mc

from execution.backends.base import BackendOptions, Placement
from execution.backends.onnx import OnnxBackend
from execution.devices import cpu_count

# Sizes of an input's variable dims other than the batch (as the bench clients send them).
DIM_SIZES: dict[str, dict[str, int]] = {"encoder": {"tokens": 32}}
_DTYPES = {"tensor(float)": np.float32, "tensor(int64)": np.int64, "tensor(int32)": np.int32,
           "tensor(uint8)": np.uint8}


class OrtCeiling:
    """The sessions of one model, built once, timed at any batch."""

    def __init__(self, repo: Path, model: str, cpu_sessions: str = "adaptive") -> None:
        self.model = model
        backend = OnnxBackend(BackendOptions(device="cpu", extra={"cpu_sessions": cpu_sessions}))
        version_dir = repo / model / "1"
        path = version_dir / backend.default_model_filename
        config = mc.ModelConfig(name=model)
        cpu = Placement("cpu")
        # The backend's own session factory: the same options as the server's sessions.
        self.wide = backend._create_session(path, version_dir, config, cpu, cpu_count())
        self.narrow = [backend._create_session(path, version_dir, config, cpu)
                       for _ in range(backend.execution_threads)]
        self.describe = (f"wide: 1 x {cpu_count()} threads; side by side: {backend.execution_threads} x "
                         f"{backend.intra_op_threads} threads")
        backend.close()

    def feeds(self, batch: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(0)
        sizes = DIM_SIZES.get(self.model, {})
        out: dict[str, np.ndarray] = {}
        for value in self.wide.get_inputs():
            shape = [batch if i == 0 else (d if isinstance(d, int) else sizes.get(str(d).lower(), 1))
                     for i, d in enumerate(value.shape)]
            dtype = _DTYPES[value.type]
            if np.issubdtype(dtype, np.integer):
                out[value.name] = rng.integers(0, 100, size=shape).astype(dtype)
            else:
                out[value.name] = rng.standard_normal(shape).astype(dtype)
        return out

    def level(self, batch: int, layout: str, duration_s: float) -> dict[str, Any]:
        """Runs at ``batch`` rows for ``duration_s`` (after one untimed run per session)."""
        feeds = self.feeds(max(1, batch))
        sessions = [self.wide] if layout == "wide" else self.narrow
        times: list[list[float]] = [[] for _ in sessions]
        for session in sessions:
            session.run(None, feeds)
        deadline = [0.0]

        def begin() -> None:
            deadline[0] = time.perf_counter() + duration_s

        start = threading.Barrier(len(sessions), action=begin)

        def loop(session: ort.InferenceSession, out: list[float]) -> None:
            start.wait()
            while (t0 := time.perf_counter()) < deadline[0]:
                session.run(None, feeds)
                out.append(time.perf_counter() - t0)

        threads = [threading.Thread(target=loop, args=(s, t)) for s, t in zip(sessions, times)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - (deadline[0] - duration_s)
        runs = sorted(x for ts in times for x in ts)
        return {"rps": len(runs) * max(1, batch) / elapsed, "p50_ms": runs[len(runs) // 2] * 1000.0,
                "p99_ms": runs[min(len(runs) - 1, int(len(runs) * 0.99))] * 1000.0, "errors": 0,
                "avg_batch": float(max(1, batch))}
