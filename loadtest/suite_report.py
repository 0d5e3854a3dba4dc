"""The benchmark suite's results: their records, and the two files they become.

A run is one results dict: ``meta`` (machine, date, duration, settings) and
``sections``, each a :class:`SectionResult` in dict form (title, columns with
their number formats, rows, notes). ``results.json`` holds that dict;
``results.md`` is :func:`format_markdown` of it: one Markdown table per
section. Formatting needs nothing but the dict, so an old JSON file can be
re-rendered and tests can feed made-up results.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson


@dataclass(frozen=True, slots=True)
class Column:
    key: str
    header: str
    fmt: str = ""  # format spec for numbers (".2f", ",.0f", ".0%"); "" = text

    def to_dict(self) -> dict[str, str]:
        return {"key": self.key, "header": self.header, "fmt": self.fmt}


@dataclass(frozen=True, slots=True)
class SectionResult:
    key: str
    title: str
    columns: tuple[Column, ...]
    rows: tuple[Mapping[str, Any], ...] = ()
    notes: tuple[str, ...] = ()
    # Raw measurements worth keeping in the JSON but not in the table.
    details: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "title": self.title,
            "columns": [c.to_dict() for c in self.columns],
            "rows": [dict(r) for r in self.rows],
            "notes": list(self.notes),
            "details": dict(self.details),
        }


def format_cell(value: Any, fmt: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if fmt and isinstance(value, (int, float)):
        return format(value, fmt)
    return str(value).replace("|", "\\|")


def markdown_table(columns: Sequence[Mapping[str, str]], rows: Sequence[Mapping[str, Any]]) -> str:
    """A GitHub-style table; numeric columns (those with a format) align right."""
    head = "| " + " | ".join(c["header"] for c in columns) + " |"
    rule = "|" + "|".join("---:" if c.get("fmt") else ":---" for c in columns) + "|"
    body = ["| " + " | ".join(format_cell(row.get(c["key"]), c.get("fmt", "")) for c in columns) + " |" for row in rows]
    return "\n".join([head, rule, *body])


def format_markdown(results: Mapping[str, Any]) -> str:
    meta = results.get("meta", {})
    lines = ["# infergate benchmark results", ""]
    machine = meta.get("machine", "")
    when = meta.get("date", "")
    took = meta.get("duration_s")
    summary = " · ".join(part for part in (machine, when, f"suite took {took:.0f} s" if isinstance(took, (int, float)) else "") if part)
    if summary:
        lines += [summary, ""]
    load = [meta.get("loadavg_start"), meta.get("loadavg_end")]
    if all(isinstance(v, (list, tuple)) and v for v in load):
        lines.append(f"Machine load average (1 min): {load[0][0]:.1f} at the start, {load[1][0]:.1f} at the end "
                     "(other work on the machine skews every number).")  # fmt: skip
        lines.append("")
    if meta.get("command"):
        lines += [f"Produced by `{meta['command']}`.", ""]
    for section in results.get("sections", []):
        lines += [f"## {section['title']}", ""]
        if section.get("rows"):
            lines.append(markdown_table(section["columns"], section["rows"]))
        else:
            lines.append("(no rows: the section did not complete)")
        notes = list(section.get("notes") or [])
        if section.get("measured"):
            notes.append(f"not re-run this time: measured {section['measured']}")
        if notes:
            lines.append("")
            lines += [f"- {note}" for note in notes]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _clean(value: Any) -> Any:
    # NaN and infinities are not JSON: unknown values become null.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def _read_previous(out_dir: Path) -> tuple[dict[str, Any], str]:
    """The results.json and results.md already in ``out_dir`` (empty when absent or unreadable)."""
    try:
        previous = orjson.loads((out_dir / "results.json").read_bytes())
    except (OSError, orjson.JSONDecodeError):
        previous = {}
    try:
        markdown = (out_dir / "results.md").read_text()
    except OSError:
        markdown = ""
    return (previous if isinstance(previous, dict) else {}), markdown


def hand_added_blocks(markdown: str, suite_titles: set[str]) -> list[str]:
    """The ``## `` sections of ``markdown`` the suite did not write (titles not in ``suite_titles``), verbatim."""
    blocks: list[str] = []
    current: list[str] | None = None
    for line in markdown.splitlines():
        if line.startswith("## "):
            if current is not None:
                blocks.append("\n".join(current).strip())
            current = [line] if line[3:].strip() not in suite_titles else None
        elif current is not None:
            current.append(line)
    if current is not None:
        blocks.append("\n".join(current).strip())
    return [b for b in blocks if b]


def merge_previous(results: Mapping[str, Any], previous: Mapping[str, Any]) -> dict[str, Any]:
    """``results`` plus the previous run's sections this run did not measure (``--only``), marked as such.

    Sections keep the previous file's order; sections new to it come last.
    """
    merged = dict(results)
    fresh = {s.get("key"): s for s in results.get("sections", [])}
    when = previous.get("meta", {}).get("date", "an earlier run")
    sections = []
    for section in previous.get("sections", []):
        key = section.get("key")
        if key in fresh:
            sections.append(fresh.pop(key))
        elif not section.get("failed"):
            sections.append(dict(section, measured=section.get("measured") or when))
    merged["sections"] = [*sections, *fresh.values()]
    return merged


def write_results(results: Mapping[str, Any], out_dir: Path) -> tuple[Path, Path]:
    """Write ``results.json`` and ``results.md`` into ``out_dir``; returns their paths.

    What was there is not lost: sections of the previous results.json this run
    did not measure stay (each saying when it was measured), and ``## ``
    sections added to results.md by hand (other benchmarks' tables) stay at
    its end, verbatim.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / "results.json", out_dir / "results.md"
    previous, old_markdown = _read_previous(out_dir)
    suite_titles = {str(s.get("title", "")) for s in previous.get("sections", [])}
    extra = hand_added_blocks(old_markdown, suite_titles)
    cleaned = _clean(merge_previous(results, previous))
    json_path.write_bytes(orjson.dumps(cleaned, option=orjson.OPT_INDENT_2) + b"\n")
    markdown = format_markdown(cleaned)
    if extra:
        markdown = markdown + "\n" + "\n\n".join(extra) + "\n"
    md_path.write_text(markdown)
    return json_path, md_path
