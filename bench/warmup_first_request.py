"""First-request latency of a freshly loaded model, with and without Triton's
``model_warmup``: ``python bench/warmup_first_request.py [--model cnn] [--trials 5]``.

Each trial starts one worker on a copy of the example model (its
``config.pbtxt`` with one random-data ``model_warmup`` sample at batch 1, or
with none),
waits for the ready file, then times the first and the second gRPC request
straight to the worker (batch 1, random data). Prints medians in ms; the
second request is the warm reference. Timings on a shared machine are hints:
read the ratio of first to second within one row.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

ROOT = Path(__file__).resolve().parent.parent
_NP = {mc.TYPE_FP32: np.float32, mc.TYPE_INT64: np.int64, mc.TYPE_INT32: np.int32}


def _repo(model: str, workdir: Path, warmup: bool) -> mc.ModelConfig:
    shutil.copytree(ROOT / "models" / model, workdir / "repo" / model)
    path = workdir / "repo" / model / "config.pbtxt"
    config = text_format.Parse(path.read_text(), mc.ModelConfig())
    del config.model_warmup[:]
    if warmup:  # one random-data sample at batch 1, as the example cnn ships
        sample = config.model_warmup.add(name="random", batch_size=1 if config.max_batch_size > 0 else 0)
        for spec in config.input:
            dims = [d if d > 0 else 32 for d in spec.dims]  # a variable dim (tokens): 32, as requested below
            sample.inputs[spec.name].CopyFrom(mc.ModelWarmup.Input(data_type=spec.data_type, dims=dims,
                                                                    random_data=True))
    path.write_text(text_format.MessageToString(config))
    return config


def _trial(model: str, warmup: bool) -> tuple[float, float, float]:
    """(load-to-ready s, first request ms, second request ms) of one fresh worker."""
    with tempfile.TemporaryDirectory(prefix="warmup-bench-") as tmp:
        workdir = Path(tmp)
        config = _repo(model, workdir, warmup)
        ready = workdir / "ready.json"
        cmd = [sys.executable, "-m", "infergate", "worker", "--model-repository", str(workdir / "repo"),
               "--port", "0", "--ready-file", str(ready), "--log-level", "warning"]
        started = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            while not ready.exists():
                if proc.poll() is not None:
                    raise SystemExit(f"worker exited {proc.returncode}")
                time.sleep(0.02)
            load_s = time.perf_counter() - started
            port = json.loads(ready.read_text())["grpc_port"]
            rng = np.random.default_rng(1)
            inputs = []
            for spec in config.input:
                dims = [d if d > 0 else 32 for d in spec.dims]  # a variable dim (tokens): 32
                shape = [1, *dims] if config.max_batch_size > 0 else dims
                array = (rng.random(shape) * 100).astype(_NP[spec.data_type])
                inp = grpcclient.InferInput(spec.name, shape, grpcclient.np_to_triton_dtype(array.dtype))
                inp.set_data_from_numpy(array)
                inputs.append(inp)
            with grpcclient.InferenceServerClient(f"127.0.0.1:{port}") as client:
                client.is_server_live()  # the channel is up: only the model's cost is timed below
                times = []
                for _ in range(2):
                    t0 = time.perf_counter()
                    client.infer(model, inputs)
                    times.append((time.perf_counter() - t0) * 1000)
            return load_s, times[0], times[1]
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--trials", type=int, default=5)
    args = parser.parse_args()
    print(f"| {args.model} | start to ready s | first request ms | second request ms |")
    print("|:---|---:|---:|---:|")
    for warmup in (False, True):
        runs = [_trial(args.model, warmup) for _ in range(args.trials)]
        med = [statistics.median(r[i] for r in runs) for i in range(3)]
        print(f"| {'with' if warmup else 'without'} model_warmup | {med[0]:.2f} | {med[1]:.2f} | {med[2]:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
