"""Triton's --trace-config entries as serverkit.tracing reads them, and the
traceparent round trip between a client span and a server span."""

from __future__ import annotations

import pytest

from serverkit import tracing
from serverkit.tracing import TraceConfig


def test_defaults_are_tritons() -> None:
    config = TraceConfig.parse([])
    assert (config.level, config.rate, config.count, config.mode, config.file, config.log_frequency) == (
        ("OFF",), 1000, -1, "triton", "", 0)


def test_entries_in_tritons_syntax() -> None:
    config = TraceConfig.parse([
        "level=TIMESTAMPS", "rate=10", "count=5", "mode=opentelemetry", "triton,file=/tmp/t.json",
        "triton,log-frequency=50", "opentelemetry,url=collector:4318/v1/traces",
        "opentelemetry,resource=service.name=edge", "opentelemetry,bsp_schedule_delay=200",
    ])
    assert (config.level, config.rate, config.count, config.mode) == (("TIMESTAMPS",), 10, 5, "opentelemetry")
    assert (config.file, config.log_frequency) == ("/tmp/t.json", 50)
    assert config.url == "http://collector:4318/v1/traces"
    assert config.resource == {"service.name": "edge"} and config.bsp_schedule_delay_ms == 200
    # A worker gets what it needs to export to the same place, nothing of the sampling.
    assert config.worker_entries() == ["mode=opentelemetry", "opentelemetry,url=collector:4318/v1/traces",
                                       "opentelemetry,resource=service.name=edge", "opentelemetry,bsp_schedule_delay=200"]
    assert TraceConfig.parse(["level=TIMESTAMPS"]).worker_entries() == []


@pytest.mark.parametrize(("entry", "words"), [
    ("level=ALL", "level must be OFF, TIMESTAMPS or TENSORS"),
    ("rate=0", "rate must be >= 1"),
    ("count=-2", "count must be >= -1"),
    ("mode=zipkin", "mode must be triton or opentelemetry"),
    ("jaeger,url=x", "unknown trace mode 'jaeger'"),
    ("opentelemetry,file=x", "unknown setting 'file' for trace mode opentelemetry"),
    ("verbose", "expected [MODE,]SETTING=VALUE"),
])
def test_bad_entries_say_what_is_wrong(entry: str, words: str) -> None:
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        TraceConfig.parse([entry])


def test_nothing_is_installed_outside_opentelemetry_mode() -> None:
    tracing.install("test", TraceConfig.parse(["mode=triton", "level=TIMESTAMPS"]))
    assert tracing.tracer is None
    with tracing.client_span("call", {}) as metadata:
        assert metadata is None  # no tracer: nothing to propagate


def test_server_span_needs_a_traceparent() -> None:
    with tracing.server_span("compute", [("authorization", "x")], {}):
        pass  # no tracer, no parent: a no-op, and no error
    parent = tracing.extract([("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")])
    from opentelemetry import trace
    assert format(trace.get_current_span(parent).get_span_context().trace_id, "032x") == "0af7651916cd43dd8448eb211c80319c"
