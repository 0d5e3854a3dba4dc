"""Process plumbing that the gateway and the worker share: logging set-up,
the event loop policy, and the ready file a parent process waits on."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any


def setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)


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
