"""Peer collectives between workers that require mutual TLS: two workers
with ``--tls-cert/--tls-key/--tls-client-ca`` and a worker token, a gateway
that calls them with its own client certificate, and ``encoder`` split TP2
on peer collectives. The ranks exchange their partial sums with their own
certificate as the client certificate: the answer equals the unsplit model
and the peer byte counter moves (the batch ran on the peers, not on the
gateway's star). The worker certificate must allow client authentication
too (extended key usage ``serverAuth,clientAuth``). A caller with the worker
certificate may open the ``Exchange`` stream a peer sends on; one with no
client certificate, or with one from another authority, cannot.
"""

from __future__ import annotations

import shutil
import subprocess
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException
from prometheus_client.parser import text_string_to_metric_families

from protos.collective_pb2 import PeerMessage
from protos.collective_pb2_grpc import CollectiveStub
from tests.harness import Proc, start, start_worker, worker_url

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command for test certificates"),
]

TOKEN = "peer-tls-worker-token-0123456789"


@dataclass(frozen=True)
class Certs:
    ca: Path
    worker_cert: Path  # serverAuth and clientAuth: a worker serves with it and calls its peers with it
    worker_key: Path
    gateway_cert: Path
    gateway_key: Path
    stranger_cert: Path  # clientAuth, signed by another authority
    stranger_key: Path
    server_only_cert: Path  # serverAuth alone: peers refuse it as a client certificate
    server_only_key: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _authority(cwd: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN=infergate {name}",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             cwd=cwd)


def _signed(cwd: Path, name: str, ca: str, subject: str, usage: str) -> None:
    extensions = ("authorityKeyIdentifier=keyid\nsubjectKeyIdentifier=hash\nbasicConstraints=critical,CA:FALSE\n"
                  f"subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage={usage}\n")
    (cwd / f"{name}.ext").write_text(extensions)
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject, cwd=cwd)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-days", "2", "-out", f"{name}.pem", "-extfile", f"{name}.ext", cwd=cwd)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    root = tmp_path_factory.mktemp("peer-certs")
    _authority(root, "ca")
    _authority(root, "other-ca")
    _signed(root, "worker", "ca", "/CN=infergate worker", "serverAuth,clientAuth")
    _signed(root, "gateway", "ca", "/CN=infergate gateway", "clientAuth")
    _signed(root, "stranger", "other-ca", "/CN=infergate worker", "clientAuth")
    _signed(root, "server-only", "ca", "/CN=infergate worker", "serverAuth")
    return Certs(root / "ca.pem", root / "worker.pem", root / "worker.key", root / "gateway.pem",
                 root / "gateway.key", root / "stranger.pem", root / "stranger.key", root / "server-only.pem",
                 root / "server-only.key")


@contextmanager
def serving(model_repo: Path, certs: Certs, tmp: Path, worker_cert: Path, worker_key: Path) -> Iterator[tuple[list[Proc], Proc]]:
    """Two mutual-TLS workers and a gateway serving encoder_tp2 on them over peer collectives."""
    token_file = tmp / "worker.token"
    token_file.write_text(TOKEN + "\n")
    config = tmp / "gateway.yaml"
    config.write_text("models:\n  encoder_tp2: {from: encoder, tensor_parallel: 2}\n")
    workers: list[Proc] = []
    try:
        for _ in range(2):
            workers.append(start_worker(model_repo, "--tls-cert", str(worker_cert), "--tls-key",
                                        str(worker_key), "--tls-client-ca", str(certs.ca),
                                        "--auth-token-file", str(token_file), "--intra-op-threads", "1",
                                        "--model-control-mode", "explicit"))
        gateway = start(["gateway", *(a for w in workers for a in ("--worker", worker_url(w))),
                         "--http-port", "0", "--grpc-port", "0", "--config", str(config),
                         "--model-repository", str(model_repo), "--worker-token-file", str(token_file),
                         "--worker-tls-ca", str(certs.ca), "--worker-tls-cert", str(certs.gateway_cert),
                         "--worker-tls-key", str(certs.gateway_key)])
        try:
            yield workers, gateway
        finally:
            gateway.stop()
    finally:
        for worker in workers:
            worker.stop()


@pytest.fixture(scope="module")
def stack(model_repo: Path, certs: Certs, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[Proc], Proc]]:
    with serving(model_repo, certs, tmp_path_factory.mktemp("peer-tls"), certs.worker_cert, certs.worker_key) as procs:
        yield procs


def peer_bytes(gateway: Proc) -> float:
    url = f"http://127.0.0.1:{gateway.ready['http_port']}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "infergate_parallel_peer_bytes_total" and s.labels.get("model") == "encoder_tp2")


def test_tp2_runs_on_peers_that_require_mutual_tls(stack: tuple[list[Proc], Proc], model_repo: Path) -> None:
    _, gateway = stack
    session = ort.InferenceSession(str(model_repo / "encoder" / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{gateway.ready['grpc_port']}")
    try:
        before = peer_bytes(gateway)
        for seed, (rows, seq) in enumerate([(1, 5), (3, 11)]):
            x = np.random.default_rng(seed).integers(0, 100, size=(rows, seq)).astype(np.int64)
            tokens = grpcclient.InferInput("TOKENS", list(x.shape), "INT64")
            tokens.set_data_from_numpy(x)
            got = client.infer("encoder_tp2", [tokens]).as_numpy("HIDDEN")
            np.testing.assert_allclose(got, session.run(["HIDDEN"], {"TOKENS": x})[0], atol=1e-4, rtol=0)
    finally:
        client.close()
    assert peer_bytes(gateway) > before  # the ranks exchanged over their TLS streams


def send_part(worker: Proc, credentials: grpc.ChannelCredentials) -> None:
    """Open an ``Exchange`` stream to ``worker`` as a peer would (token included) and send one part."""
    with grpc.secure_channel(worker_url(worker), credentials) as channel:
        CollectiveStub(channel).Exchange(iter([PeerMessage(group_id="no-such-group", epoch=1)]),
                                         metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=10)


def test_a_peer_with_the_worker_certificate_is_let_in(stack: tuple[list[Proc], Proc], certs: Certs) -> None:
    send_part(stack[0][0], grpc.ssl_channel_credentials(root_certificates=certs.ca.read_bytes(),
                                                        private_key=certs.worker_key.read_bytes(),
                                                        certificate_chain=certs.worker_cert.read_bytes()))


@pytest.mark.parametrize("client_cert", ["none", "other authority"])
def test_a_peer_without_a_valid_client_certificate_is_refused(stack: tuple[list[Proc], Proc], certs: Certs,
                                                              client_cert: str) -> None:
    workers, _ = stack
    root = certs.ca.read_bytes()
    if client_cert == "none":
        credentials = grpc.ssl_channel_credentials(root_certificates=root)
    else:
        credentials = grpc.ssl_channel_credentials(root_certificates=root, private_key=certs.stranger_key.read_bytes(),
                                                   certificate_chain=certs.stranger_cert.read_bytes())
    with pytest.raises(grpc.RpcError) as refused:
        send_part(workers[0], credentials)
    # The handshake fails before any call: the worker never sees the part.
    assert refused.value.code() is grpc.StatusCode.UNAVAILABLE, refused.value.details()


def test_a_worker_certificate_peers_refuse_fails_naming_the_cause(model_repo: Path, certs: Certs, tmp_path: Path) -> None:
    with serving(model_repo, certs, tmp_path, certs.server_only_cert, certs.server_only_key) as (_, gateway):
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{gateway.ready['grpc_port']}")
        try:
            tokens = grpcclient.InferInput("TOKENS", [1, 4], "INT64")
            tokens.set_data_from_numpy(np.zeros((1, 4), np.int64))
            with pytest.raises(InferenceServerException) as failed:
                client.infer("encoder_tp2", [tokens], client_timeout=60)
        finally:
            client.close()
    assert failed.value.status() == "StatusCode.UNAVAILABLE"
    message = failed.value.message() or ""
    assert "peer 127.0.0.1:" in message and "client certificate" in message, message
