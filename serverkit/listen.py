"""Why a server cannot listen on its port, in one line for the person who
started it: the port, the cause and the flag that chooses another.

aiohttp hands us the bind's ``OSError``; gRPC only says that no address was
added, so there the port is probed with a plain socket to tell "already in
use" from the rest.
"""

from __future__ import annotations

import errno
import socket


def _probe(host: str, port: int) -> OSError | None:
    """The error binding ``host:port`` gives now; None when it binds."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((host, port))
    except OSError as e:
        return e
    return None


def cannot_listen(protocol: str, host: str, port: int, flag: str, error: OSError | None = None) -> str:
    """The one-line message for a ``protocol`` listener (``"HTTP"``, ``"gRPC"``) that did not start.

    ``error`` is the bind's own error where the server library gives it; without it the port is probed.
    """
    cause = error if error is not None else _probe(host, port)
    if cause is not None and cause.errno == errno.EADDRINUSE:
        return f"{protocol} port {port} is already in use: choose another with {flag}"
    reason = cause.strerror if cause is not None and cause.strerror else "the address cannot be bound"
    return f"cannot listen for {protocol} on {host}:{port} ({reason}): check the address, or choose another port with {flag}"
