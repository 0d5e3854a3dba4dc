"""Listening on a port, and saying why a server cannot, in one line for the
person who started it: the port, the cause and the flag that chooses another.

aiohttp hands us the bind's ``OSError``; gRPC only says that no address was
added, so there the port is probed with a plain socket to tell "already in
use" from the rest. :func:`unavailable_ports` probes a server's every
listener before anything starts, so one line names each port that is taken.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Sequence
from dataclasses import dataclass

import grpc


@dataclass(frozen=True, slots=True)
class Listener:
    """A port a server will listen on: what it serves (``"HTTP"``) and the flag that chooses it."""

    protocol: str
    port: int
    flag: str


def _probe(host: str, port: int) -> OSError | None:
    """The error binding ``host:port`` gives now; None when it binds."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((host, port))
    except OSError as e:
        return e
    return None


def _probe_as_a_server(host: str, port: int) -> OSError | None:
    """The error a server's bind of ``host:port`` would meet now (SO_REUSEADDR, as aiohttp and gRPC bind)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
    except OSError as e:  # socket.gaierror included: a host that does not resolve
        return e
    return None


def unavailable_ports(host: str, listeners: Sequence[Listener]) -> str | None:
    """One line naming every listener whose port cannot be bound on ``host`` now; None when each can.

    A port of 0 (any free port) always can. Checked before a server starts
    anything, so a clash costs no worker and no model load; a port taken in
    between still fails at the real bind, in :func:`cannot_listen`'s words.
    """
    failures = []
    for listener in listeners:
        if listener.port == 0:
            continue
        error = _probe_as_a_server(host, listener.port)
        if error is not None:
            failures.append((listener, error))
    return cannot_listen_on(host, failures) if failures else None


def cannot_listen_on(host: str, failures: Sequence[tuple[Listener, OSError | None]]) -> str:
    """The one line for several listeners that cannot start (``error`` None: probe the port)."""
    causes = [(listener, error if error is not None else _probe(host, listener.port)) for listener, error in failures]
    if len(causes) > 1 and all(e is not None and e.errno == errno.EADDRINUSE for _, e in causes):
        ports = " and ".join(f"{listener.protocol} port {listener.port}" for listener, _ in causes)
        flags = " and ".join(listener.flag for listener, _ in causes)
        return f"{ports} are already in use: choose others with {flags}"
    return "; ".join(cannot_listen(listener.protocol, host, listener.port, listener.flag, error)
                     for listener, error in causes)


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
