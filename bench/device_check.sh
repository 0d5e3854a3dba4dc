#!/usr/bin/env bash
# One prepared check for a bigger machine: many cores and, if present, an
# NVIDIA GPU. At most BUDGET_S seconds (default 480) in all; every step gets
# what is left of it, up to its own limit, and a step that cannot run here
# (no GPU, no driver) says so and is skipped. One results file:
# $OUT/results.md (OUT defaults to bench/device_check_out), each step's full
# log beside it.
#
#   bench/device_check.sh            # everything (about 8 minutes)
#   QUICK=1 bench/device_check.sh    # short windows: checks the script itself
#
# Steps: the machine; the CUDA execution provider against the CPU one on the
# example cnn (same outputs, time per batch); Triton's CUDA shared-memory
# extension through `infergate up` (tests/gpu); NVML metrics on a worker's
# /metrics; the compute-bound ratio (cnn_large through the gateway against
# in-process ONNX Runtime, 8-64 clients: the suite's compute and ceiling
# sections); 1 against N gateway processes; encoder_large split TP2 against
# unsplit.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/device_check_out}
BUDGET_S=${BUDGET_S:-480}
QUICK=${QUICK:-}
PY=.venv/bin/python
mkdir -p "$OUT"
RESULTS="$OUT/results.md"
START=$(date +%s)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }

# step NAME LIMIT_S COMMAND...: run it within min(LIMIT_S, time left); its
# log goes to $OUT/NAME.log and its last lines to the results file.
step() {
    local name=$1 limit=$2 budget
    shift 2
    budget=$(left)
    [ "$budget" -lt "$limit" ] && limit=$budget
    {
        echo
        echo "## $name"
        echo
    } >> "$RESULTS"
    if [ "$limit" -le 5 ]; then
        echo "skipped: the ${BUDGET_S} s budget is spent" >> "$RESULTS"
        return
    fi
    local t0 rc
    t0=$(date +%s)
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    {
        case $rc in
            0) echo "ran in $(( $(date +%s) - t0 )) s" ;;
            2) echo "skipped (exit 2): $(tail -1 "$OUT/$name.log")" ;;
            124) echo "stopped at its ${limit} s limit" ;;
            *) echo "FAILED with exit $rc after $(( $(date +%s) - t0 )) s" ;;
        esac
        echo
        echo '```'
        tail -n 40 "$OUT/$name.log"
        echo '```'
    } >> "$RESULTS"
}

{
    echo "# infergate device check, $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo
    echo "- cores: $(nproc), memory: $(free -g 2>/dev/null | awk '/^Mem:/ {print $2 " GiB"}')"
    echo "- GPU: $(nvidia-smi -L 2>/dev/null | head -4 | tr '\n' ';' || true)"
    echo "- load average at start: $(cut -d' ' -f1-3 /proc/loadavg)"
} > "$RESULTS"

test -x "$PY" || make install > "$OUT/install.log" 2>&1 || { echo "make install failed: see install.log" >> "$RESULTS"; exit 1; }

step cuda_provider 60 "$PY" - <<'PYEOF'
import shutil, subprocess, sys, time
import numpy as np
import onnxruntime as ort
if shutil.which("nvidia-smi") is None or subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode != 0:
    print("no NVIDIA driver answers here (nvidia-smi)")
    sys.exit(2)
if "CUDAExecutionProvider" not in ort.get_available_providers():
    print("no CUDAExecutionProvider in", ort.get_available_providers())
    sys.exit(2)
path = "models/cnn/1/model.onnx"
x = np.random.default_rng(0).standard_normal((32, 3, 32, 32), dtype=np.float32)
out = {}
for provider in ("CPUExecutionProvider", "CUDAExecutionProvider"):
    session = ort.InferenceSession(path, providers=[provider])
    if session.get_providers()[0] != provider:
        print(provider, "did not load; the session runs on", session.get_providers())
        sys.exit(1)
    name = session.get_inputs()[0].name
    session.run(None, {name: x})
    t0 = time.perf_counter()
    for _ in range(50):
        out[provider] = session.run(None, {name: x})[0]
    print(f"{provider}: {(time.perf_counter() - t0) / 50 * 1e3:.2f} ms per batch of 32")
diff = float(np.max(np.abs(out["CPUExecutionProvider"] - out["CUDAExecutionProvider"])))
print(f"max |CPU - CUDA| = {diff:.2e}")
sys.exit(0 if diff < 1e-3 else 1)
PYEOF

# tests/gpu/run.sh installs the cuda extra into .venv: only where a GPU answers.
if command -v nvidia-smi > /dev/null && nvidia-smi -L > /dev/null 2>&1; then
    step cuda_shared_memory 120 sh tests/gpu/run.sh
else
    step cuda_shared_memory 10 sh -c 'echo "no NVIDIA driver answers here (nvidia-smi)"; exit 2'
fi

step nvml_metrics 60 "$PY" - <<'PYEOF'
import sys, urllib.request
from tests.harness import start_worker
proc = start_worker("models", "--metrics-port", "0")
try:
    text = urllib.request.urlopen(f"http://127.0.0.1:{proc.ready['metrics_port']}/metrics", timeout=10).read().decode()
finally:
    proc.stop()
gpu = [line for line in text.splitlines() if line.startswith("nv_gpu_")]
print("\n".join(gpu[:20]) or "no nv_gpu_ samples")
sys.exit(0 if gpu else 2)
PYEOF

LARGE="$OUT/large-models"
SUITE_ARGS=(--out "$OUT/suite" --only compute,ceiling)
[ -n "$QUICK" ] && SUITE_ARGS+=(--quick)
step compute_bound 240 "$PY" -m loadtest.suite "${SUITE_ARGS[@]}"

PROCS=$(( $(nproc) >= 8 ? 4 : 2 ))
WINDOW=$([ -n "$QUICK" ] && echo 1000 || echo 4000)
step gateway_processes 120 "$PY" bench/gateway_processes.py --processes 1 "$PROCS" --window-ms "$WINDOW"

step build_large 60 .venv/bin/infergate models build "$LARGE" --large
DURATION=$([ -n "$QUICK" ] && echo 1 || echo 5)
step encoder_large_tp2 150 "$PY" bench/parallel_bench.py --model-repository "$LARGE" --large --workers 2 \
    --requests 40 --duration-s "$DURATION"

echo >> "$RESULTS"
echo "total: $(( $(date +%s) - START )) s of a ${BUDGET_S} s budget" >> "$RESULTS"
echo "results: $RESULTS"
