"""Per model-version inference statistics, as Triton reports them in
``ModelStatistics``.

The worker runs each request as one execution (batching happens upstream in
the gateway), so every successful request adds one to ``execution_count``,
its batch size to ``inference_count``, its phase durations to
``inference_stats`` and to the ``batch_stats`` entry of its batch size.
Durations are cumulative nanoseconds with a count, as in Triton:

- ``queue``: from arrival until an instance of the model was free;
- ``compute_input``: decoding the request's tensors;
- ``compute_infer``: the backend's execution;
- ``compute_output``: encoding the outputs into the response;
- ``success``/``fail``: whole request time, split by outcome.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from tritonclient.grpc import service_pb2


@dataclass(slots=True)
class _Duration:
    count: int = 0
    ns: int = 0

    def add(self, ns: int) -> None:
        self.count += 1
        self.ns += ns

    def fill(self, proto: service_pb2.StatisticDuration) -> None:
        proto.count = self.count
        proto.ns = self.ns


@dataclass(slots=True)
class _BatchDurations:
    compute_input: _Duration
    compute_infer: _Duration
    compute_output: _Duration


@dataclass(frozen=True, slots=True)
class ExecutionTiming:
    """Phase durations of one successful request, in nanoseconds."""

    batch_size: int
    queue_ns: int
    compute_input_ns: int
    compute_infer_ns: int
    compute_output_ns: int
    total_ns: int


class ModelStats:
    """Counters of one loaded model version.

    Updated and read only from the event loop thread (the executor threads
    never touch them), so there is no lock.
    """

    def __init__(self) -> None:
        self.last_inference_ms = 0
        self.inference_count = 0
        self.execution_count = 0
        self.success = _Duration()
        self.fail = _Duration()
        self.queue = _Duration()
        self.compute_input = _Duration()
        self.compute_infer = _Duration()
        self.compute_output = _Duration()
        self._batches: dict[int, _BatchDurations] = {}

    def record_success(self, timing: ExecutionTiming) -> None:
        self.last_inference_ms = time.time_ns() // 1_000_000
        self.inference_count += timing.batch_size
        self.execution_count += 1
        self.success.add(timing.total_ns)
        self.queue.add(timing.queue_ns)
        self.compute_input.add(timing.compute_input_ns)
        self.compute_infer.add(timing.compute_infer_ns)
        self.compute_output.add(timing.compute_output_ns)
        batch = self._batches.get(timing.batch_size)
        if batch is None:
            batch = self._batches[timing.batch_size] = _BatchDurations(_Duration(), _Duration(), _Duration())
        batch.compute_input.add(timing.compute_input_ns)
        batch.compute_infer.add(timing.compute_infer_ns)
        batch.compute_output.add(timing.compute_output_ns)

    def record_failure(self, total_ns: int) -> None:
        self.last_inference_ms = time.time_ns() // 1_000_000
        self.fail.add(total_ns)

    def to_proto(self, name: str, version: str) -> service_pb2.ModelStatistics:
        proto = service_pb2.ModelStatistics(
            name=name,
            version=version,
            last_inference=self.last_inference_ms,
            inference_count=self.inference_count,
            execution_count=self.execution_count,
        )
        stats = proto.inference_stats
        self.success.fill(stats.success)
        self.fail.fill(stats.fail)
        self.queue.fill(stats.queue)
        self.compute_input.fill(stats.compute_input)
        self.compute_infer.fill(stats.compute_infer)
        self.compute_output.fill(stats.compute_output)
        for size in sorted(self._batches):
            durations = self._batches[size]
            entry = proto.batch_stats.add(batch_size=size)
            durations.compute_input.fill(entry.compute_input)
            durations.compute_infer.fill(entry.compute_infer)
            durations.compute_output.fill(entry.compute_output)
        return proto
