"""The suite's streaming section without processes: its data file, its ratio
rows and its reading of the gateway's forwarding-gap histogram."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from loadtest import suite
from loadtest.inputs import ModelSignature, TensorSpec, load_data_file
from loadtest.streaming import StreamRecord, StreamWindow, stream_level_result
from loadtest.suite_streaming import forward_histogram, parse_forward_histogram, stream_rows, write_repeat_data

METRICS = """\
# HELP infergate_stream_forward_seconds Worker response arrived -> written to the client.
# TYPE infergate_stream_forward_seconds histogram
infergate_stream_forward_seconds_bucket{le="0.0001"} 60
infergate_stream_forward_seconds_bucket{le="0.001"} 95
infergate_stream_forward_seconds_bucket{le="0.01"} 100
infergate_stream_forward_seconds_bucket{le="+Inf"} 100
infergate_stream_forward_seconds_sum 0.02
infergate_stream_forward_seconds_count 100
# TYPE infergate_request_duration_seconds histogram
infergate_request_duration_seconds_bucket{model="m",le="+Inf"} 7
"""


def test_forward_histogram_is_read_from_the_metrics_text() -> None:
    h = forward_histogram(METRICS)
    assert h is not None
    assert h["metric"] == "infergate_stream_forward_seconds" and h["count"] == 100
    assert h["mean_s"] == pytest.approx(0.0002)
    assert (h["p50_le_s"], h["p90_le_s"], h["p99_le_s"]) == (0.0001, 0.001, 0.01)
    assert h["buckets"]["+Inf"] == 100


def test_two_snapshots_give_the_histogram_of_the_span_between() -> None:
    before = parse_forward_histogram(METRICS)
    later = METRICS.replace('le="0.0001"} 60', 'le="0.0001"} 70').replace('le="0.001"} 95', 'le="0.001"} 105')
    later = later.replace('le="0.01"} 100', 'le="0.01"} 120').replace('le="+Inf"} 100', 'le="+Inf"} 120')
    later = later.replace("_sum 0.02", "_sum 0.03").replace("_count 100", "_count 120")
    after = parse_forward_histogram(later)
    assert before is not None and after is not None
    span = (after - before).summary()
    assert span["count"] == 20 and span["mean_s"] == pytest.approx(0.0005)
    assert (span["p50_le_s"], span["p99_le_s"]) == (0.0001, 0.01)  # 10 within 0.1 ms, 10 in (1 ms, 10 ms]
    empty = (before - before).summary()
    assert empty["count"] == 0 and math.isnan(empty["p50_le_s"])


def test_no_forward_histogram_is_none() -> None:
    assert forward_histogram("# nothing\nother_metric 3\n") is None


def test_repeat_data_file_fits_repeat_int32(tmp_path: Path) -> None:
    path = write_repeat_data(tmp_path / "r.json", values=4, delay_ms=3)
    sig = ModelSignature("repeat_int32", "1", 0, (TensorSpec("IN", "INT32", (-1,)), TensorSpec("DELAY", "UINT32", (-1,)),
                                                  TensorSpec("WAIT", "UINT32", (1,))), ())
    (payload,) = load_data_file(path, sig, {}, 1)
    assert [t.shape for t in payload] == [(4,), (4,), (1,)]
    assert json.loads(Path(path).read_text())["data"][0]["DELAY"]["content"] == [3, 3, 3, 3]


def _level(streams: int, gap_s: float) -> object:
    w = StreamWindow(duration_s=1.0)
    w.add(StreamRecord(0.0, [0.01, 0.01 + gap_s, 0.01 + 2 * gap_s], done_s=0.1))
    return stream_level_result(streams, w, stable=True, windows=1)


def test_gateway_rows_carry_ratios_to_direct_at_the_same_streams() -> None:
    rows = stream_rows({("direct", 1): _level(1, 0.004), ("gateway grpc", 1): _level(1, 0.005),
                        ("gateway grpc", 16): _level(16, 0.004)})  # type: ignore[dict-item]
    direct, through, alone = rows
    assert "between_p50_ratio" not in direct
    assert through["between_p50_ratio"] == pytest.approx(1.25) and through["ttfr_p50_ratio"] == pytest.approx(1.0)
    assert through["between_p50"] == pytest.approx(5.0)
    assert "between_p50_ratio" not in alone  # no direct row at 16 streams
    assert not math.isnan(through["responses_per_s"])
    gap = {"count": 5, "p50_le_s": 0.00025, "p99_le_s": 0.001}
    with_gap = stream_rows({("gateway grpc", 1): _level(1, 0.004)}, {("gateway grpc", 1): gap})  # type: ignore[dict-item]
    assert (with_gap[0]["forward_p50_le"], with_gap[0]["forward_p99_le"]) == pytest.approx((250, 1000))


def test_streaming_is_a_suite_section() -> None:
    assert "streaming" in suite.section_names()
