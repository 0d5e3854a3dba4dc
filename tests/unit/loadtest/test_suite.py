"""The benchmark suite's pure parts: cells, tables and files made from a
results dict, section selection and the hook for new sections, CPU clocks.
Nothing here starts a process or measures anything."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from loadtest import suite
from loadtest.suite_context import SuiteSettings, median
from loadtest.suite_procs import cpu_seconds, machine_busy_seconds
from loadtest.suite_report import (
    Column,
    SectionResult,
    format_cell,
    format_markdown,
    markdown_table,
    write_results,
)


def sample_results() -> dict:
    overhead = SectionResult(
        key="overhead",
        title="Gateway overhead",
        columns=(Column("path", "path"), Column("p50", "p50 ms", ".3f"), Column("rps", "req/s", ",.0f"), Column("ok", "ok")),
        rows=({"path": "gRPC", "p50": 0.41234, "rps": 12345.6, "ok": True}, {"path": "a|b", "p50": math.nan, "rps": None, "ok": False}),
        notes=("median of 3 rounds",),
        details={"raw": [1.0, math.inf]},
    )
    return {
        "meta": {"machine": "2 CPU cores (Test CPU), 4 GiB RAM, no GPU", "date": "2030-01-02 03:04 UTC", "duration_s": 321.4,
                 "loadavg_start": [0.5, 0.4, 0.3], "loadavg_end": [1.3, 1.0, 0.5], "command": "python -m loadtest.suite"},
        "sections": [overhead.to_dict(), suite._failed_section("scale", RuntimeError("no gateway\nmore lines"))],
    }  # fmt: skip


def test_cells_format_numbers_and_mark_unknowns() -> None:
    assert format_cell(0.41234, ".3f") == "0.412"
    assert format_cell(12345.6, ",.0f") == "12,346"
    assert format_cell(0.256, ".0%") == "26%"
    assert format_cell(0.031, "+.1%") == "+3.1%"
    assert format_cell(None, ".2f") == format_cell(math.nan, ".2f") == "-"
    assert (format_cell(True), format_cell(False)) == ("yes", "no")
    assert format_cell(7, "d") == "7" and format_cell("x|y") == "x\\|y"


def test_table_has_aligned_header_and_one_line_per_row() -> None:
    table = markdown_table([{"key": "a", "header": "A", "fmt": ""}, {"key": "b", "header": "B", "fmt": ".1f"}],
                           [{"a": "x", "b": 1.26}, {"a": "y"}])  # fmt: skip
    assert table.splitlines() == ["| A | B |", "|:---|---:|", "| x | 1.3 |", "| y | - |"]


def test_markdown_from_a_results_dict() -> None:
    text = format_markdown(sample_results())
    lines = text.splitlines()
    assert lines[0] == "# infergate benchmark results"
    assert "2 CPU cores (Test CPU), 4 GiB RAM, no GPU · 2030-01-02 03:04 UTC · suite took 321 s" in lines
    assert any("load average (1 min): 0.5 at the start, 1.3 at the end" in line for line in lines)
    assert "## Gateway overhead" in lines
    assert "| path | p50 ms | req/s | ok |" in lines
    assert "| gRPC | 0.412 | 12,346 | yes |" in lines
    assert "| a\\|b | - | - | no |" in lines
    assert "- median of 3 rounds" in lines
    assert "## scale (failed)" in lines
    assert "- failed: RuntimeError: no gateway" in lines and "more lines" not in text
    assert text.endswith("\n") and not text.endswith("\n\n")


def test_write_results_writes_json_and_the_same_markdown(tmp_path: Path) -> None:
    json_path, md_path = write_results(sample_results(), tmp_path / "bench")
    data = json.loads(json_path.read_text())  # strict JSON: NaN and inf became null
    assert data["sections"][0]["rows"][1]["p50"] is None
    assert data["sections"][0]["details"]["raw"] == [1.0, None]
    assert data["sections"][1]["failed"] is True
    assert md_path.read_text() == format_markdown(data)


def test_rewriting_keeps_hand_added_sections_and_sections_not_rerun(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    _, md_path = write_results(sample_results(), out)
    hand = "## Large tensors over capped links\n\n`python bench/netsim_bench.py`: by hand.\n\n| a |\n|:---|\n| 1 |"
    md_path.write_text(md_path.read_text() + "\n" + hand + "\n")
    ceiling = SectionResult("ceiling", "Light model", (Column("c", "clients", "d"),), ({"c": 64},))
    later = {"meta": {"date": "2030-02-03 04:05 UTC"}, "sections": [ceiling.to_dict()]}
    for _ in range(2):  # a second rewrite neither loses nor doubles anything
        json_path, _ = write_results(later, out)
        text = md_path.read_text()
        titles = [line for line in text.splitlines() if line.startswith("## ")]
        assert titles == ["## Gateway overhead", "## Light model", "## Large tensors over capped links"]
        assert "- not re-run this time: measured 2030-01-02 03:04 UTC" in text  # the overhead section's own run
        assert text.rstrip().endswith(hand) and text.count("by hand") == 1
        keys = [s["key"] for s in json.loads(json_path.read_text())["sections"]]
        assert keys == ["overhead", "ceiling"]  # the old order; the failed section of the old run is not carried


def test_sections_run_in_order_and_new_ones_can_be_added(monkeypatch: pytest.MonkeyPatch) -> None:
    assert suite.section_names()[:4] == ["sim_check", "overhead", "batching", "scale"]
    monkeypatch.setattr(suite, "_SECTIONS", dict(suite._SECTIONS))

    def encoder_rows(ctx: object) -> SectionResult:
        return SectionResult("encoder_tp", "Encoder, tensor-parallel", (Column("tp", "TP", "d"),), ({"tp": 2},))

    suite.register_section("encoder_tp", encoder_rows)
    assert suite.section_names()[-1] == "encoder_tp"
    assert suite.selected_sections("") == suite.section_names()
    assert suite.selected_sections(" scale, encoder_tp ") == ["scale", "encoder_tp"]
    with pytest.raises(SystemExit, match="unknown section"):
        suite.selected_sections("scale,nope")


def test_run_suite_records_a_failed_section_and_goes_on(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def broken(ctx: object) -> SectionResult:
        raise RuntimeError("worker would not start")

    def fine(ctx: object) -> SectionResult:
        return SectionResult("fine", "Fine", (Column("n", "n", "d"),), ({"n": 1},))

    monkeypatch.setattr(suite, "_SECTIONS", {"broken": broken, "fine": fine})
    results = suite.run_suite(SuiteSettings(tmp_path), ["broken", "fine"], tmp_path)
    assert [s["key"] for s in results["sections"]] == ["broken", "fine"]
    assert results["sections"][0]["failed"] and results["sections"][1]["rows"] == [{"n": 1}]
    assert results["meta"]["sections_run"] == ["broken", "fine"] and results["meta"]["duration_s"] >= 0


def test_quick_settings_are_shorter_than_the_real_suite(tmp_path: Path) -> None:
    full, quick = SuiteSettings.for_run(tmp_path, False), SuiteSettings.for_run(tmp_path, True)
    assert full.scale_workers == (1, 2, 4, 8, 16, 32)
    assert quick.quick and quick.window_ms < full.window_ms and max(quick.scale_workers) < max(full.scale_workers)


def test_median_ignores_unknowns() -> None:
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([4.0, 1.0, math.nan]) == 2.5
    assert math.isnan(median([]))


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_cpu_clocks_read_proc() -> None:
    before = cpu_seconds(os.getpid())
    sum(i * i for i in range(300_000))  # burn a little CPU so the clock must move
    after = cpu_seconds(os.getpid())
    assert before is not None and after is not None and after >= before > 0
    assert cpu_seconds(2**22 + 12345) is None  # no such process
    busy = machine_busy_seconds()
    assert busy is not None and busy > 0
