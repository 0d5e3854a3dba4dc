"""Transfer rates of large requests: through the gateway against straight to the worker.

Starts one simulated-accelerator worker (``--backend sim``: it runs no model,
so the time measured is moving and decoding the request) and a gateway in
front of it, then sends, one at a time:

* a 256 MiB FP32 tensor (raw / binary contents), and
* a 50 MiB BYTES tensor (51,200 elements of 1 KiB),

straight to the worker over gRPC, and through the gateway over gRPC and over
HTTP (binary tensor extension). The answers are one float, so the rate is the
request's bytes over the round trip (median of ``--repeat`` runs), in MB/s
(10^6 bytes per second). While the large requests run, the gateway's cluster
view is polled: the worker must stay ``ready`` (its probes are not starved).

Run: ``python bench/transfer_rates.py [--repeat 3]``. Client and servers
share the machine, so read the numbers as ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.harness import start, start_worker, worker_url  # noqa: E402

MIB = 2**20
CONFIGS = {
    "blob": 'name: "blob"\nbackend: "onnxruntime"\nmax_batch_size: 0\n'
            'input [ { name: "RAW" data_type: TYPE_FP32 dims: [ -1 ] } ]\n'
            'output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]\n',
    "texts": 'name: "texts"\nbackend: "onnxruntime"\nmax_batch_size: 0\n'
             'input [ { name: "TEXT" data_type: TYPE_STRING dims: [ -1 ] } ]\n'
             'output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]\n',
}


def repository(root: Path) -> Path:
    for name, config in CONFIGS.items():
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(config)
    return root


def payloads() -> dict[str, tuple[str, str, np.ndarray, int]]:
    raw = np.ones(256 * MIB // 4, dtype=np.float32)
    texts = np.array([b"x" * 1024] * (50 * MIB // 1024), dtype=np.object_)
    return {
        "256 MiB FP32 raw": ("blob", "RAW", raw, raw.nbytes),
        "50 MiB BYTES": ("texts", "TEXT", texts, 50 * MIB),
    }


def timed(send, repeat: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        send()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="transfer-"))
    config = workdir / "gateway.yaml"
    config.write_text(f"max_request_bytes: {1024 * MIB}\nprobe:\n  interval_s: 0.5\ndefault_timeout_s: 120\n")
    worker = start_worker(repository(workdir / "models"), "--backend", "sim", "--sim-latency-ms", "0")
    gateway = start(["gateway", "--worker", worker_url(worker), "--http-port", "0", "--grpc-port", "0",
                     "--config", str(config), "--log-level", "WARNING"])
    states: set[str] = set()
    stop = threading.Event()

    def watch() -> None:  # the worker's state as the gateway sees it, while the transfers run
        url = f"http://127.0.0.1:{gateway.ready['http_port']}/v2/cluster"
        while not stop.is_set():
            with urllib.request.urlopen(url, timeout=30) as response:
                states.update(w["state"] for w in json.load(response)["workers"])
            stop.wait(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    rows = []
    try:
        direct = grpcclient.InferenceServerClient(worker_url(worker))
        via_grpc = grpcclient.InferenceServerClient(f"127.0.0.1:{gateway.ready['grpc_port']}")
        via_http = httpclient.InferenceServerClient(f"127.0.0.1:{gateway.ready['http_port']}", network_timeout=300,
                                                    connection_timeout=300)
        for label, (model, name, array, size) in payloads().items():
            datatype = "BYTES" if array.dtype == np.object_ else "FP32"
            g_input = grpcclient.InferInput(name, list(array.shape), datatype)
            g_input.set_data_from_numpy(array)
            h_input = httpclient.InferInput(name, list(array.shape), datatype)
            h_input.set_data_from_numpy(array, binary_data=True)
            rates = {
                "worker gRPC (direct)": timed(lambda: direct.infer(model, [g_input]), args.repeat),
                "gateway gRPC": timed(lambda: via_grpc.infer(model, [g_input]), args.repeat),
                "gateway HTTP": timed(lambda: via_http.infer(model, [h_input]), args.repeat),
            }
            base = size / rates["worker gRPC (direct)"] / 1e6
            for target, seconds in rates.items():
                mbps = size / seconds / 1e6
                rows.append((label, target, seconds, mbps, mbps / base))
    finally:
        stop.set()
        watcher.join(timeout=60)
        gateway.stop()
        worker.stop()
    print(f"{'request':<18} {'target':<22} {'median s':>9} {'MB/s':>8} {'vs direct':>9}")
    for label, target, seconds, mbps, ratio in rows:
        print(f"{label:<18} {target:<22} {seconds:>9.3f} {mbps:>8.0f} {ratio:>9.2f}")
    print(f"worker states seen by the gateway during the transfers: {sorted(states)}")
    return 0 if states == {"ready"} else 1


if __name__ == "__main__":
    raise SystemExit(main())
