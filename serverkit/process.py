"""Process plumbing that the gateway and the worker share: logging set-up,
the GIL's switch interval, the event loop policy, the ready file a parent process waits on, waiting for
the stop signal, and children that die with their parent."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)


# How long a thread may hold the GIL while another waits for it (Python's default: 5 ms).
# A server's event loop is busy most of the time under load; a model's thread whose
# ONNX Runtime run has ended waits for the GIL to hand its result back, for up to this
# long. Measured on 2 cores, 0.5 ms against the default: +9% rows/s on cnn_large at 32
# clients, +10% req/s on mlp at 64 clients (serve), +13% tokens/s of 16 generations
# (worker); see bench/results.md.
SWITCH_INTERVAL_MS = 0.5


def set_switch_interval(ms: float = SWITCH_INTERVAL_MS) -> None:
    """Shorten the GIL's switch interval (``sys.setswitchinterval``) for a serving process."""
    sys.setswitchinterval(ms / 1000)


def install_event_loop_policy() -> None:
    """uvloop where it is installed; asyncio's own loop elsewhere."""
    try:
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def write_ready_file(path: str | os.PathLike[str] | None, payload: dict[str, Any]) -> None:
    """Atomic: a reader sees no file or the whole JSON, never a partial one."""
    if not path:
        return
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, target)


def _load_prctl() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None


# Resolved at import, in the parent: the child runs die_with_parent between
# fork and exec, while other threads of the parent (gRPC's) may hold the
# dynamic loader's lock, so loading a library there could hang the child.
_PRCTL = _load_prctl()
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """``preexec_fn`` for a child process: SIGTERM it when its parent dies (Linux)."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)


async def wait_for_signal(on_forced_exit: Callable[[], None] | None = None) -> None:
    """Return on the first SIGTERM/SIGINT; a second one exits at once, after ``on_forced_exit``.

    The forced exit skips every ``finally`` and context manager of the
    process: ``on_forced_exit`` is the place for what must not outlive it
    (a directory holding a secret, say).
    """
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    count = 0

    def on_signal() -> None:
        nonlocal count
        count += 1
        if count > 1:
            logging.getLogger(__name__).warning("second signal: exiting now")
            if on_forced_exit is not None:
                on_forced_exit()
            os._exit(1)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    await stop.wait()
