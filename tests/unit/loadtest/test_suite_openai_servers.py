"""The ``openai_servers`` section's pure parts: a level from its requests' timings (how tokens are
counted on each path), its rows and their ratios against ``transformers serve`` direct. No processes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from loadtest import suite, suite_openai_servers
from loadtest.openai_stream import StreamTiming
from loadtest.suite_context import SuiteContext, SuiteSettings
from loadtest.suite_openai_servers import (
    DIRECT,
    MAX_TOKENS,
    VIA_GATEWAY,
    WORKER,
    LevelSummary,
    request_tokens,
    same_texts,
    servers_rows,
    summarize,
)
from loadtest.suite_procs import SuiteError


def _timing(ttft_s: float, chunks: int, gap_s: float, usage: int | None) -> StreamTiming:
    return StreamTiming(None, ttft_s, None, usage if usage is not None else chunks, 1.0, chunks, usage, gap_s)


def _level(streams: int, tokens_per_s: float, gap_ms: float) -> LevelSummary:
    return LevelSummary(streams, 4, 0, 10.0, 20.0, gap_ms, 8.0, 256, tokens_per_s, False)


def test_registered_after_prefix() -> None:
    names = suite.section_names()
    assert names.index("openai_servers") == names.index("prefix") + 1


def test_tokens_are_usage_only_where_the_path_counts_them() -> None:
    words = _timing(0.1, 7, 0.05, None)
    relayed = _timing(0.1, 7, 0.05, 7)  # a gateway's count of the chunks a server without usage sent
    assert request_tokens(words, 64, use_usage=False) == 64
    assert request_tokens(relayed, 64, use_usage=False) == 64
    assert request_tokens(_timing(0.1, 40, 0.003, 64), 64, use_usage=True) == 64
    assert request_tokens(_timing(0.1, 40, 0.003, 30), 64, use_usage=True) == 30  # an early stop counts as sent
    assert request_tokens(words, 64, use_usage=True) == 64  # no usage at all: the length asked for


def test_a_level_from_its_timings() -> None:
    timings = [_timing(0.010 * (i + 1), 40, 0.001 * (i + 1), 64) for i in range(4)]
    timings.append(StreamTiming("timeout", total_s=5.0))
    level = summarize(16, timings, 2.0, 64, use_usage=True)
    assert (level.streams, level.requests, level.errors) == (16, 4, 1)
    assert level.ttft_p50_ms == pytest.approx(20.0) and level.ttft_p99_ms == pytest.approx(40.0)
    assert level.chunk_gap_p50_ms == pytest.approx(2.5)  # the median of 1, 2, 3, 4 ms
    assert level.chunks_per_request == 40 and level.tokens_per_request == 64
    assert level.output_tokens == 256 and level.output_tokens_per_s == pytest.approx(128.0)
    assert level.usage_counted
    assert not summarize(16, timings, 2.0, 64, use_usage=False).usage_counted


def test_a_level_with_no_success_is_empty_not_an_error() -> None:
    level = summarize(1, [StreamTiming("HTTP 503")], 1.0, 64, use_usage=False)
    assert (level.requests, level.errors, level.output_tokens) == (0, 1, 0)
    assert math.isnan(level.ttft_p50_ms) and math.isnan(level.chunk_gap_p50_ms)


def test_rows_and_their_ratios_against_direct() -> None:
    measured = {(DIRECT, 16): _level(16, 400.0, 200.0), (VIA_GATEWAY, 16): _level(16, 380.0, 210.0),
                (WORKER, 16): _level(16, 2000.0, 3.0), (VIA_GATEWAY, 1): _level(1, 60.0, 100.0)}
    rows = {(r["path"], r["streams"]): r for r in servers_rows(measured)}
    assert list(rows) == list(measured)  # measured order is table order
    direct, fronted, worker = rows[(DIRECT, 16)], rows[(VIA_GATEWAY, 16)], rows[(WORKER, 16)]
    assert direct["gap_vs_direct"] is None and direct["tokens_vs_direct"] is None
    assert fronted["gap_vs_direct"] == pytest.approx(1.05) and fronted["tokens_vs_direct"] == pytest.approx(0.95)
    # The worker streams other chunks than transformers serve: only its tokens/s compare.
    assert worker["gap_vs_direct"] is None and worker["tokens_vs_direct"] == pytest.approx(5.0)
    # No direct row at 1 stream: no ratio.
    assert rows[(VIA_GATEWAY, 1)]["tokens_vs_direct"] is None
    assert fronted["tokens_counted"] == "max_tokens" and MAX_TOKENS > 0


def test_no_ratio_over_nothing() -> None:
    nan = float("nan")
    measured = {(DIRECT, 1): _level(1, 0.0, nan), (VIA_GATEWAY, 1): _level(1, 50.0, 100.0)}
    row = servers_rows(measured)[1]
    assert row["gap_vs_direct"] is None and row["tokens_vs_direct"] is None


def test_same_texts_counts_prompts_with_equal_text() -> None:
    assert same_texts(["a", "b", "c"], ["a", "x", "c"]) == 2
    with pytest.raises(ValueError):
        same_texts(["a"], ["a", "b"])


def test_a_missing_package_fails_the_section_naming_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(suite_openai_servers, "NEEDS",
                        (("no_such_module_here", "no-such-package"), ("no_such.sub", "another-one")))
    ctx = SuiteContext(SuiteSettings(tmp_path), tmp_path)
    with pytest.raises(SuiteError, match="needs no-such-package, another-one"):
        suite_openai_servers.run_openai_servers(ctx)
    assert list(tmp_path.iterdir()) == []  # nothing built, nothing started


def test_the_triton_section_reads_each_target_against_triton_and_the_bare_server() -> None:
    from loadtest.suite_triton import DIRECT, FLOOR, PROXY, triton_rows

    def level(rps: float, cpu: float | None) -> dict[str, object]:
        return {"throughput_rps": rps, "p99_ms": 2.0, "cpu_ms_per_request": cpu, "errors": 0}

    rows = triton_rows({DIRECT: {1: level(1000, 0.5), 64: level(8000, 0.1)},
                        "gateway -> triton (relay lane)": {1: level(400, 1.0), 64: level(2000, 0.5)},
                        FLOOR: {1: level(1300, 0.25), 64: level(2500, None)},
                        PROXY: {1: level(500, 0.8)}})
    lane = {r["clients"]: r for r in rows if r["target"] == "gateway -> triton (relay lane)"}
    assert lane[1]["vs_triton"] == pytest.approx(0.4) and lane[1]["cpu_vs_floor"] == pytest.approx(4.0)
    assert lane[1]["vs_proxy"] == pytest.approx(0.8) and lane[1]["cpu_vs_proxy"] == pytest.approx(1.25)
    assert lane[64]["vs_triton"] == pytest.approx(0.25) and lane[64]["cpu_vs_floor"] is None  # no floor figure
    assert lane[64]["vs_proxy"] is None  # the proxy was not measured at 64
    assert [r["target"] for r in rows].count(DIRECT) == 2
