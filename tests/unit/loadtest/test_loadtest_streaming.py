"""Streaming measurements: TTFR and inter-response statistics from recorded
timestamps, the closed loop of open streams against a fake decoupled model
on a fake clock, the report's columns, and the SSE/gRPC response reading.
No sockets and no real-time assertions.
"""

from __future__ import annotations

import asyncio
import csv
import io
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
from tritonclient.grpc import service_pb2

from loadtest.config import BenchConfig, BenchError
from loadtest.inputs import InputTensor, ModelSignature, Payload, TensorSpec
from loadtest.stream_clients import EventLines, is_final, parse_event
from loadtest.stream_requests import generate_body, grpc_stream_request_bytes, is_data_event
from loadtest.stream_report import STREAM_CSV_COLUMNS, TABLE_HEAD, format_stream_table, stream_to_csv, stream_to_json
from loadtest.stream_runner import Tickets, run_stream_bench_async
from loadtest.streaming import (
    StreamRecord,
    StreamWindow,
    concat_windows,
    percentiles,
    stream_level_result,
    stream_stable,
    window_of,
)

# --- statistics -----------------------------------------------------------------------


def test_record_gives_first_response_and_gaps() -> None:
    record = StreamRecord(sent_s=10.0, arrivals_s=[10.5, 10.75, 11.25], done_s=11.3)
    assert record.responses == 3
    assert record.first_response_s() == 0.5
    assert record.gaps_s() == [0.25, 0.5]


def test_a_request_without_data_has_no_first_response_and_no_gaps() -> None:
    record = StreamRecord(sent_s=1.0, done_s=1.2)
    assert record.first_response_s() is None and record.gaps_s() == []
    window = StreamWindow()
    window.add(record)
    assert (window.requests, window.responses, len(window.first_response), len(window.between_responses)) == (1, 0, 0, 0)


def test_window_counts_responses_and_keeps_errors_apart() -> None:
    window = StreamWindow(duration_s=2.0)
    window.add(StreamRecord(0.0, [0.1, 0.2, 0.3], done_s=0.35))
    window.add(StreamRecord(0.0, [0.4], done_s=0.5))
    window.add(StreamRecord(0.0, [0.1], done_s=0.2, error="stream error"))
    assert (window.requests, window.responses, window.errors) == (2, 4, {"stream error": 1})
    assert sorted(window.first_response) == pytest.approx([0.1, 0.4])
    assert sorted(window.between_responses) == pytest.approx([0.1, 0.1])
    result = stream_level_result(4, window, stable=True, windows=1)
    assert result.requests_per_s == 1.0 and result.responses_per_s == 2.0
    assert result.responses_per_request == 2.0 and result.error_count == 1
    assert result.first_response.p50_us == pytest.approx(100_000) and result.first_response.p99_us == pytest.approx(400_000)


def test_window_of_assigns_requests_by_their_final_response() -> None:
    records = [StreamRecord(0.0, [0.5], done_s=0.9), StreamRecord(0.5, [1.2], done_s=1.0),
               StreamRecord(0.9, [1.5], done_s=1.99), StreamRecord(1.0, [], done_s=math.nan)]
    first, second = window_of(records, 0.0, 1.0), window_of(records, 1.0, 2.0)
    assert (first.requests, second.requests) == (1, 2)
    assert first.duration_s == 1.0 and second.duration_s == 1.0
    merged = concat_windows([first, second])
    assert (merged.requests, merged.responses, merged.duration_s) == (3, 3, 2.0)


def test_percentiles_are_nearest_rank_in_microseconds() -> None:
    p = percentiles([i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert (p.count, p.p50_us, p.p90_us, p.p99_us, p.max_us) == (100, 50_000, 90_000, 99_000, 100_000)
    empty = percentiles([])
    assert empty.count == 0 and math.isnan(empty.p50_us)


def test_stability_needs_agreeing_response_rates_and_first_responses() -> None:
    def window(responses: int, first_s: float) -> StreamWindow:
        w = StreamWindow(duration_s=1.0, requests=10, responses=responses)
        w.first_response.extend([first_s] * 10)
        return w

    assert stream_stable([window(100, 0.01), window(103, 0.0102), window(98, 0.0099)], 10)
    assert not stream_stable([window(100, 0.01), window(150, 0.01), window(100, 0.01)], 10)
    assert not stream_stable([window(100, 0.01), window(100, 0.02), window(100, 0.01)], 10)
    assert not stream_stable([window(100, 0.01), StreamWindow(duration_s=1.0)], 10)


def test_tickets_cycle_payloads_and_stop_at_the_budget() -> None:
    tickets = Tickets(3, budget=7)
    taken = [tickets.take() for _ in range(9)]
    assert taken == [0, 1, 2, 0, 1, 2, 0, None, None]
    assert [Tickets(2).take() for _ in range(3)] == [0, 0, 0]


# --- the closed loop against a fake decoupled model -------------------------------------

SQUARE = ModelSignature("square_int32", "1", 0, (TensorSpec("IN", "INT32", (1,)),), (TensorSpec("OUT", "INT32", (1,)),))


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeSlot:
    """square_int32 on a fake clock: the first response 10 ms after the send, then one every 2 ms."""

    def __init__(self, clock: FakeClock, log: list[int]) -> None:
        self._clock = clock
        self._log = log

    async def send(self, prepared: Payload, record: StreamRecord) -> None:
        (n,) = np.frombuffer(prepared[0].raw, dtype=np.int32)
        self._log.append(int(n))
        for i in range(int(n)):
            await asyncio.sleep(0)  # let the other streams interleave
            self._clock.now += 0.010 if i == 0 else 0.002
            record.arrivals_s.append(self._clock.now)
        record.done_s = self._clock.now

    async def close(self) -> None:
        return None


class FakeStreamClient:
    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.sent: list[int] = []
        self.opened = 0

    async def signature(self) -> ModelSignature:
        return SQUARE

    def prepare(self, payload: Payload) -> Payload:
        return payload

    def open(self) -> FakeSlot:
        self.opened += 1
        return FakeSlot(self.clock, self.sent)

    async def close(self) -> None:
        return None


def _data_file(tmp_path: Path, values: list[int]) -> str:
    path = tmp_path / "square.json"
    path.write_text(json.dumps({"data": [{"IN": [v]} for v in values]}))
    return str(path)


def test_closed_loop_counts_every_response_of_every_request(tmp_path: Path) -> None:
    fake = FakeStreamClient(FakeClock())
    config = BenchConfig(model="square_int32", protocol="grpc", streaming=True, concurrency=(1, 3),
                         request_count=10, input_data=_data_file(tmp_path, [3, 0, 2, 5]))
    result = asyncio.run(run_stream_bench_async(config, client_factory=lambda c: fake, clock=fake.clock))
    assert [lv.level for lv in result.levels] == [1, 3] and fake.opened == 4
    expected = sum([3, 0, 2, 5] * 2 + [3, 0])  # ten requests take the payloads in turn
    for lv in result.levels:
        assert (lv.requests, lv.responses, lv.error_count) == (10, expected, 0)
        # One first response per request with data (n > 0), n - 1 gaps per request.
        assert lv.first_response.count == 7
        assert lv.between_responses.count == expected - 7
    one = result.levels[0]
    assert one.first_response.p50_us == pytest.approx(10_000) and one.between_responses.p99_us == pytest.approx(2_000)
    assert one.duration_s == pytest.approx(7 * 0.010 + (expected - 7) * 0.002)
    assert one.responses_per_s == pytest.approx(expected / one.duration_s)
    assert fake.sent == [3, 0, 2, 5, 3, 0, 2, 5, 3, 0] * 2


def test_warmup_requests_run_before_the_first_level_only(tmp_path: Path) -> None:
    fake = FakeStreamClient(FakeClock())
    config = BenchConfig(model="square_int32", protocol="grpc", streaming=True, concurrency=(2, 2),
                         request_count=4, warmup_requests=3, input_data=_data_file(tmp_path, [1]))
    result = asyncio.run(run_stream_bench_async(config, client_factory=lambda c: fake, clock=fake.clock))
    assert len(fake.sent) == 3 + 4 + 4
    assert [lv.requests for lv in result.levels] == [4, 4]


def test_streaming_options_are_checked() -> None:
    with pytest.raises(BenchError, match="--concurrency-range"):
        BenchConfig(model="m", streaming=True, request_rate=(10,))
    with pytest.raises(BenchError, match="--processes"):
        BenchConfig(model="m", streaming=True, processes=2)


# --- report ---------------------------------------------------------------------------


def _result() -> Any:
    from loadtest.stream_report import StreamBenchResult

    window = StreamWindow(duration_s=2.0)
    window.add(StreamRecord(0.0, [0.010, 0.012, 0.014], done_s=0.015))
    return StreamBenchResult("square_int32", "", "grpc", "gateway-address",
                             (stream_level_result(1, window, stable=True, windows=1),))


def test_table_has_the_streaming_columns() -> None:
    table = format_stream_table(_result())
    header = table.splitlines()[0].split("  ")
    for column in TABLE_HEAD:
        assert column in table
    assert "Streams" in header[0]
    assert "TTFR" in table and "10.00" in table and "2.00" in table


def test_csv_and_json_carry_the_streaming_numbers() -> None:
    rows = list(csv.DictReader(io.StringIO(stream_to_csv(_result()))))
    assert tuple(rows[0]) == STREAM_CSV_COLUMNS
    assert rows[0]["responses"] == "3" and float(rows[0]["first_response_p50_us"]) == pytest.approx(10_000)
    doc = orjson.loads(stream_to_json(_result()))
    level = doc["levels"][0]
    assert doc["mode"] == "streaming" and level["responses"] == 3 and level["responses_per_request"] == 3.0
    assert level["between_responses"]["p99_us"] == pytest.approx(2_000)


# --- wire forms -----------------------------------------------------------------------


def test_grpc_stream_requests_ask_for_the_empty_final_response() -> None:
    payload = (InputTensor("IN", "INT32", (1,), np.array([4], dtype=np.int32).tobytes()),)
    request = service_pb2.ModelInferRequest.FromString(grpc_stream_request_bytes("square_int32", "", payload))
    assert request.parameters["triton_enable_empty_final_response"].bool_param
    assert request.inputs[0].name == "IN" and request.raw_input_contents[0] == payload[0].raw


def test_final_flag_ends_a_request_and_its_absence_means_one_response() -> None:
    response = service_pb2.ModelInferResponse()
    assert is_final(response)
    response.parameters["triton_final_response"].bool_param = False
    assert not is_final(response)
    response.parameters["triton_final_response"].bool_param = True
    assert is_final(response)


def test_generate_bodies_and_server_sent_events() -> None:
    payload = (InputTensor("IN", "INT32", (2,), np.array([1, 2], dtype=np.int32).tobytes()),
               InputTensor("WAIT", "UINT32", (1,), np.array([0], dtype=np.uint32).tobytes()))
    assert orjson.loads(generate_body(payload)) == {"IN": [1, 2], "WAIT": [0]}
    assert parse_event(b"\n") is None and parse_event(b": keep-alive\n") is None
    event = parse_event(b'data: {"model_name": "repeat_int32", "OUT": [1], "IDX": [0]}\n')
    assert event is not None and is_data_event(event)
    assert not is_data_event({"model_name": "m", "model_version": "1", "parameters": {}})
    assert "error" in (parse_event(b'data: {"error": "boom"}') or {})
    assert "error" in (parse_event(b"data: not json") or {})


def test_event_lines_survive_any_cut() -> None:
    stream = b'data: {"OUT": [1]}\n\ndata: {"OUT": [2]}\n\n'
    for cut in range(1, len(stream)):
        lines = EventLines()
        got = lines.feed(stream[:cut]) + lines.feed(stream[cut:])
        assert [line for line in got if line] == [b'data: {"OUT": [1]}', b'data: {"OUT": [2]}']
