"""What placement reads from the registered workers' reports: each worker's
memory capacity, each model's size, and the use the workers observe.

- capacity: ``worker_memory_cap_bytes``, or ``worker_memory_fraction`` of the
  device memory a worker reports (its GPUs', else its host's), whichever is
  smaller; None (unbounded) for a worker that reports nothing and no cap;
- size of a model: its configured ``memory_bytes``, else the largest size a
  worker reports for it (measured after load on a GPU, else its files), else
  the last size seen (kept after it unloads), else the size of its latest
  version's files in ``model_repository``, else ``default_model_memory_bytes``;
- observed use: inferences per second summed over the workers, and the most
  recent inference any of them ran (so every gateway sees all the traffic).
"""

from __future__ import annotations

import time
from collections.abc import Container, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.fleet.demand import Observed
from gateway.settings import PlacementSettings

if TYPE_CHECKING:
    from gateway.fleet.registry import WorkerReport

Reports = Mapping[str, "WorkerReport"]


class ModelMemory:
    """Workers' room and models' sizes, from the ``placement`` settings, the ``models`` entries
    (``memory_bytes``) and the model repository's files."""

    def __init__(self, settings: PlacementSettings, models: Mapping[str, Mapping[str, Any]],
                 model_repository: str = "") -> None:
        self._settings = settings
        self._models = models
        self._model_repository = model_repository
        self._sizes: dict[str, int] = {}
        self._repo_sizes: dict[str, int] = {}

    def capacity(self, address: str, reports: Reports) -> int | None:
        limits = []
        if self._settings.worker_memory_cap_bytes:
            limits.append(self._settings.worker_memory_cap_bytes)
        report = reports.get(address)
        if report is not None and report.memory_total_bytes:
            limits.append(int(report.memory_total_bytes * self._settings.worker_memory_fraction))
        return min(limits) if limits else None

    @staticmethod
    def reserved(address: str, reports: Reports, managed: Container[str]) -> int:
        """Memory the worker reports for models placement does not manage."""
        report = reports.get(address)
        if report is None:
            return 0
        return sum(m.memory_bytes for name, m in report.models.items() if name not in managed)

    def size(self, name: str, reports: Reports) -> int:
        configured = self._models.get(name, {}).get("memory_bytes")
        if configured is not None:
            return int(configured)
        reported = max((r.models[name].memory_bytes for r in reports.values() if name in r.models), default=0)
        if reported:
            self._sizes[name] = reported
            return reported
        return self._sizes.get(name) or self._repository_size(name) or self._settings.default_model_memory_bytes

    def _repository_size(self, name: str) -> int:
        """Bytes of the files of the model's latest version in the model repository (0 = unknown); cached."""
        if name in self._repo_sizes or not self._model_repository:
            return self._repo_sizes.get(name, 0)
        size = 0
        model_dir = Path(self._model_repository) / name
        try:
            versions = [p for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit()]
            if versions:
                latest = max(versions, key=lambda p: int(p.name))
                size = sum(f.stat().st_size for f in latest.rglob("*") if f.is_file())
        except OSError:
            size = 0
        self._repo_sizes[name] = size
        return size


def observed(reports: Reports, now: float) -> dict[str, Observed]:
    """Per model: the workers' summed inference rate and latest use, on the monotonic clock ``now`` is on."""
    wall = time.time()
    rates: dict[str, float] = {}
    last: dict[str, float] = {}
    for report in reports.values():
        for name, m in report.models.items():
            rates[name] = rates.get(name, 0.0) + m.rows_per_s
            if m.last_inference_ms > 0:
                used = now - max(0.0, wall - m.last_inference_ms / 1000)
                last[name] = max(last.get(name, used), used)
    return {n: Observed(rates.get(n, 0.0), last.get(n)) for n in set(rates) | set(last)}
