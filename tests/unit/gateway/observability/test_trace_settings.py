"""The trace settings (global and per model), the sampling they imply, and
trace_mode triton's records and file rotation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.config import load_config
from gateway.observability.trace_settings import TraceSettings, normalize_json, trace_config
from gateway.observability.tracing import RequestTracing, TraceFile
from gateway.settings import ConfigError
from gateway.types import InferRequest, Tensor
from protos.errors import InvalidArgument, Unsupported
from serverkit.tracing import TraceConfig


def _settings(*entries: str, known: tuple[str, ...] = ("simple", "mlp")) -> TraceSettings:
    return TraceSettings(TraceConfig.parse(entries), known_model=lambda name: name in known)


def _taken(settings: TraceSettings, model: str, n: int) -> list[int]:
    return [i for i in range(1, n + 1) if settings.sample(model) is not None]


def test_off_by_default_and_nothing_is_taken() -> None:
    settings = _settings()
    assert not settings.active
    assert _taken(settings, "simple", 5) == []


def test_rate_takes_one_in_n_and_count_runs_down() -> None:
    settings = _settings("level=TIMESTAMPS", "rate=3", "count=2")
    assert _taken(settings, "simple", 12) == [3, 6]
    assert settings.current()["trace_count"] == "0"
    settings.update("", {"trace_count": ["-1"]})  # unlimited again
    assert len(_taken(settings, "simple", 9)) == 3
    settings.update("", {"trace_rate": None, "trace_count": None})  # back to the start-up values
    assert (settings.current()["trace_rate"], settings.current()["trace_count"]) == ("3", "2")


def test_a_models_override_is_its_own_and_null_falls_back_to_global() -> None:
    settings = _settings("rate=1")
    answer = settings.update("simple", normalize_json({"trace_level": ["TIMESTAMPS"], "trace_count": "1"}))
    assert (answer["trace_level"], answer["trace_count"]) == (["TIMESTAMPS"], "1")
    assert settings.active
    assert settings.current()["trace_level"] == ["OFF"]
    assert _taken(settings, "mlp", 3) == [] and _taken(settings, "simple", 3) == [1]
    # A global update reaches the model's settings it does not override.
    settings.update("", {"trace_rate": ["2"]})
    assert settings.current("simple")["trace_rate"] == "2"
    cleared = settings.update("simple", normalize_json({"trace_level": None, "trace_count": None}))
    assert cleared["trace_level"] == ["OFF"] and not settings.active


def test_refusals_are_tritons_and_change_nothing() -> None:
    settings = _settings("level=TIMESTAMPS")
    before = settings.current()
    cases = [
        ({"trace_file": ["/x"]}, Unsupported, "trace file location can not be updated through network protocol"),
        ({"trace_mode": ["opentelemetry"]}, Unsupported, "trace mode can not be updated"),
        ({"trace_level": ["OFF", "TENSORS"]}, InvalidArgument, "Expect only one trace level 'OFF' is specified"),
        ({"trace_level": ["LOUD"]}, InvalidArgument, "Unable to parse 'trace_level'"),
        ({"trace_rate": ["x"]}, InvalidArgument, "Unable to parse 'trace_rate', got: x"),
        ({"trace_rate": ["0"]}, InvalidArgument, r"value is out of range \[ 1, 4294967295 \], got: 0"),
        ({"trace_count": ["-3"]}, InvalidArgument, "Expecting value >= -1, got:-3"),
        ({"log_frequency": ["1", "2"]}, InvalidArgument, "expect only 1 value for 'log_frequency'"),
        ({"trace_rate": ["5"], "sample": ["1"]}, InvalidArgument, "unknown trace setting 'sample'"),
    ]
    for update, error, words in cases:
        with pytest.raises(error, match=words):
            settings.update("", update)
    with pytest.raises(InvalidArgument, match="Request for unknown model : nosuch"):
        settings.update("nosuch", {"trace_rate": ["1"]})
    with pytest.raises(InvalidArgument, match="expecting an array of strings"):
        normalize_json({"trace_level": "TIMESTAMPS"})
    assert settings.current() == before


def test_opentelemetry_mode_reports_its_url_not_the_file() -> None:
    current = _settings("mode=opentelemetry", "opentelemetry,url=http://c:4318/v1/traces").current()
    assert current["trace_mode"] == "opentelemetry" and current["url"] == "http://c:4318/v1/traces"
    assert "trace_file" not in current and "log_frequency" not in current


def test_config_file_entries_come_before_the_flags(tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text("trace_config:\n  - level=TIMESTAMPS\n  - rate=5\n")
    config = load_config(path, trace_config=["rate=7"])
    assert (trace_config(config.extra).level, trace_config(config.extra).rate) == (("TIMESTAMPS",), 7)
    with pytest.raises(ConfigError, match="rate must be >= 1"):
        trace_config(load_config(path, trace_config=["rate=0"]).extra)


def _request(model: str = "simple") -> InferRequest:
    return InferRequest(model=model, version="1", id="r1", outputs=[],
                        inputs=[Tensor("INPUT0", "INT32", (1, 16), b"\0" * 64)])


def test_triton_mode_records_timestamps_and_tensors(tmp_path: Path) -> None:
    trace_file = tmp_path / "trace.json"
    tracing = RequestTracing(_settings("level=TIMESTAMPS", "rate=1", f"triton,file={trace_file}"))
    tracing.settings.update("", {"trace_level": ["TIMESTAMPS", "TENSORS"]})
    request = _request()
    with tracing.request(request, {}, "HTTP"):
        with tracing.batch([request, _request()], "simple"):
            pass
    assert not trace_file.exists()  # log_frequency 0: written at shutdown
    tracing.close()
    header, stamps, tensor = json.loads(trace_file.read_text())
    assert (header["model_name"], header["model_version"], header["request_id"]) == ("simple", 1, "r1")
    assert [t["name"] for t in stamps["timestamps"]] == [
        "REQUEST_START", "QUEUE_START", "COMPUTE_START", "COMPUTE_END", "REQUEST_END"]
    assert tensor == {"id": header["id"], "activity": "TENSOR_QUEUE_INPUT",
                      "tensor": {"name": "INPUT0", "dtype": "INT32", "shape": [1, 16]}}


def test_untraced_requests_pay_for_nothing() -> None:
    tracing = RequestTracing(_settings())
    request = _request()
    assert tracing.request(request, {}, "GRPC") is tracing.batch([request], "simple")  # the one shared no-op
    assert request.trace is None


def test_trace_file_rotates_every_log_frequency_traces(tmp_path: Path) -> None:
    file = TraceFile(str(tmp_path / "t.json"))
    for i in range(5):
        file.add([{"id": i}], log_frequency=2)
    file.close(log_frequency=2)
    written = {p.name: json.loads(p.read_text()) for p in tmp_path.iterdir()}
    assert written == {"t.json.0": [{"id": 0}, {"id": 1}], "t.json.1": [{"id": 2}, {"id": 3}], "t.json.2": [{"id": 4}]}


def test_each_gateway_process_writes_its_own_trace_file(tmp_path: Path) -> None:
    trace_file = tmp_path / "trace.json"
    for index in (0, 1):
        tracing = RequestTracing(_settings("level=TIMESTAMPS", "rate=1", f"triton,file={trace_file}"),
                                 process_index=index)
        request = _request()
        with tracing.request(request, {}, "HTTP"), tracing.batch([request], "simple"):
            pass
        tracing.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.json.process0", "trace.json.process1"]
    assert all(json.loads(p.read_text())[0]["model_name"] == "simple" for p in tmp_path.iterdir())
