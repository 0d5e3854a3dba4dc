"""How the gateway process puts its security together: the command-line
flags, the parts built from the config (key store, TLS contexts) and where
they go (the HTTP app's middleware list, the gRPC server's interceptors and
port, the worker clients' token and channel credentials).

Nothing configured means nothing installed: no middleware, no interceptor,
plain-text ports, as before. Keys live in ``gateway.security.api_keys``; TLS files in
``gateway.security.tls``; the worker's side in ``workers.auth``.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from aiohttp import web

from gateway.replicas.openai_server import OpenAIServer
from gateway.replicas.replica import Replica
from gateway.replicas.worker_client import WorkerClient
from gateway.security.api_keys import KeyStore, load_key_store
from gateway.security.frontend_auth import GrpcAuthInterceptor, http_auth_middleware
from gateway.security.tls import grpc_channel_credentials, grpc_server_credentials, server_ssl_context
from gateway.settings import ConfigError, SecuritySettings, WorkerSpec
from serverkit.listen import add_grpc_port

log = logging.getLogger(__name__)

# The metadata key the gateway sends its worker token in, as "Bearer TOKEN".
WORKER_TOKEN_HEADER = "authorization"

_PATH_FLAGS = (
    ("--api-key-file", "api_key_file", "API keys, one a line: KEY [MODEL,...] [rate=N/s] [burst=N] [name=LABEL]"),
    ("--admin-key-file", "admin_key_file", "admin keys (KEY [name=LABEL] a line) for /metrics, /dashboard, "
                                           "/v2/cluster and repository control"),
    ("--tls-cert", "tls_cert", "PEM certificate (chain) for TLS on the HTTP and gRPC frontends"),
    ("--tls-key", "tls_key", "PEM private key of --tls-cert"),
    ("--worker-token-file", "worker_token_file", "shared token sent to the workers on every call"),
    ("--worker-tls-ca", "worker_tls_ca", "PEM CA certificate that signed the workers' certificates (TLS to workers)"),
    ("--worker-tls-cert", "worker_tls_cert", "PEM client certificate for mutual TLS to the workers"),
    ("--worker-tls-key", "worker_tls_key", "PEM private key of --worker-tls-cert"),
)


def add_security_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("security (docs/security.md)")
    for flag, dest, meaning in _PATH_FLAGS:
        group.add_argument(flag, dest=dest, default=None, metavar="FILE", help=meaning)


def security_overrides(args: argparse.Namespace) -> dict[str, dict[str, str | None]]:
    """The flags as ``load_config`` overrides of the ``security`` group; paths made
    absolute here, as relative paths in a config file are taken relative to that file."""
    return {"security": {dest: str(Path(value).resolve()) if (value := getattr(args, dest, None)) else None
                         for _, dest, _ in _PATH_FLAGS}}


@dataclass(frozen=True, slots=True)
class GatewaySecurity:
    """The frontends' security, built once from the config at start."""

    keys: KeyStore | None = None
    ssl_context: ssl.SSLContext | None = None
    grpc_credentials: grpc.ServerCredentials | None = None

    @classmethod
    def from_settings(cls, security: SecuritySettings, host: str) -> "GatewaySecurity":
        """Read every key and certificate file now: a bad one stops the start (ConfigError).
        ``host``: the address the frontends listen on (keys in clear text beyond loopback are warned of)."""
        keys = load_key_store(security)
        if security.tls_cert:
            context = server_ssl_context(security.tls_cert, security.tls_key)
            credentials = grpc_server_credentials(security.tls_cert, security.tls_key)
            return cls(keys, context, credentials)
        if keys is not None and host not in ("127.0.0.1", "localhost", "::1"):
            log.warning("API keys are on but TLS is off: keys cross the network in clear text (set --tls-cert)")
        return cls(keys)

    def grpc_interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [GrpcAuthInterceptor(self.keys)] if self.keys is not None else []

    def install_http(self, app: web.Application) -> None:
        """Append the auth middleware (inside the error middleware); call before the app starts."""
        if self.keys is not None:
            app.middlewares.append(http_auth_middleware(self.keys))

    def add_grpc_port(self, server: grpc.aio.Server, address: str) -> int:
        """Bind ``address`` (TLS when configured); the bound port, 0 when binding failed."""
        return add_grpc_port(server, address, self.grpc_credentials)


def worker_token(security: SecuritySettings) -> str:
    """The token workers accept from this gateway (``worker_token`` or the first line of
    ``worker_token_file``), "" when none is configured."""
    if security.worker_token:
        return security.worker_token
    if not security.worker_token_file:
        return ""
    try:
        token = Path(security.worker_token_file).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read the worker token file {security.worker_token_file}: {exc}") from None
    if not token or any(c.isspace() for c in token):
        raise ConfigError(f"worker token file {security.worker_token_file} "
                          "must hold one token without white space")
    return token


def worker_client_factory(security: SecuritySettings, *, stream_calls: bool, packed_streams: bool,
                          worker_keepalive_s: float, triton_keepalive_s: float) -> Callable[[WorkerSpec], Replica]:
    """Makes each worker's client with the token (infergate workers only: a
    Triton server has no use for it) and the TLS credentials, when configured;
    ``stream_calls`` and ``packed_streams``: the config's ``worker_calls`` and ``worker_streams``;
    the keepalive period of a channel to an infergate worker and to a Triton server. An
    OpenAI-protocol server's replica carries its own headers and API key."""
    token = worker_token(security)
    credentials = None
    if security.worker_tls_ca or security.worker_tls_cert:
        credentials = grpc_channel_credentials(security.worker_tls_ca, security.worker_tls_cert,
                                               security.worker_tls_key)

    def make(spec: WorkerSpec) -> Replica:
        if spec.kind == "openai":
            return OpenAIServer.for_spec(spec)
        headers: dict[str, Any] = dict(spec.headers)
        if token and spec.kind == "infergate":
            headers.setdefault(WORKER_TOKEN_HEADER, f"Bearer {token}")
        keepalive_s = triton_keepalive_s if spec.kind == "triton" else worker_keepalive_s
        return WorkerClient(spec.address, kind=spec.kind, headers=headers, credentials=credentials,
                            keepalive_ms=round(keepalive_s * 1000),
                            stream_calls=stream_calls,
                            packed_streams=packed_streams)

    return make


def local_worker_token(workdir: Path, security: SecuritySettings) -> Path:
    """The token file ``infergate up`` gives its workers and its gateway: the
    configured one, else a file in ``workdir`` (readable by this user only)
    holding the token from the environment or a fresh random one."""
    if security.worker_token_file:
        worker_token(security)  # checks the file now, before any worker starts
        return Path(security.worker_token_file)
    path = workdir / "worker.token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write((security.worker_token or secrets.token_urlsafe(32)) + "\n")
    return path
