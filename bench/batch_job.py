"""Offline batch job throughput and memory: ``infergate batch`` over 1M ``mlp`` rows.

For each worker count (default 1 and 2) starts ``infergate up --workers N``,
streams the same ``.npy`` input (1,000,000 x 64 fp32, 244 MiB) through the
gateway into a ``.npy`` output, and reports rows/s and the job process's
peak resident memory (``ru_maxrss`` of that child alone, from ``wait4``).
The output's first and last rows are checked against ONNX Runtime run
directly on the model.

Run: ``python bench/batch_job.py [--rows 1000000] [--workers 1,2] [--format npy]
[--json out.json]``. Everything runs on one machine: the job competes with
the gateway and workers for cores, so read the numbers as ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from models.build import build_repository  # noqa: E402

WRITE_ROWS = 65536


def make_input(path: Path, rows: int) -> None:
    """Random fp32 rows, written a block at a time (this process stays small too)."""
    rng = np.random.default_rng(0)
    with open(path, "wb") as f:
        header = {"descr": np.lib.format.dtype_to_descr(np.dtype(np.float32)), "fortran_order": False,
                  "shape": (rows, 64)}
        np.lib.format.write_array_header_2_0(f, header)
        for start in range(0, rows, WRITE_ROWS):
            f.write(rng.standard_normal((min(WRITE_ROWS, rows - start), 64), dtype=np.float32).tobytes())


def start_cluster(repo: Path, workers: int, workdir: Path) -> tuple[subprocess.Popen[bytes], dict]:
    ready = workdir / f"up{workers}.json"
    log = open(workdir / f"up{workers}.log", "wb")
    cmd = [sys.executable, "-m", "infergate", "up", "--workers", str(workers), "--model-repository", str(repo),
           "--http-port", "0", "--grpc-port", "0", "--ready-file", str(ready), "--log-level", "WARNING"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    deadline = time.monotonic() + 120
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"infergate up did not start; see {workdir / f'up{workers}.log'}")
        time.sleep(0.05)  # polling the ready file
    return proc, json.loads(ready.read_text())


def stop_cluster(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_job(url: str, inp: Path, out: Path, extra: list[str]) -> dict:
    report = out.with_name(out.name + ".report.json")
    cmd = [sys.executable, "-m", "infergate", "batch", "-m", "mlp", "-i", str(inp), "-o", str(out), "-u", url,
           "--no-progress", "--overwrite", "--report", str(report), *extra]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE)
    assert proc.stderr is not None
    stderr = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall_s = time.monotonic() - started
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"batch job failed ({proc.returncode}):\n{stderr.decode(errors='replace')}")
    summary = json.loads(report.read_text())
    return {**summary, "wall_s": wall_s, "peak_rss_mib": usage.ru_maxrss / 1024}


def check_output(repo: Path, inp: Path, out: Path, fmt: str) -> float:
    import onnxruntime as ort

    x = np.load(inp, mmap_mode="r")
    session = ort.InferenceSession(str(repo / "mlp" / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    if fmt == "npy":
        y = np.load(out, mmap_mode="r")
        rows = np.r_[0:1000, len(x) - 1000:len(x)]
        got = np.asarray(y[rows])
    else:
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(out)
        first = pf.read_row_group(0).column("OUTPUT").to_pylist()[:1000]
        rows, got = np.arange(1000), np.asarray(first, dtype=np.float32)
    (expected,) = session.run(None, {"INPUT": np.asarray(x[rows])})
    return float(np.abs(got - expected).max())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--workers", default="1,2", help="comma-separated worker counts (default 1,2)")
    parser.add_argument("--format", choices=["npy", "parquet"], default="npy", help="output format")
    parser.add_argument("--batch-size", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: a temporary one)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args()

    workdir = args.dir or Path(tempfile.mkdtemp(prefix="infergate-batch-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    repo = workdir / "models"
    build_repository(repo)
    inp = workdir / "in.npy"
    make_input(inp, args.rows)
    extra = ["--concurrency", str(args.concurrency)]
    if args.batch_size:
        extra += ["--batch-size", str(args.batch_size)]

    results = []
    for workers in (int(w) for w in args.workers.split(",")):
        proc, ready = start_cluster(repo, workers, workdir)
        try:
            out = workdir / f"out{workers}.{args.format}"
            result = run_job(f"127.0.0.1:{ready['grpc_port']}", inp, out, extra)
            result["max_abs_error"] = check_output(repo, inp, out, args.format)
            result["workers"] = workers
            result["output_mib"] = out.stat().st_size / 2**20
            results.append(result)
            out.unlink()
        finally:
            stop_cluster(proc)

    input_mib = inp.stat().st_size / 2**20
    print(f"\n`infergate batch` mlp, {args.rows:,} rows, input {input_mib:.0f} MiB .npy -> {args.format}, "
          f"concurrency {args.concurrency}, {os.cpu_count()} cores shared by job, gateway and workers\n")
    print("| workers | seconds | rows/s | peak RSS of the job (MiB) | output (MiB) | max abs error |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['workers']} | {r['seconds']:.1f} | {r['rows_per_s']:,.0f} | {r['peak_rss_mib']:.0f} "
              f"| {r['output_mib']:.0f} | {r['max_abs_error']:.1e} |")
    if args.json:
        args.json.write_text(json.dumps({"rows": args.rows, "input_mib": input_mib, "results": results}, indent=2))
    inp.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
