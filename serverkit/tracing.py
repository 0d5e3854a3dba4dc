"""Tracing plumbing both servers share: Triton's ``--trace-config`` entries,
the process's OpenTelemetry exporter, and W3C ``traceparent`` propagation.

``TraceConfig.parse`` reads Triton's flag syntax (``level=TIMESTAMPS``,
``rate=100``, ``count=-1``, ``mode=triton|opentelemetry``,
``triton,file=PATH``, ``triton,log-frequency=N``,
``opentelemetry,url=http://HOST:4318/v1/traces``,
``opentelemetry,resource=KEY=VALUE``, ``opentelemetry,bsp_schedule_delay=MS``).

In ``opentelemetry`` mode :func:`install` sets up one tracer provider for
the process (OTLP over HTTP, a batch span processor); :data:`tracer` is
``None`` until then, and that one check is all an untraced call pays.
:func:`shutdown` flushes what is left. The gateway decides which requests
are traced (its trace settings) and samples every one it starts; a worker
records a span only under a sampled parent context from the caller.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterable, Iterator, Mapping, MutableSequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)

LEVELS = ("OFF", "TIMESTAMPS", "TENSORS")
MODES = ("triton", "opentelemetry")
DEFAULT_URL = "http://localhost:4318/v1/traces"
# At shutdown: how long to try sending the buffered spans (an unreachable
# collector must not hold a stopping server for the exporter's retries).
FLUSH_TIMEOUT_S = 2.0

# The process's tracer once install() ran in opentelemetry mode; None otherwise.
tracer: trace.Tracer | None = None
_processor: Any = None
_propagator = TraceContextTextMapPropagator()


@dataclass(frozen=True, slots=True)
class TraceConfig:
    """The start-up trace settings (Triton's defaults: OFF, rate 1000, unlimited count)."""

    level: tuple[str, ...] = ("OFF",)
    rate: int = 1000
    count: int = -1
    mode: str = "triton"
    file: str = ""
    log_frequency: int = 0
    url: str = DEFAULT_URL
    resource: Mapping[str, str] = field(default_factory=dict)
    bsp_schedule_delay_ms: int | None = None
    entries: tuple[str, ...] = ()  # as given, to hand on to workers

    @classmethod
    def parse(cls, entries: Iterable[str]) -> TraceConfig:
        """Triton's ``--trace-config`` entries, later ones winning; ValueError says which entry is wrong."""
        values: dict[str, Any] = {"resource": {}}
        given = tuple(entries)
        for entry in given:
            head, comma, tail = entry.partition(",")
            section, setting = (head.strip(), tail) if comma and "=" not in head else ("", entry)
            key, sep, value = setting.partition("=")
            key = key.strip().replace("_", "-")
            if not sep or not key:
                raise ValueError(f"--trace-config {entry!r}: expected [MODE,]SETTING=VALUE")
            if section not in ("", *MODES):
                raise ValueError(f"--trace-config {entry!r}: unknown trace mode {section!r}; expected triton or opentelemetry")
            try:
                _apply(values, section, key, value.strip())
            except ValueError as e:
                raise ValueError(f"--trace-config {entry!r}: {e}") from None
        values["entries"] = given
        return cls(**values)

    def worker_entries(self) -> list[str]:
        """What a worker needs to export to the same endpoint: the mode and the OpenTelemetry entries."""
        if self.mode != "opentelemetry":
            return []
        return [e for e in self.entries if e.startswith("mode=") or e.startswith("opentelemetry,")]


def _int(value: str, what: str, minimum: int) -> int:
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"{what} must be an integer, got {value!r}") from None
    if number < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {number}")
    return number


def _apply(values: dict[str, Any], section: str, key: str, value: str) -> None:
    if section in ("", "triton") and key == "file":
        values["file"] = value
    elif section in ("", "triton") and key == "log-frequency":
        values["log_frequency"] = _int(value, "log-frequency", 0)
    elif section == "opentelemetry" and key == "url":
        values["url"] = value if "://" in value else f"http://{value}"
    elif section == "opentelemetry" and key == "resource":
        name, sep, val = value.partition("=")
        if not sep:
            raise ValueError("resource must be KEY=VALUE")
        values["resource"][name] = val
    elif section == "opentelemetry" and key == "bsp-schedule-delay":
        values["bsp_schedule_delay_ms"] = _int(value, "bsp_schedule_delay", 1)
    elif section:
        raise ValueError(f"unknown setting {key!r} for trace mode {section}")
    elif key == "level":
        level = value.upper()
        if level not in LEVELS:
            raise ValueError(f"level must be OFF, TIMESTAMPS or TENSORS, got {value!r}")
        values["level"] = (level,)
    elif key == "rate":
        values["rate"] = _int(value, "rate", 1)
    elif key == "count":
        values["count"] = _int(value, "count", -1)
    elif key == "mode":
        if value not in MODES:
            raise ValueError(f"mode must be triton or opentelemetry, got {value!r}")
        values["mode"] = value
    else:
        raise ValueError(f"unknown setting {key!r}; expected level, rate, count, mode, file, log-frequency")


def install(service_name: str, config: TraceConfig, *, parent_based: bool = False) -> None:
    """Export this process's spans to ``config.url`` (opentelemetry mode only; a no-op otherwise).

    ``parent_based``: record a span only under a sampled parent (a worker);
    otherwise every span started is recorded (the gateway samples by its settings).
    """
    global tracer, _processor
    if config.mode != "opentelemetry":
        return
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased

    resource = Resource.create({"service.name": service_name, **config.resource})
    sampler = ParentBased(ALWAYS_OFF) if parent_based else ALWAYS_ON
    # No exit hook of its own: shutdown() flushes within a bound (the SDK's hook waits up to 30 s).
    provider = TracerProvider(resource=resource, sampler=sampler, shutdown_on_exit=False)
    _processor = BatchSpanProcessor(OTLPSpanExporter(endpoint=config.url), schedule_delay_millis=config.bsp_schedule_delay_ms)
    provider.add_span_processor(_processor)
    tracer = provider.get_tracer("infergate")
    log.info("tracing: OpenTelemetry spans of %s go to %s", service_name, config.url)


def shutdown() -> None:
    """Send the spans still buffered and stop the exporter, each within its bound."""
    global tracer, _processor
    processor, tracer, _processor = _processor, None, None
    if processor is None:
        return
    # The SDK's flush exports in the calling thread for as long as the exporter
    # retries (about 10 s) whatever its timeout says: bound it from outside.
    flush = threading.Thread(target=processor.force_flush, name="trace-flush", daemon=True)
    flush.start()
    flush.join(FLUSH_TIMEOUT_S)
    if flush.is_alive():  # both threads are daemons: they end with the process
        log.warning("tracing: spans not sent within %.0f s are dropped (is the collector reachable?)", FLUSH_TIMEOUT_S)
    else:
        processor.shutdown()


def inject(metadata: MutableSequence[tuple[str, str]]) -> None:
    """Append the current span's ``traceparent`` (and ``tracestate``) as gRPC metadata."""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier)
    metadata.extend(carrier.items())


def extract(carrier: Mapping[str, str] | Iterable[tuple[str, str]]) -> Any:
    """The parent context in ``carrier`` (HTTP headers or gRPC metadata); empty when there is none."""
    if not isinstance(carrier, Mapping):
        carrier = {k: v for k, v in carrier if isinstance(v, str)}
    return _propagator.extract(carrier)


@contextlib.contextmanager
def client_span(name: str, attributes: Mapping[str, Any]) -> Iterator[list[tuple[str, str]] | None]:
    """A client span under the current one, when a span is recording; yields the metadata that carries it on."""
    if tracer is None or not trace.get_current_span().is_recording():
        yield None
        return
    with tracer.start_as_current_span(name, kind=trace.SpanKind.CLIENT, attributes=dict(attributes)):
        metadata: list[tuple[str, str]] = []
        inject(metadata)
        yield metadata


@contextlib.contextmanager
def server_span(name: str, carrier: Iterable[tuple[str, str]], attributes: Mapping[str, Any]) -> Iterator[None]:
    """A server span whose parent is the caller's ``traceparent``; nothing when the call carries none."""
    parent = extract(carrier)
    if tracer is None or not trace.get_current_span(parent).get_span_context().is_valid:
        yield
        return
    with tracer.start_as_current_span(name, context=parent, kind=trace.SpanKind.SERVER, attributes=dict(attributes)):
        yield
