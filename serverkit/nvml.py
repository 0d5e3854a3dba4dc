"""NVML, NVIDIA's management library (the ``nvidia-ml-py`` package, imported
as ``pynvml``), held open for as long as its owner needs it.

Where the package, the library or the driver is missing, NVML is simply
absent: that is a machine without a GPU, not an error, so it is logged at
debug level only and asked once. ``nvmlInit`` counts its callers, so every
owner opens and shuts down its own :class:`Nvml`.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


class Nvml:
    """The ``pynvml`` module once initialised, or None where NVML cannot answer."""

    def __init__(self, purpose: str) -> None:
        self._purpose = purpose  # said in the debug line when NVML is absent, e.g. "GPU metrics"
        self._module: Any = None
        self._tried = False

    def get(self) -> Any:
        """``pynvml`` ready for calls; None without NVML (tried on the first call only)."""
        if self._tried:
            return self._module
        self._tried = True
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception as e:  # noqa: BLE001 - no package, no library, no driver: all mean "no GPU"
            log.debug("no %s: %s", self._purpose, e)
            return None
        self._module = pynvml
        return pynvml

    def close(self) -> None:
        module, self._module = self._module, None
        if module is not None:
            try:
                module.nvmlShutdown()
            except module.NVMLError:
                pass
