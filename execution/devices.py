"""Which accelerators this machine really has.

ONNX Runtime's GPU build lists ``CUDAExecutionProvider`` whether or not a GPU
exists, and creating a CUDA session on a machine without one logs errors and
falls back to the CPU. So before choosing CUDA we ask the CUDA driver itself,
through ``libcuda`` with ctypes: no driver or no device simply means zero,
silently. The driver honours ``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

logger = logging.getLogger(__name__)

_DRIVER_NAMES = ("libcuda.so.1", "libcuda.so", "nvcuda.dll")


@functools.cache
def cuda_device_count() -> int:
    """Number of CUDA devices the driver reports; 0 when there is no driver or device."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return 0
    for name in _DRIVER_NAMES:
        try:
            driver = ctypes.CDLL(name)
        except OSError:
            continue
        try:
            if driver.cuInit(0) != 0:
                return 0
            count = ctypes.c_int(0)
            if driver.cuDeviceGetCount(ctypes.byref(count)) != 0:
                return 0
            return max(0, count.value)
        except AttributeError:  # not a CUDA driver after all
            return 0
    return 0


def cpu_count() -> int:
    """Cores this process may run on (its affinity mask), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)
