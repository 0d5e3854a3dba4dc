"""Triton's words where the REST frontend's own parsing refuses a request:
the repository index's ``ready`` flag, and one log line (no traceback) for a
request the HTTP framework's parser refuses."""

from __future__ import annotations

import logging

import pytest
from aiohttp.http_exceptions import BadHttpMessage

from gateway.frontends.http_json import INDEX_READY_MESSAGE, index_ready
from gateway.frontends.http_parse_errors import SERVER_LOG
from protos.errors import InvalidArgument


def test_index_ready_reads_the_flag() -> None:
    assert index_ready(b"") is False
    assert index_ready(b"{}") is False
    assert index_ready(b'{"ready": true}') is True


@pytest.mark.parametrize(
    "body",
    [b'{"ready": "yes"}', b'{"ready": 1}', b'{"ready": ' + b"[" * 5000 + b"]" * 5000 + b"}"],
    ids=["string", "number", "deeply-nested"],
)
def test_index_ready_not_a_boolean_in_tritons_words(body: bytes) -> None:
    # Triton reads a body nested past orjson's limit, then finds 'ready' is no boolean.
    with pytest.raises(InvalidArgument) as info:
        index_ready(body)
    assert str(info.value) == INDEX_READY_MESSAGE == "Invalid value for 'ready': expected a boolean"


def test_parse_errors_logged_in_one_line(caplog: pytest.LogCaptureFixture) -> None:
    exc = BadHttpMessage("Content-Length can't be present with Transfer-Encoding:\n\n  b'Content-Length: 18'\n   ^")
    with caplog.at_level(logging.DEBUG, logger=SERVER_LOG.name):
        try:
            raise exc
        except BadHttpMessage:
            SERVER_LOG.exception("Error handling request from %s", "10.0.0.1")
        try:
            raise RuntimeError("a handler's bug")
        except RuntimeError:
            SERVER_LOG.exception("Unhandled exception")
    parsed, bug = caplog.records
    assert parsed.levelno == logging.WARNING and parsed.exc_info is None
    assert parsed.getMessage() == (
        "refused a malformed HTTP request from 10.0.0.1 (400): Content-Length can't be present with Transfer-Encoding"
    )
    assert bug.levelno == logging.ERROR and bug.exc_info is not None  # anything else keeps its traceback
