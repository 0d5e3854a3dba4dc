"""Listening on a port, and saying why a server cannot, in one line for the
person who started it: the port, the cause and the flag that chooses another.

aiohttp hands us the bind's ``OSError``; gRPC only says that no address was
added, so there the port is probed with a plain socket to tell "already in
use" from the rest.
"""

from __future__ import annotations

import errno
import socket

import grpc


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


def add_grpc_port(server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None) -> int:
    """Bind ``address`` (TLS with ``credentials``); the bound port, 0 when binding failed."""
    try:
        if credentials is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, credentials)
    except RuntimeError:  # grpcio raises where older releases returned 0
        return 0
