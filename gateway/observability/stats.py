"""Per-model statistics of the gateway, in Triton's statistics shape.

``inference_count`` counts rows and ``execution_count`` counts batches sent to
workers, as Triton counts them, so batching shows through the standard
statistics API: many inferences, few executions. Durations are nanoseconds.
Only the event loop touches these counters, so no locks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tritonclient.grpc import service_pb2


@dataclass(slots=True)
class _Duration:
    count: int = 0
    ns: int = 0

    def add(self, ns: int, count: int = 1) -> None:
        self.count += count
        self.ns += ns


@dataclass(slots=True)
class ModelCounters:
    name: str
    version: str
    inference_count: int = 0
    execution_count: int = 0
    last_inference_ms: int = 0
    success: _Duration = field(default_factory=_Duration)
    fail: _Duration = field(default_factory=_Duration)
    queue: _Duration = field(default_factory=_Duration)
    compute: _Duration = field(default_factory=_Duration)
    batches: dict[int, _Duration] = field(default_factory=dict)
    failures_by_reason: dict[str, int] = field(default_factory=dict)


class GatewayStats:
    """Counters per (model, version) for the statistics API and metrics."""

    def __init__(self) -> None:
        self._models: dict[tuple[str, str], ModelCounters] = {}

    def model(self, name: str, version: str) -> ModelCounters:
        key = (name, version)
        counters = self._models.get(key)
        if counters is None:
            counters = self._models[key] = ModelCounters(name, version)
        return counters

    def record_success(self, name: str, version: str, rows: int, total_ns: int, queue_ns: int) -> None:
        c = self.model(name, version)
        c.inference_count += rows
        c.success.add(total_ns)
        c.queue.add(queue_ns)
        c.last_inference_ms = int(time.time() * 1000)

    def record_cache_hit(self, name: str, version: str, total_ns: int) -> None:
        """A request answered from the response cache: a success, but no inference (Triton's counts)."""
        c = self.model(name, version)
        c.success.add(total_ns)
        c.last_inference_ms = int(time.time() * 1000)

    def record_failure(self, name: str, version: str, total_ns: int, reason: str) -> None:
        c = self.model(name, version)
        c.fail.add(total_ns)
        c.failures_by_reason[reason] = c.failures_by_reason.get(reason, 0) + 1

    def record_execution(self, name: str, version: str, batch_rows: int, compute_ns: int, requests: int = 1) -> None:
        # As Triton does, inference_stats durations count per request (each
        # request of the batch spent compute_ns in it); batch_stats per batch.
        c = self.model(name, version)
        c.execution_count += 1
        c.compute.add(compute_ns * requests, requests)
        c.batches.setdefault(batch_rows, _Duration()).add(compute_ns)

    def snapshot(self) -> list[ModelCounters]:
        return list(self._models.values())

    def to_proto(self, name: str = "", version: str = "", known: list[tuple[str, str]] | None = None) -> service_pb2.ModelStatisticsResponse:
        """Statistics for one model (or all when ``name`` is empty).

        ``known`` lists (model, version) pairs served now, so models that have
        seen no request yet still appear with zero counts, as in Triton.
        """
        keys = set(self._models)
        for key in known or []:
            keys.add(key)
        response = service_pb2.ModelStatisticsResponse()
        for model_name, model_version in sorted(keys):
            if name and model_name != name:
                continue
            if version and model_version not in (version, ""):
                continue
            c = self._models.get((model_name, model_version)) or ModelCounters(model_name, model_version)
            s = response.model_stats.add(
                name=model_name,
                version=model_version,
                last_inference=c.last_inference_ms,
                inference_count=c.inference_count,
                execution_count=c.execution_count,
            )
            st = s.inference_stats
            st.success.count, st.success.ns = c.success.count, c.success.ns
            st.fail.count, st.fail.ns = c.fail.count, c.fail.ns
            st.queue.count, st.queue.ns = c.queue.count, c.queue.ns
            # The gateway's compute is the round trip to the worker; it has no
            # separate input/output copy phases of its own.
            st.compute_infer.count, st.compute_infer.ns = c.compute.count, c.compute.ns
            for size in sorted(c.batches):
                d = c.batches[size]
                b = s.batch_stats.add(batch_size=size)
                b.compute_infer.count, b.compute_infer.ns = d.count, d.ns
        return response
