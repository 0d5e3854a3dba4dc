"""Where load agents run: in the coordinator's event loop, or one per process.

``--processes N`` spreads the load over N agent processes (``spawn``, so no
process inherits the coordinator's gRPC channel or event loop). Each runs its
own uvloop event loop and client and talks to the coordinator over a pipe
(:class:`PipeLink`). Windows of latency samples travel back as pickled
float arrays and are merged by the coordinator, so percentiles stay exact.

Ctrl-C belongs to the coordinator: agent processes ignore SIGINT and stop
when told (or when their pipe closes).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import signal
import traceback
from collections.abc import Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, TypeVar

from loadtest.agent import Agent, AgentSettings
from loadtest.clients import BenchClient, ClientFactory, make_client
from loadtest.config import BenchConfig
from loadtest.inputs import Payload
from loadtest.messages import Failed, Link, LinkClosed, Shutdown, local_pair

log = logging.getLogger(__name__)

T = TypeVar("T")
_JOIN_TIMEOUT_S = 10.0


def run_with_uvloop(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine on a fresh event loop, uvloop when it is installed."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


class PipeLink:
    """One end of a multiprocessing pipe, driven by the running event loop.

    Reads happen in the loop when the pipe is readable; writes (pickling and a
    possibly blocking write of a large window) happen on one sender thread so
    the loop keeps sending requests meanwhile, and messages stay in order.
    """

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._loop = asyncio.get_running_loop()
        self._inbox: asyncio.Queue[object] = asyncio.Queue()
        self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bench-pipe")
        self._fd = conn.fileno()
        self._loop.add_reader(self._fd, self._readable)

    def _readable(self) -> None:
        try:
            while self._conn.poll():
                self._inbox.put_nowait(self._conn.recv())
        except (EOFError, OSError):
            self._loop.remove_reader(self._fd)
            self._inbox.put_nowait(Failed("the process at the other end of the pipe went away"))

    async def send(self, message: object) -> None:
        try:
            await self._loop.run_in_executor(self._sender, self._conn.send, message)
        except OSError as exc:  # BrokenPipeError and friends: the other process exited
            raise LinkClosed(str(exc)) from None

    async def recv(self) -> object:
        return await self._inbox.get()

    def close(self) -> None:
        self._loop.remove_reader(self._fd)
        self._sender.shutdown(wait=True)
        self._conn.close()


def _agent_process_main(conn: Connection, config: BenchConfig, payloads: list[Payload], index: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format=f"agent {index}: %(levelname)s %(name)s: %(message)s")
    run_with_uvloop(_agent_main(conn, config, payloads, index))


async def _agent_main(conn: Connection, config: BenchConfig, payloads: list[Payload], index: int) -> None:
    link = PipeLink(conn)
    client: BenchClient | None = None
    try:
        client = make_client(config)
        prepared = [client.prepare(p) for p in payloads]
        settings = AgentSettings(index, config.processes, config.max_outstanding, config.timeout_s)
        await Agent(link, client, prepared, settings).serve()
    except LinkClosed:
        pass  # the coordinator is gone: nobody to report to
    except Exception:  # the process's top: report, do not die silently
        with suppress(LinkClosed):
            await link.send(Failed(traceback.format_exc(limit=8)))
    finally:
        if client is not None:
            await client.close()
        link.close()


@dataclass(slots=True)
class AgentPool:
    """The agents of one run and the coordinator's end of each link."""

    links: list[Link]
    processes: list[Any] = field(default_factory=list)  # multiprocessing.Process
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    clients: list[BenchClient] = field(default_factory=list)

    async def close(self) -> None:
        """Tell every agent to shut down, then reap processes and tasks."""
        for link in self.links:
            with suppress(Exception):
                await link.send(Shutdown())
        for task in self.tasks:
            with suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(task, _JOIN_TIMEOUT_S)
        for client in self.clients:
            await client.close()
        loop = asyncio.get_running_loop()
        for proc in self.processes:
            await loop.run_in_executor(None, proc.join, _JOIN_TIMEOUT_S)
            if proc.exitcode is None:
                log.warning("agent process %s did not exit; terminating it", proc.pid)
                proc.terminate()
                await loop.run_in_executor(None, proc.join, _JOIN_TIMEOUT_S)
        for link in self.links:
            if isinstance(link, PipeLink):
                link.close()


def start_agents(config: BenchConfig, payloads: Sequence[Payload],
                 client_factory: ClientFactory = make_client) -> AgentPool:
    """One in-process agent, or ``config.processes`` agent processes."""
    if config.processes == 1:
        coordinator_end, agent_end = local_pair()
        client = client_factory(config)
        prepared = [client.prepare(p) for p in payloads]
        settings = AgentSettings(0, 1, config.max_outstanding, config.timeout_s)
        task = asyncio.create_task(Agent(agent_end, client, prepared, settings).serve(), name="bench-agent-0")
        return AgentPool(links=[coordinator_end], tasks=[task], clients=[client])
    ctx = multiprocessing.get_context("spawn")
    pool = AgentPool(links=[])
    for index in range(config.processes):
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        proc = ctx.Process(target=_agent_process_main, args=(child_conn, config, list(payloads), index),
                           name=f"bench-agent-{index}", daemon=True)
        proc.start()
        child_conn.close()  # the child holds its own copy; ours would hide its EOF
        pool.processes.append(proc)
        pool.links.append(PipeLink(parent_conn))
    return pool
