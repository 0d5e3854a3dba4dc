"""Request tracing at the gateway: which requests are traced, and what a
trace records, in Triton's two modes.

A frontend wraps each inference in ``tracing.request(req, carrier, protocol)``
and the core wraps each batch's worker call in ``tracing.batch(batch)``.
While tracing is off (the default) both return one shared no-op context
after a single attribute check: no trace object, no span. When the trace
settings (``trace_settings``) take a request:

- ``trace_mode: triton``: Triton's timestamps (``REQUEST_START``,
  ``QUEUE_START``, ``COMPUTE_START``, ``COMPUTE_END``, ``REQUEST_END``, on
  the monotonic clock in ns; COMPUTE is the worker call as the gateway sees
  it) go to ``trace_file`` as Triton's JSON records: every ``log_frequency``
  traces to ``trace_file.<n>``, or all at shutdown to ``trace_file`` when it
  is 0. ``TENSORS`` adds each input's name, datatype and shape.
- ``trace_mode: opentelemetry``: spans through ``serverkit.tracing``'s
  exporter: the request's root span (its parent the client's
  ``traceparent``, when it sent one), children for its queue wait and for
  the batch it joined (the batch span is the child of the first traced
  request in it and links the others); the worker client's call span and the
  worker's compute span follow under the batch span through ``traceparent``.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import orjson
from opentelemetry import context as otel_context
from opentelemetry import trace as otel_trace

from gateway.observability.trace_settings import Sampler, TraceSettings
from gateway.types import InferRequest
from serverkit import tracing as kit

log = logging.getLogger(__name__)

_NULL = contextlib.nullcontext()
_ids = itertools.count(1)
Carrier = Mapping[str, str] | Iterable[tuple[str, str]]


def _epoch_ns(monotonic_s: float) -> int:
    """A past moment of the monotonic clock as the wall-clock ns OpenTelemetry wants."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


class TraceFile:
    """Triton's trace file: JSON arrays of records, rotated every ``log_frequency`` traces."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._pending: list[dict[str, Any]] = []
        self._traces = 0
        self._index = 0

    def add(self, records: list[dict[str, Any]], log_frequency: int) -> None:
        self._pending.extend(records)
        self._traces += 1
        if log_frequency and self._traces >= log_frequency:
            self._write(f"{self.path}.{self._index}")
            self._index += 1

    def close(self, log_frequency: int) -> None:
        if self._pending:
            self._write(f"{self.path}.{self._index}" if log_frequency or self._index else self.path)

    def _write(self, path: str) -> None:
        try:
            Path(path).write_bytes(orjson.dumps(self._pending))
        except OSError as e:
            log.error("cannot write the trace file %s: %s", path, e)
        self._pending, self._traces = [], 0


class RequestTrace:
    """One traced request: its Triton timestamps, or its root span."""

    def __init__(self, owner: RequestTracing, request: InferRequest, sampler: Sampler,
                 carrier: Carrier | Callable[[], Carrier], protocol: str) -> None:
        self.owner = owner
        self.request = request
        self.sampler = sampler
        self.protocol = protocol
        self._carrier = carrier
        self.id = next(_ids)
        self.timestamps: list[tuple[str, int]] = []
        self.span: Any = None
        self.queued = False

    def stamp(self, name: str, ns: int | None = None) -> None:
        self.timestamps.append((name, time.monotonic_ns() if ns is None else ns))

    def __enter__(self) -> RequestTrace:
        r = self.request
        if kit.tracer is None:
            self.stamp("REQUEST_START")
            return self
        carrier = self._carrier() if callable(self._carrier) else self._carrier
        attributes: dict[str, Any] = {"infergate.model": r.model, "infergate.request_id": r.id,
                                      "rpc.system": self.protocol.lower()}
        if "TENSORS" in self.sampler.level:
            for t in r.inputs:
                attributes[f"infergate.input.{t.name}"] = f"{t.datatype}{list(t.shape)}"
        self.span = kit.tracer.start_span(f"{self.protocol} infer {r.model}", context=kit.extract(carrier),
                                          kind=otel_trace.SpanKind.SERVER, attributes=attributes)
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if self.span is not None:
            if exc is not None:
                self.span.set_status(otel_trace.Status(otel_trace.StatusCode.ERROR, str(exc)[:200]))
            self.span.set_attribute("infergate.model_version", self.request.version)
            self.span.end()
            return
        self.stamp("REQUEST_END")
        self.owner.write(self)

    def records(self) -> list[dict[str, Any]]:
        r = self.request
        version = int(r.version) if r.version.isdigit() else -1
        out: list[dict[str, Any]] = [
            {"id": self.id, "model_name": r.model, "model_version": version, "request_id": r.id},
            {"id": self.id, "timestamps": [{"name": name, "ns": ns} for name, ns in self.timestamps]},
        ]
        if "TENSORS" in self.sampler.level:
            out += [{"id": self.id, "activity": "TENSOR_QUEUE_INPUT",
                     "tensor": {"name": t.name, "dtype": t.datatype, "shape": list(t.shape)}} for t in r.inputs]
        return out

    def enter_batch(self, now_s: float) -> None:
        """The request leaves its queue for a batch at ``now_s`` (monotonic)."""
        if self.queued:
            return  # a refused batch reruns its requests alone: the wait was recorded once
        self.queued = True
        arrival = self.request.arrival or now_s
        if self.span is None:
            self.stamp("QUEUE_START", int(arrival * 1e9))
            return
        assert kit.tracer is not None
        parent = otel_trace.set_span_in_context(self.span)
        queue = kit.tracer.start_span("queue", context=parent, start_time=_epoch_ns(arrival))
        queue.end(end_time=_epoch_ns(now_s))


class BatchTrace:
    """The traced requests of one batch around its worker call: COMPUTE timestamps, or the batch span."""

    def __init__(self, traces: list[RequestTrace], size: int, model: str) -> None:
        self._traces = traces
        self._size = size
        self._model = model
        self._span: Any = None
        self._token: Any = None

    def __enter__(self) -> BatchTrace:
        now = time.monotonic()
        for t in self._traces:
            t.enter_batch(now)
        first = self._traces[0]
        if first.span is None or kit.tracer is None:
            for t in self._traces:
                t.stamp("COMPUTE_START")
            return self
        links = [otel_trace.Link(t.span.get_span_context()) for t in self._traces[1:]]
        self._span = kit.tracer.start_span(
            f"batch {self._model}", context=otel_trace.set_span_in_context(first.span), links=links,
            attributes={"infergate.batch.requests": self._size, "infergate.model": self._model})
        # The worker client's span, and the traceparent it sends, come from the current context.
        self._token = otel_context.attach(otel_trace.set_span_in_context(self._span))
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if self._span is None:
            for t in self._traces:
                t.stamp("COMPUTE_END")
            return
        otel_context.detach(self._token)
        if exc is not None:
            self._span.set_status(otel_trace.Status(otel_trace.StatusCode.ERROR, str(exc)[:200]))
        self._span.end()


class RequestTracing:
    """What the frontends and the core call; ``settings`` is what the trace extension reads and updates."""

    def __init__(self, settings: TraceSettings, *, process_index: int | None = None) -> None:
        self.settings = settings
        self._file = TraceFile(settings.file) if settings.mode == "triton" and settings.file else None
        if self._file is not None and process_index is not None:
            # Among several gateway processes: this one's Triton trace files get ``.process<index>`` after the name.
            self._file.path = f"{self._file.path}.process{process_index}"

    @classmethod
    def off(cls) -> RequestTracing:
        """Tracing that takes nothing (Triton's defaults), for a frontend built without the core's."""
        return cls(TraceSettings(kit.TraceConfig()))

    def request(self, request: InferRequest, carrier: Carrier | Callable[[], Carrier],
                protocol: str) -> contextlib.AbstractContextManager[Any]:
        """The context of one inference at a frontend: a trace when the settings take it, else a no-op."""
        if not self.settings.active:
            return _NULL
        sampler = self.settings.sample(request.model)
        if sampler is None:
            return _NULL
        if self.settings.mode == "opentelemetry" and kit.tracer is None:
            return _NULL  # no exporter in this process (e.g. an embedded gateway)
        trace = RequestTrace(self, request, sampler, carrier, protocol)
        request.trace = trace
        return trace

    def batch(self, batch: list[InferRequest], model: str) -> contextlib.AbstractContextManager[Any]:
        """The context of one batch's worker call; a no-op unless a request in it is traced."""
        if not self.settings.active:
            return _NULL
        traces = [r.trace for r in batch if r.trace is not None]
        return BatchTrace(traces, len(batch), model) if traces else _NULL

    def write(self, trace: RequestTrace) -> None:
        if self._file is not None:
            self._file.add(trace.records(), trace.sampler.log_frequency)

    def close(self) -> None:
        """Write what the trace file still holds (at shutdown)."""
        if self._file is not None:
            self._file.close(self.settings.sampler("").log_frequency)
