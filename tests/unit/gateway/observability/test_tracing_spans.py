"""The span tree of trace_mode opentelemetry, in process with the SDK's
in-memory exporter: the root span under the client's traceparent, the queue
and batch spans under it, the batch linking every traced request it holds,
and the worker call's span carrying its traceparent on."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.observability.trace_settings import TraceSettings
from gateway.observability.tracing import RequestTracing
from gateway.types import InferRequest
from serverkit import tracing as kit
from serverkit.tracing import TraceConfig

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


@pytest.fixture
def exported(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(kit, "tracer", provider.get_tracer("test"))
    yield exporter
    provider.shutdown()


def _request(request_id: str) -> InferRequest:
    return InferRequest(model="simple", version="1", id=request_id, inputs=[], outputs=[])


def test_one_batch_of_two_traced_requests(exported: InMemorySpanExporter) -> None:
    tracing = RequestTracing(TraceSettings(TraceConfig.parse(["mode=opentelemetry", "level=TIMESTAMPS", "rate=1"])))
    first, second, untraced = _request("a"), _request("b"), _request("c")
    sent: list[tuple[str, str]] | None = None
    with tracing.request(first, {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}, "HTTP"):
        with tracing.request(second, lambda: [("traceparent", "00-" + "1" * 32 + "-" + "2" * 16 + "-01")], "GRPC"):
            with tracing.batch([first, untraced, second], "simple"):
                with kit.client_span("worker call simple", {"infergate.worker": "w1"}) as sent:
                    pass
    spans = {s.name: s for s in exported.get_finished_spans()}
    root = spans["HTTP infer simple"]
    assert format(root.context.trace_id, "032x") == CLIENT_TRACE and format(root.parent.span_id, "016x") == CLIENT_SPAN
    queues = [s for s in exported.get_finished_spans() if s.name == "queue"]
    assert sorted(q.parent.span_id for q in queues) == sorted([root.context.span_id, spans["GRPC infer simple"].context.span_id])
    batch = spans["batch simple"]
    assert batch.parent.span_id == root.context.span_id and batch.attributes["infergate.batch.requests"] == 3
    assert [link.context.span_id for link in batch.links] == [spans["GRPC infer simple"].context.span_id]
    call = spans["worker call simple"]
    assert call.parent.span_id == batch.context.span_id
    # What the worker receives: the call's own span as its parent.
    assert sent == [("traceparent", f"00-{CLIENT_TRACE}-{call.context.span_id:016x}-01")]


def test_a_failed_request_marks_its_root_span(exported: InMemorySpanExporter) -> None:
    tracing = RequestTracing(TraceSettings(TraceConfig.parse(["mode=opentelemetry", "level=TIMESTAMPS", "rate=1"])))
    with pytest.raises(RuntimeError), tracing.request(_request("a"), {}, "HTTP"):
        raise RuntimeError("no replica")
    (root,) = exported.get_finished_spans()
    assert root.status.status_code.name == "ERROR" and root.parent is None


def test_no_span_outside_a_traced_batch(exported: InMemorySpanExporter) -> None:
    with kit.client_span("worker call simple", {}) as sent:
        assert sent is None  # a probe, or an untraced batch: nothing recorded, nothing sent
    assert exported.get_finished_spans() == ()
