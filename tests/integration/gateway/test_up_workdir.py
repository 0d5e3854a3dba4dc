"""``infergate up``'s private directory (the workers' shared token, their
ready files) does not outlive it: gone after a Ctrl-C, and after a start that
failed. Each run gets a temporary directory of the test's own (``TMPDIR``),
so what is left there is this run's."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from tests.harness import ROOT, infergate_cmd, start

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def repo(model_repo: Path, tmp_path: Path) -> Path:
    shutil.copytree(model_repo / "simple", tmp_path / "repository" / "simple")
    return tmp_path / "repository"


@pytest.fixture
def tmpdir_env(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    return tmp, {"TMPDIR": str(tmp)}


def test_ctrl_c_removes_the_token_directory(repo: Path, tmpdir_env: tuple[Path, dict[str, str]]) -> None:
    tmp, env = tmpdir_env
    proc = start(["up", "--workers", "1", "--model-repository", str(repo), "--http-port", "0", "--grpc-port", "0"],
                 env=env)
    try:
        token = Path(proc.ready["worker_token_file"])
        assert token.is_file() and token.parent.parent == tmp and token.parent.name.startswith("infergate-up-")
    finally:
        proc.popen.send_signal(signal.SIGINT)  # what a terminal's Ctrl-C sends
        rc = proc.popen.wait(timeout=60)
    assert rc == 0, proc.log()[-4000:]
    assert not token.parent.exists()
    assert list(tmp.glob("infergate-up-*")) == []


def test_a_failed_start_removes_the_token_directory(repo: Path, tmpdir_env: tuple[Path, dict[str, str]]) -> None:
    tmp, env = tmpdir_env
    # A worker that refuses its arguments: `up` has made its directory and token by then.
    cmd = infergate_cmd("up", "--workers", "1", "--model-repository", str(repo), "--http-port", "0",
                        "--grpc-port", "0", "--worker-arg=--no-such-flag")
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, **env})
    assert done.returncode == 1, done.stderr[-4000:]
    assert "infergate up: worker 0 exited with 2 while starting" in done.stderr, done.stderr[-4000:]
    assert list(tmp.glob("infergate-up-*")) == []
