"""Triton's trace extension on real processes: the settings API over HTTP and
gRPC, OpenTelemetry spans from the gateway and the worker in one trace (a
real OTLP receiver started here), rate and count, per-model overrides, and
trace_mode triton's trace files."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.harness import ROOT, Proc, start, start_worker, worker_url
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan

pytestmark = pytest.mark.timeout(180)

MODELS = ROOT / "models"
# The SDK's batch span processor sends within 50 ms (the test polls the receiver for them).
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "50"}
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


def _otel_flags(url: str) -> list[str]:
    return ["--trace-config", "mode=opentelemetry", "--trace-config", f"opentelemetry,url={url}"]


def _gateway(worker: Proc | None, *flags: str, env: dict[str, str] | None = None) -> Proc:
    workers = ["--worker", worker_url(worker)] if worker is not None else []
    return start(["gateway", "--host", "127.0.0.1", "--http-port", "0", "--grpc-port", "0", *workers, *flags], env=env)


def _inputs(module: type) -> list:
    data = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [module.InferInput("INPUT0", [1, 16], "INT32"), module.InferInput("INPUT1", [1, 16], "INT32")]
    for i in inputs:
        i.set_data_from_numpy(data)
    return inputs


def _wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 20
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)  # polling a condition (a file the gateway writes), not standing in for readiness


def _whole_trace(receiver: OtlpReceiver, root_name: str, trace_id: str | None = None) -> tuple[list[ReceivedSpan], ReceivedSpan]:
    """Wait until a trace rooted at ``root_name`` holds all its spans (they come from two processes, in any order)."""
    def complete(spans: list[ReceivedSpan]) -> bool:
        for root in (s for s in spans if s.name == root_name and trace_id in (None, s.trace_id)):
            roles = {s.name.split(" ")[0] for s in spans if s.trace_id == root.trace_id}
            if {"queue", "batch", "worker", "compute"} <= roles:
                return True
        return False

    spans = receiver.wait_for(complete, f"the whole trace under {root_name!r}")
    root = next(s for s in spans if s.name == root_name and trace_id in (None, s.trace_id) and complete(
        [x for x in spans if x.trace_id == s.trace_id]))
    return spans, root


def _chain(spans: list[ReceivedSpan], root: ReceivedSpan) -> dict[str, ReceivedSpan]:
    """The trace under ``root``, by role; asserts each parent link on the way."""
    mine = [s for s in spans if s.trace_id == root.trace_id]
    by = {name.split(" ")[0]: s for s in mine for name in [s.name]}
    assert {"queue", "batch", "worker", "compute"} <= set(by), [s.name for s in mine]
    assert by["queue"].parent_span_id == root.span_id
    assert by["batch"].parent_span_id == root.span_id
    assert by["worker"].parent_span_id == by["batch"].span_id and by["worker"].service == "infergate-gateway"
    assert by["compute"].parent_span_id == by["worker"].span_id and by["compute"].service == "infergate-worker"
    return by


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as r:
        yield r


@pytest.fixture
def otel_cluster(receiver: OtlpReceiver) -> Iterator[tuple[Proc, Proc]]:
    worker = start_worker(MODELS, *_otel_flags(receiver.url), env=FAST_EXPORT)
    try:
        gateway = _gateway(worker, *_otel_flags(receiver.url), "--trace-config", "level=TIMESTAMPS",
                           "--trace-config", "rate=1", env=FAST_EXPORT)
        try:
            yield worker, gateway
        finally:
            gateway.stop()
    finally:
        worker.stop()


def test_one_trace_spans_frontend_queue_batch_worker_call_and_compute(
    otel_cluster: tuple[Proc, Proc], receiver: OtlpReceiver
) -> None:
    _, gateway = otel_cluster
    http = httpclient.InferenceServerClient(f"127.0.0.1:{gateway.ready['http_port']}")
    grpc_client = grpcclient.InferenceServerClient(f"127.0.0.1:{gateway.ready['grpc_port']}")
    try:
        assert "trace" in http.get_server_metadata()["extensions"]
        # The client's own trace context is honoured as the parent of the gateway's root span.
        http.infer("simple", _inputs(httpclient), headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
        spans, root = _whole_trace(receiver, "HTTP infer simple", CLIENT_TRACE)
        assert (root.trace_id, root.parent_span_id) == (CLIENT_TRACE, CLIENT_SPAN)
        _chain(spans, root)

        grpc_client.infer("simple", _inputs(grpcclient))
        spans, root = _whole_trace(receiver, "GRPC infer simple")
        assert root.parent_span_id == ""
        _chain(spans, root)
    finally:
        http.close()
        grpc_client.close()


def test_rate_and_count_decide_which_requests_are_traced(otel_cluster: tuple[Proc, Proc], receiver: OtlpReceiver) -> None:
    worker, gateway = otel_cluster
    http = httpclient.InferenceServerClient(f"127.0.0.1:{gateway.ready['http_port']}")
    try:
        answer = http.update_trace_settings(settings={"trace_rate": "2", "trace_count": "2"})
        assert (answer["trace_rate"], answer["trace_count"], answer["trace_mode"]) == ("2", "2", "opentelemetry")
        for _ in range(7):
            http.infer("simple", _inputs(httpclient))
        # Requests 2 and 4 were taken; the count is spent.
        assert http.get_trace_settings()["trace_count"] == "0"
    finally:
        http.close()
    gateway.stop()  # flushes every span the gateway still holds
    roots = [s for s in receiver.snapshot() if s.name == "HTTP infer simple"]
    assert len(roots) == 2


def test_settings_api_over_http_and_grpc_with_tritons_refusals() -> None:
    gateway = _gateway(None)
    http = httpclient.InferenceServerClient(f"127.0.0.1:{gateway.ready['http_port']}")
    grpc_client = grpcclient.InferenceServerClient(f"127.0.0.1:{gateway.ready['grpc_port']}")
    try:
        assert http.get_trace_settings() == {"trace_level": ["OFF"], "trace_rate": "1000", "trace_count": "-1",
                                             "log_frequency": "0", "trace_file": "", "trace_mode": "triton"}
        grpc_client.update_trace_settings(settings={"trace_level": ["TIMESTAMPS", "TENSORS"], "trace_rate": "10"})
        settings = http.get_trace_settings()
        assert (settings["trace_level"], settings["trace_rate"]) == (["TIMESTAMPS", "TENSORS"], "10")
        got = grpc_client.get_trace_settings(as_json=True)["settings"]
        assert got["trace_level"] == {"value": ["TIMESTAMPS", "TENSORS"]} and got["trace_rate"] == {"value": ["10"]}
        assert http.update_trace_settings(settings={"trace_rate": None})["trace_rate"] == "1000"  # null: the default
        with pytest.raises(InferenceServerException, match="trace file location can not be updated through network"):
            http.update_trace_settings(settings={"trace_file": "/tmp/elsewhere.json"})
        with pytest.raises(InferenceServerException, match="Expect only one trace level 'OFF' is specified"):
            http.update_trace_settings(settings={"trace_level": ["OFF", "TIMESTAMPS"]})
        with pytest.raises(InferenceServerException, match="Unable to parse 'trace_rate', got: often"):
            http.update_trace_settings(settings={"trace_rate": "often"})
        with pytest.raises(InferenceServerException) as info:
            grpc_client.update_trace_settings(settings={"trace_count": "-2"})
        assert info.value.status() == str(grpc.StatusCode.INVALID_ARGUMENT)
        assert "Expecting value >= -1" in info.value.message()
        with pytest.raises(InferenceServerException, match="Request for unknown model : nosuch"):
            http.get_trace_settings(model_name="nosuch")
        assert http.get_trace_settings()["trace_level"] == ["TIMESTAMPS", "TENSORS"]  # refusals changed nothing
    finally:
        http.close()
        grpc_client.close()
        gateway.stop()


def test_triton_mode_writes_trace_files_per_model_override(tmp_path: Path) -> None:
    trace_file = tmp_path / "trace.json"
    worker = start_worker(MODELS)
    try:
        gateway = _gateway(worker, "--trace-config", f"triton,file={trace_file}", "--trace-config", "triton,log-frequency=1",
                           "--trace-config", "rate=1")
        http = httpclient.InferenceServerClient(f"127.0.0.1:{gateway.ready['http_port']}")
        try:
            http.infer("simple", _inputs(httpclient))  # global level OFF: not traced
            answer = http.update_trace_settings(model_name="simple", settings={"trace_level": ["TIMESTAMPS"]})
            assert answer["trace_level"] == ["TIMESTAMPS"] and answer["trace_file"] == str(trace_file)
            assert http.get_trace_settings()["trace_level"] == ["OFF"]  # the override is the model's only
            http.infer("simple", _inputs(httpclient), request_id="traced-1")
            # log_frequency 1: each trace is written as it completes (just after its answer is sent).
            written = Path(f"{trace_file}.0")
            _wait_for(written.exists, "the trace file")
            records = json.loads(written.read_text())
            cleared = http.update_trace_settings(model_name="simple", settings={"trace_level": None})
            assert cleared["trace_level"] == ["OFF"]  # back to the global setting
            http.infer("simple", _inputs(httpclient))
        finally:
            http.close()
            gateway.stop()
    finally:
        worker.stop()
    header, stamps = records[0], records[1]
    assert (header["model_name"], header["request_id"], stamps["id"]) == ("simple", "traced-1", header["id"])
    names = [t["name"] for t in stamps["timestamps"]]
    assert names == ["REQUEST_START", "QUEUE_START", "COMPUTE_START", "COMPUTE_END", "REQUEST_END"]
    ns = [t["ns"] for t in stamps["timestamps"]]
    assert ns == sorted(ns)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.json.0"]  # nothing else was traced


def test_up_hands_the_exporter_to_its_workers(receiver: OtlpReceiver) -> None:
    proc = start(["up", "--workers", "1", "--model-repository", str(MODELS), "--http-port", "0", "--grpc-port", "0",
                  *_otel_flags(receiver.url), "--trace-config", "level=TIMESTAMPS", "--trace-config", "rate=1"],
                 env=FAST_EXPORT)
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{proc.ready['grpc_port']}")
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    try:
        # Over gRPC the client's traceparent rides in the call's metadata.
        client.infer("simple", _inputs(grpcclient), headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"})
        spans, root = _whole_trace(receiver, "GRPC infer simple", trace_id)
        assert root.parent_span_id == "00f067aa0ba902b7"
        _chain(spans, root)
    finally:
        client.close()
        proc.stop()
