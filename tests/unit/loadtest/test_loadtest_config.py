"""Option parsing of ``infergate bench`` and BenchConfig validation."""

from __future__ import annotations

import argparse

import pytest

from loadtest.cli import add_arguments, config_from_args
from loadtest.config import (
    DEFAULT_PORTS,
    BenchConfig,
    BenchError,
    Distribution,
    LoadMode,
    Protocol,
    parse_header,
    parse_int_range,
    parse_range,
    parse_shape,
    parse_warmup,
)


@pytest.mark.parametrize(
    ("text", "integer", "expected"),
    [
        ("4", True, (4,)),
        ("1:4", True, (1, 2, 3, 4)),
        ("1:10:3", True, (1, 4, 7, 10)),
        ("1:9:3", True, (1, 4, 7)),
        ("1:64:x2", True, (1, 2, 4, 8, 16, 32, 64)),
        ("1:100:x2", True, (1, 2, 4, 8, 16, 32, 64)),
        ("2:20:X3", True, (2, 6, 18)),
        ("100:400:100", False, (100, 200, 300, 400)),
        ("0.5:1.5:0.5", False, (0.5, 1.0, 1.5)),
        ("0.1:0.3:0.1", False, (0.1, 0.2, 0.3)),
        ("10:1000:x10", False, (10, 100, 1000)),
    ],
)
def test_parse_range(text: str, integer: bool, expected: tuple[float, ...]) -> None:
    assert parse_range(text, integer=integer).values() == pytest.approx(expected)


@pytest.mark.parametrize("text", ["", "a", "1:", "0:4", "4:1", "1:4:0", "1:4:x1", "1:4:x0.5", "1:2:3:4", "1.5:3"])
def test_parse_range_rejects(text: str) -> None:
    with pytest.raises(BenchError):
        parse_range(text, integer=True)


def test_parse_warmup() -> None:
    assert parse_warmup("2s") == (2.0, 0)
    assert parse_warmup("500ms") == (0.5, 0)
    assert parse_warmup("100") == (0.0, 100)
    assert parse_warmup("0") == (0.0, 0)
    for bad in ("1.5", "-2s", "abc", "s"):
        with pytest.raises(BenchError):
            parse_warmup(bad)


def test_parse_shape_int_range_header() -> None:
    assert parse_shape("TOKENS:16") == ("TOKENS", (16,))
    assert parse_shape("IMAGE:3,32,32") == ("IMAGE", (3, 32, 32))
    assert parse_shape("ns:name:4") == ("ns:name", (4,))
    for bad in ("TOKENS", ":4", "T:a", "T:-1"):
        with pytest.raises(BenchError):
            parse_shape(bad)
    assert parse_int_range("0:1000") == (0, 1000)
    assert parse_int_range("-5:5") == (-5, 5)
    for bad in ("5:5", "5", "a:b", "9:1"):
        with pytest.raises(BenchError):
            parse_int_range(bad)
    assert parse_header("Authorization: Bearer a:b") == ("Authorization", "Bearer a:b")
    with pytest.raises(BenchError):
        parse_header("novalue")


def test_config_defaults_and_normalisation() -> None:
    cfg = BenchConfig(model="simple", protocol="grpc", distribution="poisson")
    assert cfg.protocol is Protocol.GRPC and cfg.distribution is Distribution.POISSON
    assert cfg.url == f"localhost:{DEFAULT_PORTS[Protocol.GRPC]}"
    assert cfg.mode is LoadMode.CONCURRENCY and cfg.levels == (1.0,)
    assert BenchConfig(model="m").url == f"localhost:{DEFAULT_PORTS[Protocol.HTTP]}"
    assert BenchConfig(model="m", url="http://h:9/").url == "h:9"
    rate = BenchConfig(model="m", request_rate=(10, 20))
    assert rate.mode is LoadMode.REQUEST_RATE and rate.levels == (10.0, 20.0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"model": ""},
        {"model": "m", "concurrency": (1,), "request_rate": (5.0,)},
        {"model": "m", "concurrency": (0,)},
        {"model": "m", "batch_size": 0},
        {"model": "m", "url": "nohostport"},
        {"model": "m", "processes": 0},
        {"model": "m", "timeout_ms": 0},
        {"model": "m", "protocol": "udp"},
        {"model": "m", "int_range": (5, 5)},
    ],
)
def test_config_rejects(kwargs: dict) -> None:
    with pytest.raises(BenchError):
        BenchConfig(**kwargs)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_cli_builds_config() -> None:
    args = _parse([
        "-m", "encoder", "-u", "127.0.0.1:9001", "-i", "grpc", "--concurrency-range", "1:8:x2", "-b", "4",
        "--shape", "TOKENS:12", "--int-range", "0:1000", "-H", "authorization:Bearer k", "--warmup", "1s",
        "--request-count", "50", "--processes", "2", "-p", "250", "--progress",
    ])  # fmt: skip
    cfg = config_from_args(args)
    assert cfg.model == "encoder" and cfg.url == "127.0.0.1:9001" and cfg.protocol is Protocol.GRPC
    assert cfg.concurrency == (1, 2, 4, 8) and cfg.batch_size == 4
    assert cfg.shapes == {"TOKENS": (12,)} and cfg.int_range == (0, 1000)
    assert cfg.headers == (("authorization", "Bearer k"),)
    assert (cfg.warmup_s, cfg.warmup_requests) == (1.0, 0)
    assert cfg.request_count == 50 and cfg.processes == 2 and cfg.measurement_interval_ms == 250 and cfg.progress


def test_cli_rejects_both_ranges() -> None:
    args = _parse(["-m", "m", "--concurrency-range", "1", "--request-rate-range", "10"])
    with pytest.raises(BenchError):
        config_from_args(args)
