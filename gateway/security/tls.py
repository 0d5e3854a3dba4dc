"""TLS material of the gateway: the frontends' server side (an
``ssl.SSLContext`` for aiohttp, ``grpc.ServerCredentials`` for grpc.aio, from
one certificate and key) and the client side towards the workers (channel
credentials: the CA that signed the workers' certificates, and optionally a
client certificate and key for mutual TLS).

Files are PEM and read once, at start; a file that cannot be read or a key
that does not match its certificate is a ``ConfigError`` naming the file.
"""

from __future__ import annotations

import ssl
from pathlib import Path

import grpc

from gateway.settings import ConfigError


def read_pem(path: str, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read the {what} {path}: {exc.strerror}") from None
    if b"-----BEGIN" not in data:
        raise ConfigError(f"the {what} {path} is not PEM")
    return data


def server_ssl_context(cert_path: str, key_path: str) -> ssl.SSLContext:
    """The HTTP frontend's context: TLS 1.2 or newer, no client certificate asked for."""
    read_pem(cert_path, "TLS certificate")
    read_pem(key_path, "TLS key")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert_path, key_path)
    except ssl.SSLError as exc:
        raise ConfigError(f"TLS certificate {cert_path} and key {key_path} do not load: {exc.reason or exc}") from None
    return context


def grpc_server_credentials(cert_path: str, key_path: str) -> grpc.ServerCredentials:
    """The gRPC frontend's credentials from the same certificate and key."""
    pair = (read_pem(key_path, "TLS key"), read_pem(cert_path, "TLS certificate"))
    return grpc.ssl_server_credentials([pair])


def grpc_channel_credentials(ca_path: str = "", cert_path: str = "", key_path: str = "") -> grpc.ChannelCredentials:
    """Credentials for channels to the workers.

    ``ca_path`` verifies the workers' certificates (the system roots when
    empty); ``cert_path``/``key_path`` present a client certificate, for
    workers that require one (mutual TLS).
    """
    root = read_pem(ca_path, "worker CA certificate") if ca_path else None
    key = read_pem(key_path, "worker client key") if key_path else None
    chain = read_pem(cert_path, "worker client certificate") if cert_path else None
    return grpc.ssl_channel_credentials(root_certificates=root, private_key=key, certificate_chain=chain)
