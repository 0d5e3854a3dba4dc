#!/usr/bin/env sh
# The GPU checks of Triton's CUDA shared-memory extension, in one command, on a
# host with an NVIDIA GPU and driver:   tests/gpu/run.sh [pytest args]
#
# Installs the project with its `cuda` extra into .venv, pinning cuda-python
# to 12.x: tritonclient's CUDA shared-memory utilities, the client these tests
# drive unchanged, import `cuda.cudart`, which cuda-python 13 removed. Refuses
# to run (exit 2) where no GPU is found, rather than reporting skips as a pass.
set -eu
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python3}
test -x .venv/bin/python || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet -e '.[dev,cuda]' 'cuda-python>=12.6,<13' --config-settings editable_mode=compat
.venv/bin/python -c '
import sys
from tests.gpu.test_cuda_shared_memory import _WHY_NOT
if _WHY_NOT is not None:
    sys.exit(f"tests/gpu: no usable GPU here: {_WHY_NOT}")
' || exit 2
exec .venv/bin/python -m pytest -q -rs -p no:cacheprovider tests/gpu "$@"
