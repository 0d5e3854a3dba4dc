"""What the coordinator and its load agents say to each other, and the in-process link.

One level runs as this exchange (the same whether the agent lives in the
coordinator's event loop or in another process):

    coordinator            agent
    LevelPlan   ------->   warm up, wait for the warmup requests to finish
                <-------   Ready
    (snapshot server statistics)
    Go(t0)      ------->   load starts at t0 (a shared monotonic instant)
                <-------   WindowReport(k)   at t0 + (k+1)*interval (time windows)
    Stop        ------->   stop sending, drain or cancel what is in flight
                <-------   Final             (the partial window, CPU time)

With ``--request-count`` there are no windows: the agent sends ``Final`` as
soon as its share of requests has completed; a ``Stop`` that crosses it (on
Ctrl-C) is ignored by an idle agent. ``Failed`` carries an agent's crash.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Protocol

from loadtest.config import Distribution, LoadMode
from loadtest.latency import Window


@dataclass(frozen=True, slots=True)
class LevelPlan:
    index: int
    mode: LoadMode
    concurrency: int  # this agent's share (closed loop); 0 leaves it idle
    total_rate: float  # the whole run's rate (open loop); the agent takes its share
    distribution: Distribution
    count: int  # this agent's share of requests; 0 means time windows
    warmup_s: float
    warmup_requests: int  # this agent's share
    interval_s: float
    seed: int


@dataclass(frozen=True, slots=True)
class Ready:
    pass


@dataclass(frozen=True, slots=True)
class Go:
    t0: float  # time.monotonic(), system-wide on Linux and macOS


@dataclass(frozen=True, slots=True)
class WindowReport:
    index: int
    window: Window


@dataclass(frozen=True, slots=True)
class Stop:
    pass


@dataclass(frozen=True, slots=True)
class Final:
    window: Window = field(default_factory=Window)
    cpu_s: float = 0.0  # process CPU time (all threads) while load ran
    wall_s: float = 0.0
    last_done: float = 0.0  # monotonic time of the last completion; 0 if none


@dataclass(frozen=True, slots=True)
class Shutdown:
    pass


@dataclass(frozen=True, slots=True)
class Failed:
    message: str


class LinkClosed(Exception):
    """The other end of a link is gone (its process exited)."""


class Link(Protocol):
    async def send(self, message: object) -> None: ...
    async def recv(self) -> object: ...


class LocalLink:
    """One end of an in-process link: two unbounded queues on one event loop.

    Unbounded is safe here: each side sends at most a handful of messages
    before waiting for the other.
    """

    def __init__(self, inbox: asyncio.Queue[object], outbox: asyncio.Queue[object]) -> None:
        self._inbox = inbox
        self._outbox = outbox

    async def send(self, message: object) -> None:
        self._outbox.put_nowait(message)

    async def recv(self) -> object:
        return await self._inbox.get()


def local_pair() -> tuple[LocalLink, LocalLink]:
    """(coordinator end, agent end) of an in-process link."""
    down: asyncio.Queue[object] = asyncio.Queue()
    up: asyncio.Queue[object] = asyncio.Queue()
    return LocalLink(up, down), LocalLink(down, up)
