"""What a request the HTTP framework's parser refuses leaves in the log.

aiohttp answers a request it cannot parse (a malformed request line or
header, or ``Transfer-Encoding: chunked`` together with ``Content-Length``,
which RFC 9112 section 6.3 lets a server refuse as a request-smuggling
pattern) with a 400 and closes the connection, then logs the parser's
exception with its traceback through the request handler's logger. That is
the client's fault, not the server's: :data:`SERVER_LOG`, handed to aiohttp
as that logger, turns each such record into one warning line naming the
peer and the parser's reason. Every other record (an unhandled exception in
a handler) keeps its traceback.
"""

from __future__ import annotations

import logging

from aiohttp.http_exceptions import HttpProcessingError


class _OneLineParseErrors(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            peer = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
            # The parser's first line; the lines after it quote the offending bytes.
            lines = [line.strip() for line in str(exc.message).splitlines() if line.strip()]
            reason = lines[0].rstrip(":") if lines else type(exc).__name__
            record.msg, record.args = "refused a malformed HTTP request from %s (%d): %s", (peer, exc.code, reason)
            record.exc_info, record.exc_text = None, None
            if record.levelno > logging.WARNING:  # aiohttp's own debug records of stray traffic stay debug
                record.levelno, record.levelname = logging.WARNING, logging.getLevelName(logging.WARNING)
        return True


SERVER_LOG = logging.getLogger(__name__)
SERVER_LOG.addFilter(_OneLineParseErrors())
