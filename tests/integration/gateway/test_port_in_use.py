"""A port already taken, end to end: ``infergate up`` with its HTTP or gRPC
port held by another socket says so in one line naming the port and the flag
that changes it, exits non-zero without a traceback, and leaves none of the
processes it started behind.

The port is held by a socket of this test (bound and listening for the whole
run), so no other process can take it between the check and the start.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import ROOT, infergate_cmd

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


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


@pytest.mark.parametrize(("flag", "protocol", "extra"), [
    ("--http-port", "HTTP", ()),
    ("--grpc-port", "gRPC", ()),
    ("--http-port", "HTTP", ("--gateway-processes", "2")),  # the ports reserved before the processes start
])
def test_up_with_its_port_taken_says_so_in_one_line(
    model_repo: Path, tmp_path: Path, taken_port: int, flag: str, protocol: str, extra: tuple[str, ...]
) -> None:
    # A repository of this test's own: its path names every process `up` starts.
    repo = tmp_path / "repository"
    shutil.copytree(model_repo / "simple", repo / "simple")
    other = "--grpc-port" if flag == "--http-port" else "--http-port"
    cmd = infergate_cmd("up", "--workers", "1", "--model-repository", str(repo), "--host", "127.0.0.1",
                        flag, str(taken_port), other, "0", *extra)
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=90, check=False)
    finally:
        left = _processes_naming(str(repo))
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    assert done.returncode != 0
    assert "Traceback" not in done.stdout + done.stderr, done.stderr[-4000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("infergate up:")]
    assert errors == [f"infergate up: {protocol} port {taken_port} is already in use: choose another with {flag}"], \
        done.stderr[-4000:]
    # The worker it started first is stopped, not left running (nor killed here).
    assert left == [], f"processes left running: {left}"
