"""Tests for loadtest/generate.py: the generative bench's requests, its
genai-perf numbers on made-up clocks (time to first token, inter-token
latency, output tokens/s, requests/s) and its options. (What counts as a
token in each protocol's stream: test_stream_clients.py.)"""

from __future__ import annotations

import asyncio
import math
import struct
from typing import Any

import orjson
import pytest
from tritonclient.grpc import service_pb2

from loadtest.config import DEFAULT_PORTS, BenchConfig, BenchError, Protocol
from loadtest.generate import (
    GenLevel,
    GenRequest,
    format_gen_table,
    gen_json,
    gen_requests,
    grpc_gen_request,
    http_gen_request,
    openai_gen_request,
)
from loadtest.stream_report import StreamBenchResult
from loadtest.stream_runner import run_stream_bench_async
from loadtest.streaming import StreamRecord, StreamWindow, stream_level_result
from tests.unit.loadtest.test_loadtest_streaming import FakeClock


def config(**kw: Any) -> BenchConfig:
    return BenchConfig(model="lm", protocol="grpc", generate=True, **kw)


def test_requests_are_seeded_prompts_of_the_asked_length() -> None:
    reqs = gen_requests(config(prompt_tokens=10, output_tokens=5, seed=3), count=4)
    assert [len(r.prompt) for r in reqs] == [10] * 4 and {r.max_tokens for r in reqs} == {5}
    assert len({r.prompt for r in reqs}) == 4
    assert reqs == gen_requests(config(prompt_tokens=10, output_tokens=5, seed=3), count=4)
    assert all(r.prompt.decode().isascii() for r in reqs)


def test_shared_openings_precede_each_prompt_s_own_tokens() -> None:
    reqs = gen_requests(config(prompt_tokens=10, output_tokens=5, prefix_prompts=3, prefix_tokens=40, seed=1), count=30)
    assert {len(r.prompt) for r in reqs} == {50}
    openings = {r.prompt[:40] for r in reqs}
    assert len(openings) == 3 and len({o[:2] for o in openings}) == 3  # they differ from the first byte on
    assert len({r.prompt[40:] for r in reqs}) == 30
    with pytest.raises(BenchError, match="--num-prefix-prompts and --prefix-prompt-length go together"):
        config(prefix_prompts=2)


def test_wire_forms_carry_prompt_length_and_ignore_eos() -> None:
    req = GenRequest(b"hello", 7)
    pb = service_pb2.ModelInferRequest.FromString(grpc_gen_request("lm", "", req))
    assert [t.name for t in pb.inputs] == ["text_input", "max_tokens"]
    assert pb.raw_input_contents[0] == struct.pack("<I", 5) + b"hello"
    assert struct.unpack("<i", pb.raw_input_contents[1]) == (7,)
    assert pb.parameters["ignore_eos"].bool_param and pb.parameters["triton_enable_empty_final_response"].bool_param
    assert orjson.loads(http_gen_request(req)) == {"text_input": "hello", "max_tokens": 7,
                                                   "parameters": {"ignore_eos": True}}
    doc = orjson.loads(openai_gen_request("lm", req))
    assert doc["prompt"] == "hello" and doc["max_tokens"] == 7 and doc["stream"] and doc["ignore_eos"]
    assert doc["stream_options"] == {"include_usage": True}


def test_genai_perf_numbers_from_made_up_timestamps() -> None:
    window = StreamWindow(duration_s=2.0)
    # Two requests of 4 tokens: first tokens after 100 ms and 300 ms, gaps of 10 ms and 30 ms.
    window.add(StreamRecord(sent_s=0.0, arrivals_s=[0.1, 0.11, 0.12, 0.13], done_s=0.13))
    window.add(StreamRecord(sent_s=1.0, arrivals_s=[1.3, 1.33, 1.36, 1.39], done_s=1.39))
    window.add(StreamRecord(sent_s=1.5, error="timeout"))
    g = GenLevel.of(stream_level_result(4, window, stable=True, windows=1))
    assert (g.concurrency, g.requests, g.output_tokens, g.errors) == (4, 2, 8, 1)
    assert g.requests_per_s == pytest.approx(1.0) and g.output_tokens_per_s == pytest.approx(4.0)
    assert g.ttft_ms[0] == pytest.approx(100.0) and g.ttft_ms[2] == pytest.approx(300.0)
    assert g.itl_ms[0] == pytest.approx(10.0) and g.itl_ms[2] == pytest.approx(30.0)
    assert g.tokens_per_request == 4.0


class FakeGenClient:
    """Each request answers ``max_tokens`` tokens 10 ms apart, the first after 50 ms."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.prepared: list[GenRequest] = []

    async def signature(self) -> Any:
        raise AssertionError("a generation run takes its requests as given")

    def prepare(self, payload: Any) -> GenRequest:
        self.prepared.append(payload)
        return payload

    def open(self) -> Any:
        clock = self.clock

        class Slot:
            async def send(self, prepared: GenRequest, record: StreamRecord) -> None:
                clock.now += 0.05
                for _ in range(prepared.max_tokens):
                    record.arrivals_s.append(clock.now)
                    clock.now += 0.01
                record.done_s = clock.now
                await asyncio.sleep(0)

            async def close(self) -> None:
                return None

        return Slot()

    async def close(self) -> None:
        return None


def test_a_run_measures_the_requests_it_is_given() -> None:
    cfg = config(output_tokens=3, request_count=6, concurrency=(1,))
    clock = FakeClock()
    fake = FakeGenClient(clock)
    result = asyncio.run(run_stream_bench_async(cfg, client_factory=lambda c: fake, clock=clock,
                                                payloads=gen_requests(cfg, count=2)))
    (g,) = [GenLevel.of(level) for level in result.levels]
    assert len(fake.prepared) == 2 and (g.requests, g.output_tokens) == (6, 18)
    assert g.ttft_ms[0] == pytest.approx(50.0) and g.itl_ms[1] == pytest.approx(10.0)
    table = format_gen_table(result)
    assert "TTFT p50" in table and "ITL p50" in table and "Out tok/s" in table
    doc = gen_json(result)
    assert doc["levels"][0]["output_tokens"] == 18
    assert doc["levels"][0]["time_to_first_token_ms"]["p50"] == pytest.approx(50.0)


def test_an_empty_level_prints_dashes() -> None:
    level = stream_level_result(2, StreamWindow(duration_s=1.0), stable=False, windows=3)
    table = format_gen_table(StreamBenchResult("lm", "", "grpc", "h:1", (level,), False))
    assert "-" in table and "did not stabilise" in table
    assert math.isnan(GenLevel.of(level).ttft_ms[0])


def test_generation_options_are_checked() -> None:
    assert config().streaming  # --generate streams
    with pytest.raises(BenchError, match="--generate"):
        BenchConfig(model="lm", protocol="openai")
    # The OpenAI API is served on the HTTP port: the default address is perf_analyzer's HTTP one.
    assert BenchConfig(model="lm", protocol="openai", generate=True).url == f"localhost:{DEFAULT_PORTS[Protocol.HTTP]}"
    with pytest.raises(BenchError, match="--output-tokens"):
        config(output_tokens=0)


def test_the_suite_section_compares_with_one_sequence_at_a_time(tmp_path: Any) -> None:
    from loadtest.suite_generate import gateway_config, gen_rows, write_repository

    source = tmp_path / "src"
    (source / "tiny_lm" / "1").mkdir(parents=True)
    (source / "tiny_lm" / "config.pbtxt").write_text('name: "tiny_lm"\nbackend: "generate"\n')
    repo = write_repository(source, tmp_path / "repo")
    serial = (repo / "tiny_lm_serial" / "config.pbtxt").read_text()
    assert 'name: "tiny_lm_serial"' in serial and '"max_batch_sequences"' in serial
    assert (repo / "tiny_lm_serial" / "1").is_dir() and "max_batch" not in (repo / "tiny_lm" / "config.pbtxt").read_text()
    assert gateway_config()["models"]["tiny_lm"]["max_inflight_per_replica"] == 32

    def level(tokens: int) -> Any:
        window = StreamWindow(duration_s=1.0)
        window.add(StreamRecord(sent_s=0.0, arrivals_s=[0.1] * tokens, done_s=0.5))
        return stream_level_result(16, window, stable=True, windows=1)

    rows = gen_rows({("1 worker, continuous batching", 16): level(40), ("1 worker, one at a time", 16): level(10),
                     ("2 workers, continuous batching", 1): level(5),
                     ("1 worker straight, continuous batching", 16): level(60),
                     ("1 worker straight, one at a time", 16): level(12)})
    assert [r["vs_serial"] for r in rows] == [4.0, 1.0, None, 5.0, 1.0]  # each path against its own one-at-a-time
    assert rows[0]["output_tokens_per_s"] == 40.0 and rows[0]["requests_per_s"] == 1.0


def test_the_prefix_section_s_models_and_rows(tmp_path: Any) -> None:
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc

    from loadtest import suite_prefix as sp

    source = tmp_path / "src"
    (source / "tiny_lm" / "1").mkdir(parents=True)
    (source / "tiny_lm" / "config.pbtxt").write_text('name: "tiny_lm"\nbackend: "generate"\n')
    repo = sp.write_repository(source, tmp_path / "repo")

    def parameters(name: str) -> dict[str, str]:
        config = text_format.Parse((repo / name / "config.pbtxt").read_text(), mc.ModelConfig())
        assert config.name == name
        return {k: v.string_value for k, v in config.parameters.items()}

    assert parameters(sp.COLD)["enable_prefix_caching"] == "false" and "enable_prefix_caching" not in parameters(sp.MODEL)
    assert parameters(sp.TINY_COLD)["enable_prefix_caching"] == "false"
    # A fleet worker's cache: its share of the running sequences and about half the openings, not all of them.
    per_token = 2 * 4 * 256 * 4
    cached = int(parameters(sp.FLEET)["max_cache_bytes"]) - sp.FLEET_RUNNING * 279 * per_token
    assert sp.OPENINGS / 2 <= cached / (sp.OPENING_TOKENS * per_token) < sp.OPENINGS * 0.6
    assert (repo / sp.MODEL / "1" / "model.onnx").stat().st_size > 1_000_000

    def level(first_s: float) -> Any:
        window = StreamWindow(duration_s=1.0)
        window.add(StreamRecord(sent_s=0.0, arrivals_s=[first_s, first_s + 0.01], done_s=0.5))
        return stream_level_result(1, window, stable=True, windows=1)

    row = sp.prefix_row("cache", "warm", level(0.01), level(0.04), 0.9)
    assert row["ttft_ratio"] == pytest.approx(0.25) and row["hit_rate"] == 0.9
    assert sp.prefix_row("cache", "cold", level(0.04), None, None)["ttft_ratio"] is None
