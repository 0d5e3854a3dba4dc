"""A real OTLP/HTTP trace receiver for tests: it decodes what exporters POST
to ``/v1/traces`` with the ``opentelemetry-proto`` messages and keeps the
spans, so a test can poll for the trace it expects."""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    links: tuple[str, ...]  # span ids


class OtlpReceiver:
    """Start with ``with OtlpReceiver() as r``; ``r.url`` is the exporter's endpoint."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                receiver._collect(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-receiver", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"

    def _collect(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        found = []
        for resource_spans in request.resource_spans:
            attrs = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope in resource_spans.scope_spans:
                for s in scope.spans:
                    found.append(ReceivedSpan(attrs.get("service.name", ""), s.name, s.trace_id.hex(), s.span_id.hex(),
                                              s.parent_span_id.hex(), tuple(link.span_id.hex() for link in s.links)))
        with self._lock:
            self.spans.extend(found)

    def snapshot(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self.spans)

    def wait_for(self, condition: Callable[[list[ReceivedSpan]], bool], what: str, timeout_s: float = 30.0) -> list[ReceivedSpan]:
        deadline = time.monotonic() + timeout_s
        while not condition(spans := self.snapshot()):
            assert time.monotonic() < deadline, f"timed out waiting for {what}; got {[s.name for s in spans]}"
            time.sleep(0.05)  # polling a condition (what the exporters sent), not standing in for readiness
        return spans

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)
