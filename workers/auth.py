"""Who may call a worker: a shared token and/or mutual TLS, so that a
worker's port cannot be driven by strangers.

``--auth-token-file FILE``: every call must carry gRPC metadata
``authorization: Bearer TOKEN`` (the gateway sends it with
``--worker-token-file``; ``infergate up`` makes one up for its workers);
anything else is answered UNAUTHENTICATED before the service sees it. The
token is held as a SHA-256 digest and compared in constant time. The
standard health service stays open for orchestrators' probes.

``--tls-cert FILE --tls-key FILE``: TLS on the port; with
``--tls-client-ca FILE`` a client must also present a certificate signed by
that CA (mutual TLS), checked in the handshake.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from serverkit.listen import add_grpc_port

logger = logging.getLogger(__name__)

_OPEN_PREFIX = "/grpc.health.v1.Health/"
DENIED_MESSAGE = "missing or invalid worker token"


class WorkerAuthError(ValueError):
    """A token or TLS file cannot be used; the message names the file."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("access")
    group.add_argument("--auth-token-file", type=Path, default=None, metavar="FILE",
                       help="require 'authorization: Bearer TOKEN' metadata on every call (token read from FILE)")
    group.add_argument("--tls-cert", type=Path, default=None, metavar="FILE", help="PEM certificate: serve TLS")
    group.add_argument("--tls-key", type=Path, default=None, metavar="FILE", help="PEM private key of --tls-cert")
    group.add_argument("--tls-client-ca", type=Path, default=None, metavar="FILE",
                       help="PEM CA: require client certificates signed by it (mutual TLS)")


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise WorkerAuthError(f"cannot read the {what} {path}: {exc.strerror}") from None


def _token_digest(path: Path) -> bytes:
    token = _read(path, "token file").strip()
    if not token or any(chr(b).isspace() for b in token):
        raise WorkerAuthError(f"token file {path} must hold one token without white space")
    return hashlib.sha256(token).digest()


def _presented_digest(metadata: Any) -> bytes | None:
    for key, value in metadata or ():
        if key == "authorization":
            text = value if isinstance(value, bytes) else value.encode("utf-8")
            scheme, _, token = text.strip().partition(b" ")
            if scheme.lower() != b"bearer" or not token.strip():
                return None
            return hashlib.sha256(token.strip()).digest()
    return None


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Answers UNAUTHENTICATED, before the handler runs, to calls without the token."""

    def __init__(self, token_digest: bytes) -> None:
        self._digest = token_digest

    def allows(self, metadata: Any) -> bool:
        presented = _presented_digest(metadata)
        # compare_digest on equal-length digests: the time does not depend on the token.
        return presented is not None and hmac.compare_digest(presented, self._digest)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None or details.method.startswith(_OPEN_PREFIX) or self.allows(details.invocation_metadata):
            return handler
        logger.debug("refused %s: %s", details.method, DENIED_MESSAGE)
        return _denying(handler)


def _denying(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """``handler`` with its behaviour replaced by an UNAUTHENTICATED answer (same
    shape, so the request still deserializes as the client sent it)."""

    async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, DENIED_MESSAGE)

    for shape in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
        if getattr(handler, shape) is not None:
            return handler._replace(**{shape: deny})
    return handler


@dataclass(frozen=True, slots=True)
class WorkerSecurity:
    """The worker's access settings, read once at start."""

    token_digest: bytes | None = field(default=None, repr=False)
    credentials: grpc.ServerCredentials | None = None
    mutual_tls: bool = False
    # How this worker calls its peers (collective groups): the token it
    # requires, which the cluster shares, and its certificate as a client's.
    peer_token: str | None = field(default=None, repr=False)
    peer_credentials: grpc.ChannelCredentials | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "WorkerSecurity":
        token_file = getattr(args, "auth_token_file", None)
        digest = _token_digest(token_file) if token_file is not None else None
        token = _read(token_file, "token file").strip().decode() if token_file is not None else None
        cert, key, client_ca = (getattr(args, name, None) for name in ("tls_cert", "tls_key", "tls_client_ca"))
        if (cert is None) != (key is None):
            raise WorkerAuthError("--tls-cert and --tls-key go together")
        if cert is None:
            if client_ca is not None:
                raise WorkerAuthError("--tls-client-ca needs --tls-cert and --tls-key")
            return cls(digest, peer_token=token)
        pair = (_read(key, "TLS key"), _read(cert, "TLS certificate"))
        root = _read(client_ca, "client CA certificate") if client_ca is not None else None
        credentials = grpc.ssl_server_credentials([pair], root_certificates=root, require_client_auth=root is not None)
        # Peers' certificates are trusted through the client CA (one CA signs
        # the cluster's workers), else through this worker's own certificate.
        peer = grpc.ssl_channel_credentials(root_certificates=root or pair[1], private_key=pair[0],
                                            certificate_chain=pair[1])
        return cls(digest, credentials, root is not None, token, peer)

    def peer_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.peer_token}"),) if self.peer_token else ()

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [TokenInterceptor(self.token_digest)] if self.token_digest is not None else []

    def add_port(self, server: grpc.aio.Server, address: str) -> int:
        """Bind ``address``; the bound port, 0 when binding failed."""
        return add_grpc_port(server, address, self.credentials)

    def describe(self) -> str:
        parts = ["token" if self.token_digest is not None else "",
                 "mutual TLS" if self.mutual_tls else "TLS" if self.credentials is not None else ""]
        return " + ".join(p for p in parts if p) or "open (no token, no TLS)"
