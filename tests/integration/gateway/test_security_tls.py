"""TLS end to end with real processes and the real tritonclient: a certificate
authority, a server and a client certificate made in the test with the
``openssl`` command; a worker serving mutual TLS with a token and a gateway
serving TLS on both frontends (API keys on) in front of it."""

from __future__ import annotations

import shutil
import ssl
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import gevent.ssl
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.harness import Proc, start, start_worker
from tests.integration.gateway.test_security import (FULL, RESTRICTED, bearer, grpc_url, http_url, refused,
                                                     simple_inputs, write_key_files)

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command for test certificates"),
]


@pytest.fixture(scope="module")
def key_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_key_files(tmp_path_factory.mktemp("keys"))


@dataclass(frozen=True)
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _signed(cwd: Path, name: str, subject: str, extensions: str) -> None:
    (cwd / f"{name}.ext").write_text(extensions)
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject, cwd=cwd)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", "2", "-out", f"{name}.pem", "-extfile", f"{name}.ext", cwd=cwd)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    """A throwaway CA and the certificates it signs: a server one for 127.0.0.1 and a client one."""
    root = tmp_path_factory.mktemp("certs")
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=infergate test CA",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             cwd=root)
    common = "authorityKeyIdentifier=keyid\nsubjectKeyIdentifier=hash\nbasicConstraints=critical,CA:FALSE\n"
    _signed(root, "server", "/CN=localhost",
            common + "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    _signed(root, "client", "/CN=infergate gateway", common + "extendedKeyUsage=clientAuth\n")
    return Certs(root / "ca.pem", root / "server.pem", root / "server.key", root / "client.pem", root / "client.key")


@pytest.fixture(scope="module")
def tls_stack(model_repo: Path, certs: Certs, key_files: tuple[Path, Path],
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, Proc, str]]:
    """A worker with mutual TLS and a token; a TLS gateway in front of it (keys on)."""
    token_file = tmp_path_factory.mktemp("token") / "worker.token"
    token = "tls-stack-worker-token-0123456789"
    token_file.write_text(token + "\n")
    worker = start_worker(model_repo, "--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key),
                          "--tls-client-ca", str(certs.ca), "--auth-token-file", str(token_file))
    try:
        gateway = start(["gateway", "--worker", f"127.0.0.1:{worker.ready['grpc_port']}", "--http-port", "0",
                         "--grpc-port", "0", "--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key),
                         "--api-key-file", str(key_files[0]), "--worker-token-file", str(token_file),
                         "--worker-tls-ca", str(certs.ca), "--worker-tls-cert", str(certs.client_cert),
                         "--worker-tls-key", str(certs.client_key)])
        try:
            yield worker, gateway, token
        finally:
            gateway.stop()
    finally:
        worker.stop()


def test_tls_grpc_frontend(tls_stack: tuple[Proc, Proc, str], certs: Certs) -> None:
    _, gateway, _ = tls_stack
    url = grpc_url(gateway)
    client = grpcclient.InferenceServerClient(url, ssl=True, root_certificates=str(certs.ca))
    try:
        inputs, x = simple_inputs(grpcclient, rows=2)
        # Through TLS to the gateway, then mutual TLS plus the token to the worker.
        result = client.infer("simple", inputs, headers=bearer(FULL))
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), x + x)
        assert refused(lambda: client.get_server_metadata()).status() == "StatusCode.UNAUTHENTICATED"
    finally:
        client.close()
    plain = grpcclient.InferenceServerClient(url)
    try:
        assert refused(lambda: plain.is_server_live(client_timeout=10)).status() in (
            "StatusCode.UNAVAILABLE", "StatusCode.DEADLINE_EXCEEDED")
    finally:
        plain.close()


# tritonclient's HTTP library still calls ssl.match_hostname.
@pytest.mark.filterwarnings("ignore:ssl.match_hostname:DeprecationWarning")
def test_tls_http_frontend(tls_stack: tuple[Proc, Proc, str], certs: Certs) -> None:
    _, gateway, _ = tls_stack
    factory = partial(gevent.ssl.create_default_context, cafile=str(certs.ca))
    client = httpclient.InferenceServerClient(http_url(gateway), ssl=True, ssl_context_factory=factory)
    try:
        assert client.is_server_live()
        inputs, x = simple_inputs(httpclient)
        result = client.infer("simple", inputs, headers=bearer(RESTRICTED))
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), x - x)
        assert refused(lambda: client.get_model_metadata("simple")).status() == "401"
    finally:
        client.close()
    # Plain HTTP to the TLS port gets no answer of ours; an unknown CA fails the handshake.
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(f"http://{http_url(gateway)}/v2/health/live", timeout=10)
    with pytest.raises(urllib.error.URLError) as info:
        urllib.request.urlopen(f"https://{http_url(gateway)}/v2/health/live", timeout=10,
                               context=ssl.create_default_context())
    assert isinstance(info.value.reason, ssl.SSLCertVerificationError)


def test_tls_worker_needs_a_client_certificate_and_the_token(tls_stack: tuple[Proc, Proc, str], certs: Certs) -> None:
    worker, _, token = tls_stack
    url = f"127.0.0.1:{worker.ready['grpc_port']}"
    no_cert = grpcclient.InferenceServerClient(url, ssl=True, root_certificates=str(certs.ca))
    try:
        err = refused(lambda: no_cert.get_model_metadata("simple", headers=bearer(token), client_timeout=10))
        assert err.status() in ("StatusCode.UNAVAILABLE", "StatusCode.DEADLINE_EXCEEDED")
    finally:
        no_cert.close()
    with_cert = grpcclient.InferenceServerClient(url, ssl=True, root_certificates=str(certs.ca),
                                                 private_key=str(certs.client_key),
                                                 certificate_chain=str(certs.client_cert))
    try:
        assert refused(lambda: with_cert.get_model_metadata("simple")).status() == "StatusCode.UNAUTHENTICATED"
        assert with_cert.get_model_metadata("simple", headers=bearer(token)).name == "simple"
    finally:
        with_cert.close()
