"""A port already taken, end to end: ``infergate up`` with its HTTP or gRPC
port (or both) held by another socket says so in one line naming each port
and the flag that changes it, before any worker starts: at most three lines
of output, a non-zero exit without a traceback, no process left behind and
no temporary directory. ``infergate serve`` and ``infergate gateway`` name
both ports too, before loading any model; and the gateway's own bind, should
a port be taken between the check and the start, names every port taken.

The ports are held by sockets of this test (bound on port 0 and listening
for the whole run), so no other process can take them between the check and
the start.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gateway.app import start_gateway
from gateway.config import load_config
from gateway.settings import ConfigError
from tests.harness import ROOT, infergate_cmd

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def take_port() -> Iterator[Callable[[], int]]:
    """Hold a free port of 127.0.0.1 (bound and listening) until the test ends; its number."""
    sockets: list[socket.socket] = []

    def take() -> int:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        sockets.append(sock)
        return sock.getsockname()[1]

    yield take
    for sock in sockets:
        sock.close()


@pytest.fixture
def taken_port(take_port: Callable[[], int]) -> int:
    return take_port()


def _processes_naming(marker: str) -> list[int]:
    """Live processes whose command line holds ``marker`` (this test's own repository path)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if marker.encode() in cmdline:
            found.append(int(entry.name))
    return found


def _run(tmp_path: Path, model_repo: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], list[int], Path]:
    """Run ``infergate ARGS`` on a repository of this test's own (its path names every process started),
    with a temporary directory of its own; what it printed, what it left running (killed), that directory."""
    repo = tmp_path / "repository"
    if not repo.exists():
        shutil.copytree(model_repo / "simple", repo / "simple")
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    cmd = infergate_cmd(*args, "--model-repository", str(repo), "--host", "127.0.0.1")
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=90, check=False,
                              env={**os.environ, "TMPDIR": str(tmp)})
    finally:
        left = _processes_naming(str(repo))
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    return done, left, tmp


def _check_refused_before_starting(done: subprocess.CompletedProcess[str], left: list[int], tmp: Path,
                                   expected: str) -> None:
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert "Traceback" not in output, done.stderr[-4000:]
    assert [line for line in done.stderr.splitlines() if line.startswith("infergate ")] == [expected], output[-4000:]
    # Nothing started: no worker's or model's log lines, nothing left running, no token directory.
    assert len(output.splitlines()) <= 3, output[-4000:]
    assert left == [], f"processes left running: {left}"
    assert list(tmp.glob("infergate-up-*")) == []


@pytest.mark.parametrize(("flag", "protocol", "extra"), [
    ("--http-port", "HTTP", ()),
    ("--grpc-port", "gRPC", ()),
    ("--http-port", "HTTP", ("--gateway-processes", "2")),
    ("--http-port", "HTTP", ("--register",)),  # the gateway would start before the workers
])
def test_up_with_its_port_taken_says_so_in_one_line_before_starting_a_worker(
    model_repo: Path, tmp_path: Path, taken_port: int, flag: str, protocol: str, extra: tuple[str, ...]
) -> None:
    other = "--grpc-port" if flag == "--http-port" else "--http-port"
    done, left, tmp = _run(tmp_path, model_repo, "up", "--workers", "1", flag, str(taken_port), other, "0", *extra)
    _check_refused_before_starting(
        done, left, tmp, f"infergate up: {protocol} port {taken_port} is already in use: choose another with {flag}")


@pytest.mark.parametrize("command", ["up", "serve", "gateway"])
def test_both_ports_taken_are_named_together(model_repo: Path, tmp_path: Path, take_port: Callable[[], int],
                                             command: str) -> None:
    http, grpc_ = take_port(), take_port()
    done, left, tmp = _run(tmp_path, model_repo, command, "--http-port", str(http), "--grpc-port", str(grpc_))
    _check_refused_before_starting(
        done, left, tmp, f"infergate {command}: HTTP port {http} and gRPC port {grpc_} are already in use: "
                         "choose others with --http-port and --grpc-port")


async def test_the_gateways_own_bind_names_every_port_taken(take_port: Callable[[], int]) -> None:
    # Ports taken after the check (none is made here): the bind's error names both as well.
    http, grpc_ = take_port(), take_port()
    config = load_config(None, host="127.0.0.1", http_port=http, grpc_port=grpc_)
    with pytest.raises(ConfigError) as info:
        await start_gateway(config)
    assert str(info.value) == (f"HTTP port {http} and gRPC port {grpc_} are already in use: "
                               "choose others with --http-port and --grpc-port")
