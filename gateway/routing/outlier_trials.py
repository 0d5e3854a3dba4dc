"""Return trials on a timer: an ejected worker is tried again when its ejection runs out.

Owns :class:`ReturnTrials`. Without it, an ejected worker's half-open trial
is the next client request that happens to be routed to it -- minutes later
where traffic is sparse, and a worker ejected during a burst stays out of
rotation long after the burst. Here each ejection schedules its own trial at
the moment it runs out: if the circuit is still waiting for one (no client
request took the trial first), a synthetic probe -- the worker's readiness
call, the model it was ejected for when there is one -- is the trial, and its
outcome closes the circuit or opens it again, as a request's would.

Every task is owned here (a set, with a done-callback that logs failures) and
cancelled by :meth:`ReturnTrials.cancel` (the router's ``close``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from gateway.routing.outlier import CircuitState, OutlierDetector

log = logging.getLogger(__name__)

# address, model ("" = none) -> whether the worker answered ready
Probe = Callable[[str, str], Awaitable[bool]]


class ReturnTrials:
    """Runs one synthetic trial per ejection once it runs out, unless a request tried the worker first."""

    def __init__(self, outliers: OutlierDetector, probe: Probe, *, timeout_s: float = 5.0,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self._outliers = outliers
        self._probe = probe
        self._timeout_s = timeout_s
        self._sleep = sleep
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    def ejected(self, address: str, model: str, duration_s: float) -> None:
        """The detector's ejection hook: schedule the return trial ``duration_s`` from now."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # not on the loop (a unit test driving the detector): a request is the trial
        if self._closed:
            return
        task = loop.create_task(self._trial(address, model, duration_s), name=f"return-trial:{address}")
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("return trial failed to run", exc_info=task.exception())

    async def _trial(self, address: str, model: str, duration_s: float) -> None:
        await self._sleep(duration_s)
        outliers = self._outliers
        if outliers.state(address) is CircuitState.CLOSED or not outliers.routable(address):
            return  # closed already, or a request holds the trial
        trial = outliers.attempt_started(address)
        if not trial:
            return
        try:
            ready = await asyncio.wait_for(self._probe(address, model), self._timeout_s)
        except asyncio.CancelledError:
            outliers.abandoned(address, model, 0.0, trial)
            raise
        except Exception as exc:  # the worker's fault, whatever its kind: the trial failed
            outliers.failed(address, f"return trial: {type(exc).__name__}: {exc}", trial)
            return
        if ready:
            log.info("worker %s: return trial (readiness of %s) answered", address, model or "the server")
            outliers.trial_passed(address)
        else:
            outliers.failed(address, f"return trial: {model or 'the server'} not ready", trial)

    def cancel(self) -> None:
        """Schedule no more trials and cancel the waiting ones (their done-callbacks drop them)."""
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
