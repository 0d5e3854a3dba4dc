"""The Python stream snippets of README.md and docs/streaming.md, read from
the pages themselves and run as a user runs them (only the gRPC address is
this cluster's): each prints what its page says, and one interrupted with
Ctrl-C mid-stream ends at once, its ``finally`` cancelling the request,
instead of waiting for the model to finish (plain ``stop_stream()`` waits)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import ROOT, Proc, start
from tests.integration.gateway.e2e_cluster import grpc_url

pytestmark = pytest.mark.timeout(180)

# What the delays of docs/streaming.md's request become here: long enough that waiting for the
# stream to finish (about 3 x 20 s) is told apart from ending at once.
LONG_DELAYS = "[100, 20000, 20000, 20000]"


@pytest.fixture(scope="module")
def cluster(model_repo: Path) -> Iterator[Proc]:
    proc = start(["up", "--workers", "1", "--model-repository", str(model_repo), "--http-port", "0", "--grpc-port", "0"])
    try:
        yield proc
    finally:
        proc.stop()


def stream_snippet(page: str, cluster: Proc) -> str:
    """The page's one ```python block that opens a tritonclient stream, aimed at ``cluster``."""
    blocks = [b for b in re.findall(r"```python\n(.*?)```", (ROOT / page).read_text(), re.S) if "start_stream" in b]
    assert len(blocks) == 1, f"{page}: {len(blocks)} stream snippets"
    assert '"localhost:8001"' in blocks[0]
    return blocks[0].replace('"localhost:8001"', f'"{grpc_url(cluster)}"')


# Ctrl-C as a terminal leaves it: a program started in a shell's background job (a suite run
# with `make test &`) inherits SIGINT ignored, and Python then installs no KeyboardInterrupt
# handler. The snippet starts through this, which sets SIGINT back to its default and execs it.
_CTRL_C_AT_DEFAULT = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.executable, sys.argv[1:])"


def run_snippet(code: str) -> subprocess.Popen[str]:
    # -X faulthandler: a snippet that hangs can be made to print every thread's stack (SIGABRT).
    return subprocess.Popen([sys.executable, "-c", _CTRL_C_AT_DEFAULT, sys.executable, "-u", "-X", "faulthandler",
                             "-c", code], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def stacks_of_hung(snippet: subprocess.Popen[str]) -> str:
    """What a snippet that did not exit in time was doing: its threads' stacks, as faulthandler
    prints them on SIGABRT, and whatever it wrote before."""
    snippet.send_signal(signal.SIGABRT)
    try:
        out, err = snippet.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        snippet.kill()
        out, err = snippet.communicate()
    return f"stdout:\n{out}\nstderr:\n{err}"


def test_the_readme_snippet_prints_what_the_readme_says(cluster: Proc) -> None:
    snippet = run_snippet(stream_snippet("README.md", cluster))
    out, err = snippet.communicate(timeout=60)
    assert snippet.returncode == 0, err
    assert out.split() == ["[3]", "[3]", "[3]", "final"]


def test_the_streaming_page_snippet_prints_what_the_page_says(cluster: Proc) -> None:
    snippet = run_snippet(stream_snippet("docs/streaming.md", cluster))
    out, err = snippet.communicate(timeout=60)
    assert snippet.returncode == 0, err
    assert out.splitlines() == [f"OUT={v} IDX={i} final=False" for i, v in enumerate([4, 2, 0, 1])]


def test_ctrl_c_mid_stream_ends_the_snippet_at_once(cluster: Proc) -> None:
    code = stream_snippet("docs/streaming.md", cluster)
    assert "[100, 200, 300, 400]" in code
    snippet = run_snippet(code.replace("[100, 200, 300, 400]", LONG_DELAYS))
    try:
        assert snippet.stdout is not None
        assert snippet.stdout.readline() == "OUT=4 IDX=0 final=False\n"  # the stream is under way
        interrupted = time.monotonic()
        snippet.send_signal(signal.SIGINT)  # what a terminal's Ctrl-C sends
        try:
            _, err = snippet.communicate(timeout=15)  # well before the next response is due
        except subprocess.TimeoutExpired:
            pytest.fail(f"no exit 15 s after Ctrl-C; {stacks_of_hung(snippet)}")
    finally:
        if snippet.poll() is None:
            snippet.kill()
            snippet.wait()
    assert "KeyboardInterrupt" in err, err
    assert time.monotonic() - interrupted < 15
