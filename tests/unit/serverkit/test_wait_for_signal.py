"""serverkit/process.py's wait_for_signal: the first SIGINT returns; a second one forces the exit, after the
caller's last word (``on_forced_exit``: e.g. removing a directory that holds a secret)."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from serverkit import process


async def test_a_second_signal_runs_the_last_word_then_exits(monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []
    monkeypatch.setattr(process.os, "_exit", lambda code: events.append(f"exit {code}"))
    waiting = asyncio.create_task(process.wait_for_signal(on_forced_exit=lambda: events.append("last word")))
    await asyncio.sleep(0)  # the handlers are installed
    os.kill(os.getpid(), signal.SIGINT)
    await asyncio.wait_for(waiting, 5)
    assert events == []  # the first signal only returns: the caller stops in order
    os.kill(os.getpid(), signal.SIGINT)
    for _ in range(100):  # the handler runs on the loop, soon after the signal
        if events:
            break
        await asyncio.sleep(0.01)
    assert events == ["last word", "exit 1"]
