"""A load agent: generates one process's share of the load and measures it.

Closed loop (concurrency N): N coroutines, each sending its next request as
soon as the previous one is answered; latency is answer time minus send time.
Open loop (request rate): one dispatcher follows the schedule and starts a
task per request; latency is answer time minus the request's *scheduled*
time, so when the client or server falls behind, the wait shows up as
latency instead of silently lowering the offered load. Requests in flight are
capped (``max_outstanding``); at the cap the dispatcher waits, and that wait
too is counted in latency.

All of it runs on one event loop. Results go into the phase's current
:class:`Window`; the ticker swaps in a fresh window at each boundary. Because
completions and the swap run on the same loop, a completion lands in exactly
one window (the one current when it finished), never in two or none.
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
from collections.abc import Iterator, Sequence
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

from loadtest.clients import BenchClient
from loadtest.config import LoadMode
from loadtest.latency import Window
from loadtest.messages import Failed, Final, Go, LevelPlan, Link, LinkClosed, Ready, Shutdown, Stop, WindowReport
from loadtest.schedule import offsets

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class AgentSettings:
    index: int  # this agent's place among the processes
    processes: int
    max_outstanding: int
    timeout_s: float

    @property
    def drain_s(self) -> float:
        # How long a stopped level waits for requests in flight before cancelling them.
        return min(self.timeout_s, 5.0)


async def sleep_until(deadline: float) -> None:
    delay = deadline - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)


class _Phase:
    """One stretch of load: warmup or measurement of one level."""

    def __init__(self, tickets: int | None) -> None:
        self.running = True
        self.tickets = tickets  # requests left to send; None = until stopped
        self.window = Window()
        self.drivers: list[asyncio.Task[None]] = []
        self.dispatcher: asyncio.Task[None] | None = None  # open loop only
        self.requests: set[asyncio.Task[None]] = set()  # open loop: requests in flight
        # Open-loop requests not yet answered. Counted by the request itself, not
        # from ``requests`` (whose done-callbacks run a loop turn later), so the
        # dispatcher never sleeps on a slot that has already been freed.
        self.in_flight = 0
        self.slot_free = asyncio.Event()
        self.last_done = 0.0

    def take(self) -> bool:
        if not self.running:
            return False
        if self.tickets is None:
            return True
        if self.tickets <= 0:
            return False
        self.tickets -= 1
        return True

    def record(self, started: float, ended: float, error: str | None) -> None:
        if error is None:
            self.window.samples.append(ended - started)
        else:
            self.window.add_error(error)
        self.last_done = ended

    async def completed(self) -> None:
        """Return once every driver has finished and nothing is in flight.

        Drivers are awaited with ``wait``, not ``gather``: a dispatcher cancelled
        by ``stop`` is a normal end, while a driver that crashed re-raises here.
        """
        if self.drivers:
            await asyncio.wait(self.drivers)
        for task in self.drivers:
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        while self.requests:
            await asyncio.wait(list(self.requests))

    async def stop(self, grace_s: float) -> None:
        """Stop sending; give requests in flight ``grace_s`` to finish, then cancel them."""
        self.running = False
        self.slot_free.set()
        if self.dispatcher is not None:
            # It may be sleeping until a far-off due time: no more sends either way.
            self.dispatcher.cancel()
        # No new request task can appear now: the dispatcher is cancelled and
        # closed-loop workers send nothing once ``running`` is False.
        tasks = [t for t in (*self.drivers, *self.requests) if not t.done()]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=grace_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        for task in self.drivers:
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]

    def abort(self) -> None:
        """Cancel everything at once (the level is being abandoned, not measured)."""
        self.running = False
        for task in (*self.drivers, *self.requests):
            task.cancel()


class Agent:
    def __init__(self, link: Link, client: BenchClient, prepared: Sequence[Any], settings: AgentSettings) -> None:
        self._link = link
        self._client = client
        self._prepared = list(prepared)
        self._settings = settings

    async def _recv(self) -> object:
        message = await self._link.recv()
        if isinstance(message, Failed):  # e.g. the pipe to a dead coordinator closed
            raise LinkClosed(message.message)
        return message

    async def serve(self) -> None:
        """Answer the coordinator until Shutdown; a crash is reported as Failed."""
        try:
            while True:
                message = await self._recv()
                if isinstance(message, Shutdown):
                    return
                if isinstance(message, LevelPlan):
                    await self._level(message)
                # A Stop that crossed our Final is stale: nothing is running.
        except LinkClosed:
            log.warning("load agent %d: the coordinator went away; stopping", self._settings.index)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("load agent %d failed", self._settings.index)
            with suppress(LinkClosed):
                await self._link.send(Failed(traceback.format_exc(limit=8)))

    # --- one level ---------------------------------------------------------

    async def _level(self, plan: LevelPlan) -> None:
        if plan.warmup_s > 0 or plan.warmup_requests > 0:
            await self._warmup(plan)
        await self._link.send(Ready())
        message = await self._recv()
        if not isinstance(message, Go):  # interrupted before the level began
            await self._link.send(Final())
            return
        phase = _Phase(plan.count if plan.count > 0 else None)
        try:
            if plan.count > 0:
                await self._measure_count(phase, plan, message.t0)
            else:
                await self._measure_windows(phase, plan, message.t0)
        except BaseException:
            # Coordinator gone, a crash, or cancellation: no request may outlive
            # the level (the client is closed next).
            phase.abort()
            raise

    async def _warmup(self, plan: LevelPlan) -> None:
        tickets = plan.warmup_requests if plan.warmup_requests > 0 else None
        phase = _Phase(tickets)
        self._start(phase, plan, time.monotonic())
        try:
            if tickets is None:
                await asyncio.sleep(plan.warmup_s)
                # Let warmup requests finish (each bounded by its timeout) so none
                # is answered inside the measurement.
                await phase.stop(self._settings.timeout_s + 1.0)
            else:
                await phase.completed()
        except BaseException:
            phase.abort()
            raise
        log.debug("agent %d warmed up: %d ok, %s", self._settings.index, phase.window.ok, phase.window.errors)

    async def _measure_windows(self, phase: _Phase, plan: LevelPlan, t0: float) -> None:
        await sleep_until(t0)
        cpu0 = time.process_time()
        self._start(phase, plan, t0)
        last_boundary = t0

        async def tick() -> None:
            nonlocal last_boundary
            k = 0
            while True:
                boundary = t0 + (k + 1) * plan.interval_s
                await sleep_until(boundary)
                window, phase.window = phase.window, Window()
                window.duration_s = plan.interval_s
                last_boundary = boundary
                await self._link.send(WindowReport(k, window))
                k += 1

        ticker = asyncio.create_task(tick())
        try:
            while not isinstance(await self._recv(), Stop):
                pass
        finally:
            ticker.cancel()
            with suppress(asyncio.CancelledError):
                await ticker
        stopped = time.monotonic()
        cpu_s = time.process_time() - cpu0
        partial, phase.window = phase.window, Window()  # what completes while draining is not measured
        partial.duration_s = stopped - last_boundary
        await phase.stop(self._settings.drain_s)
        await self._link.send(Final(partial, cpu_s, stopped - t0, phase.last_done))

    async def _measure_count(self, phase: _Phase, plan: LevelPlan, t0: float) -> None:
        await sleep_until(t0)
        cpu0 = time.process_time()
        self._start(phase, plan, t0)
        done = asyncio.create_task(phase.completed())
        stop = asyncio.create_task(self._recv())
        await asyncio.wait({done, stop}, return_when=asyncio.FIRST_COMPLETED)
        if not stop.done():
            stop.cancel()  # a pending queue get: cancelling it loses no message
        interrupted = not done.done()
        ended = time.monotonic() if interrupted else phase.last_done or time.monotonic()
        cpu_s = time.process_time() - cpu0
        if interrupted:
            done.cancel()
            with suppress(asyncio.CancelledError):
                await done
            await phase.stop(self._settings.drain_s)
        else:
            await done  # re-raises a crashed driver
        if stop.done() and not stop.cancelled():
            stop.result()  # re-raises LinkClosed
        phase.window.duration_s = max(0.0, (phase.last_done or ended) - t0)
        await self._link.send(Final(phase.window, cpu_s, ended - t0, phase.last_done))

    # --- load generators -----------------------------------------------------

    def _start(self, phase: _Phase, plan: LevelPlan, t0: float) -> None:
        if plan.mode is LoadMode.CONCURRENCY:
            # Spread the workers over the payloads so they do not all send the same one.
            phase.drivers = [asyncio.create_task(self._closed_worker(phase, i)) for i in range(plan.concurrency)]
            return
        # The phase's tickets cut the schedule: the coordinator gave this agent
        # the same share of a request count as schedule.share() would.
        s = self._settings
        schedule = offsets(plan.distribution, plan.total_rate, s.index, s.processes, seed=plan.seed * 1009 + s.index)
        phase.dispatcher = asyncio.create_task(self._dispatch(phase, schedule, t0))
        phase.drivers = [phase.dispatcher]

    async def _closed_worker(self, phase: _Phase, offset: int) -> None:
        infer = self._client.infer
        prepared = self._prepared
        n = len(prepared)
        i = offset
        while phase.take():
            request = prepared[i % n]
            i += 1
            started = time.monotonic()
            error = await infer(request)
            phase.record(started, time.monotonic(), error)

    async def _dispatch(self, phase: _Phase, schedule: Iterator[float], t0: float) -> None:
        prepared = self._prepared
        n = len(prepared)
        cap = self._settings.max_outstanding
        for i, offset in enumerate(schedule):
            if not phase.take():
                return
            due = t0 + offset
            await sleep_until(due)
            while phase.in_flight >= cap:
                phase.slot_free.clear()
                await phase.slot_free.wait()
                if not phase.running:
                    return
            lag = time.monotonic() - due
            if lag > phase.window.max_send_lag_s:
                phase.window.max_send_lag_s = lag
            phase.in_flight += 1
            task = asyncio.create_task(self._one(phase, prepared[i % n], due))
            phase.requests.add(task)
            task.add_done_callback(phase.requests.discard)

    async def _one(self, phase: _Phase, request: Any, due: float) -> None:
        try:
            error = await self._client.infer(request)
            phase.record(due, time.monotonic(), error)
        finally:
            phase.in_flight -= 1
            phase.slot_free.set()
