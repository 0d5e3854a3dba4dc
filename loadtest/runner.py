"""The coordinator and the Python API: ``run_bench(BenchConfig) -> BenchResult``.

The coordinator reads the model's signature, builds the payloads, starts the
agents (``loadtest.processes``), and walks the load levels. For each level it
plans every agent's share, waits until all have warmed up, snapshots the
server's statistics, starts the load at one shared instant, and then either

- (time windows) merges the agents' windows as they arrive, stops once the
  last three windows agree within ``stability_percentage`` (perf_analyzer's
  rule) or after ``max_trials`` windows, and reports the last three; the
  server's statistics are snapshotted at every window boundary so its delta
  covers the same span; or
- (``request_count``) waits until every request has been answered, then
  snapshots the statistics again: the server's counts then match the
  client's exactly.

Ctrl-C (when run in the main thread) stops the current level and returns
everything measured so far, marked interrupted; a second Ctrl-C is the usual
KeyboardInterrupt.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import signal
import threading
import time
from collections import defaultdict

from loadtest.clients import BenchClient, ClientFactory, ServerStats, make_client
from loadtest.config import STABILITY_WINDOWS, BenchConfig, BenchError, LoadMode
from loadtest.inputs import build_payloads
from loadtest.latency import Window, concat, is_stable
from loadtest.messages import Failed, Final, Go, LevelPlan, Link, LinkClosed, Ready, Stop, WindowReport
from loadtest.processes import AgentPool, run_with_uvloop, start_agents
from loadtest.progress import Progress, SilentProgress, StreamProgress
from loadtest.report import BenchResult, LevelResult, level_result
from loadtest.schedule import share

log = logging.getLogger(__name__)

_START_DELAY_S = 0.05  # lets Go reach every agent before the shared start instant
_SETTLE_TRIES = 25  # statistics may be recorded just after the answer is sent
_SETTLE_PAUSE_S = 0.02


class Coordinator:
    def __init__(self, config: BenchConfig, client: BenchClient, pool: AgentPool, progress: Progress) -> None:
        self._config = config
        self._client = client
        self._links: list[Link] = pool.links
        self._progress = progress
        self._inbox: asyncio.Queue[tuple[int, object]] = asyncio.Queue()
        self._interrupted = asyncio.Event()
        self._pumps = [asyncio.create_task(self._pump(i, link)) for i, link in enumerate(self._links)]

    @property
    def interrupted(self) -> bool:
        return self._interrupted.is_set()

    def interrupt(self) -> None:
        self._interrupted.set()

    async def close(self) -> None:
        for task in self._pumps:
            task.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)

    async def _pump(self, index: int, link: Link) -> None:
        # One reader per agent feeding one inbox, so the coordinator waits on
        # a single queue (and the interrupt) instead of on each link in turn.
        while True:
            self._inbox.put_nowait((index, await link.recv()))

    async def _next(self, *, interruptible: bool) -> tuple[int, object] | None:
        """The next agent message; None once interrupted (when ``interruptible``)."""
        if not interruptible:
            return self._check(await self._inbox.get())
        get = asyncio.create_task(self._inbox.get())
        stop = asyncio.create_task(self._interrupted.wait())
        await asyncio.wait({get, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if get.done():
            return self._check(get.result())
        get.cancel()
        return None

    @staticmethod
    def _check(item: tuple[int, object]) -> tuple[int, object]:
        index, message = item
        if isinstance(message, Failed):
            raise BenchError(f"load agent {index} failed: {message.message}")
        return item

    async def _broadcast(self, message: object) -> None:
        for link in self._links:
            await link.send(message)

    async def _finals(self, already: int = 0) -> tuple[list[Final], dict[int, list[Window]]]:
        """Collect the Finals still due (and windows reported after Stop crossed them)."""
        finals: list[Final] = []
        late: dict[int, list[Window]] = defaultdict(list)
        while already + len(finals) < len(self._links):
            _, message = await self._next(interruptible=False)
            if isinstance(message, Final):
                finals.append(message)
            elif isinstance(message, WindowReport):
                late[message.index].append(message.window)
        return finals, late

    # --- levels ------------------------------------------------------------------

    def _plans(self, index: int, level: float) -> list[LevelPlan]:
        cfg = self._config
        n = len(self._links)
        closed = cfg.mode is LoadMode.CONCURRENCY
        # Closed loop: only min(n, concurrency) agents get workers; the request
        # counts go to those same agents.
        active = min(n, int(level)) if closed else n
        plans = []
        for i in range(n):

            def part(total: int, i: int = i) -> int:
                return share(total, i, active) if i < active else 0

            plans.append(LevelPlan(
                index=index, mode=cfg.mode,
                concurrency=part(int(level)) if closed else 0,
                total_rate=0.0 if closed else level,
                distribution=cfg.distribution,
                count=part(cfg.request_count),
                warmup_s=cfg.warmup_s if index == 0 and i < active else 0.0,
                warmup_requests=part(cfg.warmup_requests) if index == 0 else 0,
                interval_s=cfg.interval_s, seed=cfg.seed * 7919 + index,
            ))  # fmt: skip
        return plans

    async def _settled_stats(self, before: ServerStats | None, sent: int) -> ServerStats | None:
        after = await self._client.stats()
        for _ in range(_SETTLE_TRIES):
            if before is None or after is None:
                break
            delta = after - before
            if delta.success_count + delta.fail_count >= sent:
                break
            await asyncio.sleep(_SETTLE_PAUSE_S)
            after = await self._client.stats()
        return after

    async def run_level(self, index: int, level: float) -> LevelResult | None:
        cfg = self._config
        self._progress.level_started(cfg.mode.value, level)
        for link, plan in zip(self._links, self._plans(index, level), strict=True):
            await link.send(plan)
        ready = 0
        while ready < len(self._links):
            item = await self._next(interruptible=False)
            ready += isinstance(item[1], Ready)
        if self.interrupted:  # Ctrl-C during warmup: nothing measured at this level
            await self._broadcast(Stop())
            await self._finals()
            return None
        before = await self._client.stats()
        t0 = time.monotonic() + _START_DELAY_S
        await self._broadcast(Go(t0))
        if cfg.request_count > 0:
            return await self._count_level(level, before)
        return await self._window_level(level, t0, before)

    async def _count_level(self, level: float, before: ServerStats | None) -> LevelResult:
        cfg = self._config
        finals: list[Final] = []
        while len(finals) < len(self._links):
            item = await self._next(interruptible=True)
            if item is None:  # interrupted: agents that already finished ignore this Stop
                await self._broadcast(Stop())
                more, _ = await self._finals(already=len(finals))
                finals.extend(more)
                break
            if isinstance(item[1], Final):
                finals.append(item[1])
        window = Window()
        for final in finals:
            window.absorb(final.window)
        sent = window.ok + window.error_count
        after = await self._settled_stats(before, sent)
        return level_result(
            cfg.mode.value, level, window, batch_size=cfg.batch_size,
            stable=True, windows=1, interrupted=self.interrupted,
            client_cpu=[f.cpu_s / f.wall_s for f in finals if f.wall_s > 0],
            open_loop=cfg.mode is LoadMode.REQUEST_RATE,
            server=after - before if before is not None and after is not None else None,
        )  # fmt: skip

    async def _window_level(self, level: float, t0: float, before: ServerStats | None) -> LevelResult:
        cfg = self._config
        n = len(self._links)
        snapshots: dict[int, asyncio.Task[ServerStats | None]] = {}

        async def snapshot_ticker() -> None:
            k = 1
            while True:
                await asyncio.sleep(max(0.0, t0 + k * cfg.interval_s - time.monotonic()))
                snapshots[k] = asyncio.create_task(self._client.stats())
                k += 1

        ticker = asyncio.create_task(snapshot_ticker())
        parts: dict[int, list[Window]] = defaultdict(list)
        windows: list[Window] = []
        stable = False
        try:
            while not stable and len(windows) < cfg.max_trials:
                item = await self._next(interruptible=True)
                if item is None:
                    break
                message = item[1]
                if not isinstance(message, WindowReport):
                    continue
                parts[message.index].append(message.window)
                while len(parts.get(len(windows), ())) == n:
                    merged = Window()
                    for part in parts.pop(len(windows)):
                        merged.absorb(part)
                    windows.append(merged)
                    self._progress.window(cfg.mode.value, level, len(windows) - 1, merged)
                recent = windows[-STABILITY_WINDOWS:]
                stable = len(recent) == STABILITY_WINDOWS and is_stable(recent, cfg.stability_percentage)
        finally:
            ticker.cancel()
        await self._broadcast(Stop())
        finals, late = await self._finals()
        if self.interrupted:
            # Everything measured: the merged windows, then all that came after
            # them (windows that crossed the Stop, and each agent's partial window).
            partial = Window()
            for part in (*(w for k in sorted(late) for w in late[k]), *(f.window for f in finals)):
                partial.absorb(part)
            partial.duration_s = len(late) * cfg.interval_s + max((f.window.duration_s for f in finals), default=0.0)
            used, first = windows + [partial], 0
            end_stats = await self._client.stats()
        else:
            first = max(0, len(windows) - STABILITY_WINDOWS)
            used = windows[first:]
            end = snapshots.get(len(windows))
            end_stats = await end if end is not None else await self._client.stats()
        if first == 0:
            start_stats = before
        else:
            start = snapshots.get(first)
            start_stats = await start if start is not None else None
        for task in snapshots.values():  # snapshots of windows not reported on
            task.cancel()
        server = end_stats - start_stats if start_stats is not None and end_stats is not None else None
        return level_result(
            cfg.mode.value, level, concat(used), batch_size=cfg.batch_size,
            stable=stable, windows=len(used), interrupted=self.interrupted,
            client_cpu=[f.cpu_s / f.wall_s for f in finals if f.wall_s > 0],
            open_loop=cfg.mode is LoadMode.REQUEST_RATE, server=server,
        )  # fmt: skip

    async def run(self) -> tuple[list[LevelResult], bool]:
        results: list[LevelResult] = []
        for index, level in enumerate(self._config.levels):
            if self.interrupted:
                break
            result = await self.run_level(index, level)
            if result is None:
                break
            results.append(result)
            self._progress.level_done(result)
        return results, self.interrupted


def _sigint_hook(coordinator: Coordinator) -> tuple[bool, asyncio.AbstractEventLoop]:
    """Route the first Ctrl-C to the coordinator; the second raises KeyboardInterrupt as usual."""
    loop = asyncio.get_running_loop()
    if threading.current_thread() is not threading.main_thread():
        return False, loop

    def first() -> None:
        log.warning("interrupted: finishing the current level; Ctrl-C again to abort")
        loop.remove_signal_handler(signal.SIGINT)  # back to KeyboardInterrupt
        coordinator.interrupt()

    try:
        loop.add_signal_handler(signal.SIGINT, first)
    except (NotImplementedError, RuntimeError):
        return False, loop
    return True, loop


async def run_bench_async(config: BenchConfig, progress: Progress | None = None, *,
                          client_factory: ClientFactory = make_client) -> BenchResult:
    """The benchmark, on the running event loop.

    ``client_factory`` builds the clients of the coordinator and of an
    in-process agent (tests pass a fake); agent processes always use the real one.
    """
    if progress is None:
        progress = StreamProgress() if config.progress else SilentProgress()
    client = client_factory(config)
    try:
        signature = await client.signature()
        payloads = build_payloads(
            signature, batch_size=config.batch_size, input_data=config.input_data, shapes=config.shapes,
            seed=config.seed, int_range=config.int_range, string_length=config.string_length,
        )  # fmt: skip
        log.info("model %s (max batch %d): %d input(s), %d payload(s)", signature.name,
                 signature.max_batch_size, len(signature.inputs), len(payloads))
        pool = start_agents(config, payloads, client_factory)
        coordinator = Coordinator(config, client, pool, progress)
        hooked, loop = _sigint_hook(coordinator)
        try:
            levels, interrupted = await coordinator.run()
        except LinkClosed as exc:
            raise BenchError(f"a load agent process exited unexpectedly ({exc})") from None
        finally:
            if hooked:
                loop.remove_signal_handler(signal.SIGINT)
            await coordinator.close()
            await pool.close()
    finally:
        await client.close()
    return BenchResult(
        model=config.model, model_version=config.model_version, protocol=config.protocol.value, url=config.url,
        batch_size=config.batch_size, processes=config.processes, mode=config.mode.value,
        levels=tuple(levels), interrupted=interrupted,
    )  # fmt: skip


def run_bench(config: BenchConfig, progress: Progress | None = None, *,
              client_factory: ClientFactory = make_client) -> BenchResult:
    """Run a benchmark and return its results (blocking).

    Safe to call from code that already runs an event loop: the benchmark
    then gets its own loop on a helper thread.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return run_with_uvloop(run_bench_async(config, progress, client_factory=client_factory))
    coro = run_bench_async(config, progress, client_factory=client_factory)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="bench") as pool:
        return pool.submit(run_with_uvloop, coro).result()
