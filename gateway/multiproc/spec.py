"""What the supervisor tells each gateway child, and how ports are reserved.

The spec travels as a pickle in a directory only this user can read (it
holds the group's secret and the whole config). Ports are reserved in the
parent by binding (never listening) a socket with SO_REUSEPORT: port 0
resolves once to a number every child then binds, and the reservation stays
held, so no other program takes the port between children.

A spec describes a whole gateway process, so it carries the whole config
(the child's composition root reads it); nothing else in ``multiproc`` does.
"""

from __future__ import annotations

import pickle
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from gateway.settings import ConfigError, GatewayConfig
from serverkit.listen import cannot_listen

PEER_HOST = "127.0.0.1"


@dataclass(frozen=True, slots=True)
class ProcessSpec:
    config: GatewayConfig  # http_port and grpc_port already resolved
    index: int
    peer_ports: tuple[int, ...]  # one per child, on PEER_HOST; index 0 is the leader
    secret: str
    ready_file: str
    log_level: str = "INFO"
    worker_metrics_urls: Mapping[str, str] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return len(self.peer_ports)

    def write(self, path: Path) -> None:
        path.write_bytes(pickle.dumps(self))
        path.chmod(0o600)

    @staticmethod
    def read(path: str | Path) -> ProcessSpec:
        spec = pickle.loads(Path(path).read_bytes())
        if not isinstance(spec, ProcessSpec):
            raise ConfigError(f"{path} is not a gateway process spec")
        return spec


def reserve_port(host: str, port: int, protocol: str = "", flag: str = "") -> socket.socket:
    """A bound, non-listening SO_REUSEPORT socket holding ``host:port`` (0: a free port).

    A public port names its ``protocol`` and the ``flag`` that changes it, should it be taken."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise ConfigError(f"cannot resolve listen address {host!r}: {e}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except OSError as e:
        sock.close()
        if flag:
            raise ConfigError(cannot_listen(protocol, host, port, flag, e)) from None
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    return sock
