"""Start and stop real infergate processes for integration tests.

Every process binds port 0 and reports its real ports in a JSON ready file
(written atomically once it serves); we wait on that file and on the process
being alive, never on a sleep. ``stop()`` sends SIGTERM and checks a clean exit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 90.0


@dataclass
class Proc:
    popen: subprocess.Popen
    ready: dict[str, Any]
    log_path: Path
    args: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout_s: float = 30.0, check: bool = True) -> int:
        """SIGTERM, wait, and (by default) assert a clean exit."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
                raise AssertionError(f"process {self.args} did not exit on SIGTERM\n{self.log()[-4000:]}")
        rc = self.popen.returncode
        if check:
            assert rc == 0, f"process {self.args} exited {rc}\n{self.log()[-4000:]}"
        return rc

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            if sig in (signal.SIGKILL, signal.SIGTERM):
                self.popen.wait(timeout=30)


def infergate_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "infergate", *args]


def start(args: list[str], *, env: dict[str, str] | None = None, timeout_s: float = START_TIMEOUT_S,
          prefix: list[str] | None = None, module: str = "infergate") -> Proc:
    """Start ``infergate ARGS --ready-file F`` (or ``python -m MODULE ...``) and wait until F appears.

    ``prefix`` runs it through another command that execs it in place (e.g.
    ``ip netns exec NS``), so the process started is still the one stopped.
    """
    tmpdir = Path(tempfile.mkdtemp(prefix="infergate-test-"))
    ready_file = tmpdir / "ready.json"
    log_path = tmpdir / "process.log"
    full_env = dict(os.environ)
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    if env:
        full_env.update(env)
    cmd = [*(prefix or ()), sys.executable, "-m", module, *args, "--ready-file", str(ready_file)]
    log = open(log_path, "wb")
    popen = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    proc = Proc(popen=popen, ready={}, log_path=log_path, args=cmd)
    deadline = time.monotonic() + timeout_s
    while True:
        if ready_file.exists():
            proc.ready = json.loads(ready_file.read_text())
            return proc
        if popen.poll() is not None:
            raise RuntimeError(f"{cmd} exited {popen.returncode} before it was ready:\n{proc.log()[-4000:]}")
        if time.monotonic() > deadline:
            popen.kill()
            popen.wait()
            raise RuntimeError(f"{cmd} not ready after {timeout_s}s:\n{proc.log()[-4000:]}")
        # Waiting on a condition (the ready file), polled; not a sleep standing in for readiness.
        time.sleep(0.05)


def start_together(starts: Sequence[Callable[[], Proc]]) -> list[Proc]:
    """Run several starts at once (each still waits on its own ready file); the processes, in order.

    Processes start faster side by side than one after another. If any start
    fails, those that did start are killed and the first failure is raised.
    """
    with ThreadPoolExecutor(max(1, len(starts))) as pool:
        futures = [pool.submit(s) for s in starts]
    failures = [f.exception() for f in futures if f.exception() is not None]
    if failures:
        for f in futures:
            if f.exception() is None:
                f.result().kill()
        raise failures[0]
    return [f.result() for f in futures]


def start_worker(model_repository: str | Path, *extra: str, env: dict[str, str] | None = None) -> Proc:
    """A worker on 127.0.0.1 with an ephemeral port; ``proc.ready['grpc_port']``."""
    return start(["worker", "--model-repository", str(model_repository), "--host", "127.0.0.1", "--port", "0", *extra], env=env)


def worker_url(proc: Proc) -> str:
    return f"127.0.0.1:{proc.ready['grpc_port']}"
