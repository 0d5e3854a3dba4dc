"""``infergate bench --help`` shows each option's default."""

from __future__ import annotations

import argparse

from infergate.cli import build_parser


def _bench_help() -> str:
    parser = build_parser(["bench"])
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return " ".join(sub.choices["bench"].format_help().split())


def test_bench_help_names_the_defaults() -> None:
    text = _bench_help()
    assert "client-side timeout per request (default: 30000)" in text
    assert "(default: http)" in text
    # A help that already says its default is left as it is, and a flag's False is no default.
    assert "(default: the server's choice)" in text and "(default: the server's choice) (default" not in text
    assert "(default: False)" not in text and "(default: None)" not in text
