"""Triton's log settings applied to a logger's handlers: which records pass, the format, the refusals."""

from __future__ import annotations

import io
import logging

import pytest

from gateway.frontends.log_settings import LogSettings
from protos.errors import InvalidArgument, Unsupported


def _logger() -> tuple[logging.Logger, io.StringIO]:
    logger = logging.getLogger("infergate.test.log_settings")
    logger.handlers.clear()
    logger.propagate = False
    logger.setLevel(logging.INFO)
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger.addHandler(handler)
    return logger, out


def test_switches_and_verbose_level_decide_what_passes() -> None:
    logger, out = _logger()
    settings = LogSettings(logger)
    settings.update({"log_info": False, "log_error": False, "log_verbose_level": None})
    logger.info("i1"); logger.warning("w1"); logger.error("e1")
    settings.update({"log_info": True, "log_verbose_level": 1})
    logger.debug("d1"); logger.info("i2")
    settings.update({"log_verbose_level": 0})
    logger.debug("d2")
    assert out.getvalue().split() == ["WARNING", "w1", "DEBUG", "d1", "INFO", "i2"]
    assert logger.level == logging.INFO  # back to where it started
    settings.close()


def test_iso8601_format_and_back() -> None:
    logger, out = _logger()
    settings = LogSettings(logger)
    settings.update({"log_format": "ISO8601"})
    logger.info("x")
    settings.update({"log_format": "default"})
    logger.info("y")
    first, second = out.getvalue().splitlines()
    assert first.endswith("Z INFO infergate.test.log_settings: x") and second == "INFO y"


def test_refusals_change_nothing() -> None:
    logger, _ = _logger()
    settings = LogSettings(logger)
    before = settings.current()
    with pytest.raises(Unsupported, match="log file location can not be updated"):
        settings.update({"log_info": False, "log_file": "x.log"})
    with pytest.raises(InvalidArgument, match="invalid argument for --log_format, got: json"):
        settings.update({"log_format": "json"})
    with pytest.raises(InvalidArgument, match="unknown log setting 'colour'"):
        settings.update({"colour": True})
    with pytest.raises(InvalidArgument, match="must be a boolean"):
        settings.update({"log_info": 1})
    assert settings.current() == before
