"""Per-model statistics of the gateway, in Triton's statistics shape.

``inference_count`` counts rows and ``execution_count`` counts batches sent to
workers, as Triton counts them, so batching shows through the standard
statistics API: many inferences, few executions. Durations are nanoseconds.
Only the event loop touches these counters, so no locks.

An ensemble counts as Triton counts one: each request one execution, its
queue and compute the sums of its steps' (``record_ensemble``). Beyond
Triton, the gateway keeps each step's share of an ensemble's work (the step
requests that ensemble made: rows, requests, successes, failures, queue and
compute); asked for one ensemble's statistics, it lists them after the
ensemble's own entry, one entry per step in step order, under the step
model's name and version (``add_step_entries``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from tritonclient.grpc import service_pb2

from gateway.ensembles.runner import StepRun


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
        # (ensemble, version) -> step index -> that step's share of the ensemble's work.
        self._steps: dict[tuple[str, str], dict[int, ModelCounters]] = {}

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

    def record_ensemble(self, name: str, version: str, rows: int, runs: Sequence[StepRun]) -> int:
        """An ensemble request's steps (and, when all ran, its execution); returns its queue time (ns)."""
        shares = self._steps.setdefault((name, version), {})
        for run in runs:
            share = shares.get(run.step.index)
            if share is None:
                share = shares[run.step.index] = ModelCounters(run.step.model, run.version or run.step.version)
            share.version = run.version or share.version
            if run.error:
                share.fail.add(run.total_ns)
                continue
            share.inference_count += run.rows
            share.execution_count += 1
            share.success.add(run.total_ns)
            share.queue.add(run.queue_ns)
            share.compute.add(run.compute_ns)
            share.last_inference_ms = int(time.time() * 1000)
        if any(run.error for run in runs):
            return 0
        # As Triton does for an ensemble: one execution, compute the sum of its steps'.
        self.record_execution(name, version, rows, sum(run.compute_ns for run in runs))
        return sum(run.queue_ns for run in runs)

    def add_step_entries(self, response: service_pb2.ModelStatisticsResponse,
                         steps: Sequence[tuple[int, str, str]]) -> None:
        """After the entry of each ensemble version in ``response``, its steps' shares.

        ``steps``: (index, model, version) of the ensemble's steps in order; a
        step with no share yet shows zeros under its configured version.
        """
        entries = list(response.model_stats)
        del response.model_stats[:]
        for entry in entries:
            response.model_stats.add().CopyFrom(entry)
            shares = self._steps.get((entry.name, entry.version), {})
            for index, model, version in steps:
                share = shares.get(index) or ModelCounters(model, version)
                _fill(response.model_stats.add(), share)

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
            _fill(response.model_stats.add(), c)
        return response


def _fill(s: service_pb2.ModelStatistics, c: ModelCounters) -> None:
    s.name, s.version = c.name, c.version
    s.last_inference, s.inference_count, s.execution_count = c.last_inference_ms, c.inference_count, c.execution_count
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
