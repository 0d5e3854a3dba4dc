"""``infergate bench --streaming``: closed-loop load on decoupled models.

``run_stream_bench(BenchConfig) -> StreamBenchResult``. A concurrency level is
a number of open streams; each stream (a slot of ``loadtest.stream_clients``,
by default with ``loadtest.stream_requests``' requests) sends one request,
reads every response up to the final one, and sends the next, as
perf_analyzer does in its decoupled mode. Requests take the prepared
payloads in turn from one shared counter, so with ``--request-count`` the
payload of every request (and with it the number of responses a model such
as square_int32 owes) is known whatever stream sends it.

Measurement follows the unary bench: with ``request_count`` every request of
the level is measured; otherwise time windows of ``interval_s`` run until
the last three agree (responses/s and mean time to first response, within
``stability_percentage``) or ``max_trials`` windows have passed, and the last
three are reported. A request belongs to the window in which its final
response arrived. Warmup (the first level only) runs before the measured
span, a duration or a number of requests. Runs in one process: one event
loop drives every stream.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from loadtest.config import STABILITY_WINDOWS, BenchConfig, BenchError
from loadtest.inputs import build_payloads
from loadtest.processes import run_with_uvloop
from loadtest.stream_clients import Clock, StreamBenchClient, StreamClientFactory, StreamSlot
from loadtest.stream_report import StreamBenchResult
from loadtest.stream_requests import make_stream_client
from loadtest.streaming import (
    StreamLevelResult,
    StreamRecord,
    StreamWindow,
    concat_windows,
    stream_level_result,
    stream_stable,
    window_of,
)

log = logging.getLogger(__name__)


class Tickets:
    """The shared request counter: which payload the next request takes, and how many remain."""

    def __init__(self, payloads: int, budget: int | None = None) -> None:
        self._payloads = payloads
        self._next = 0
        self._budget = budget

    def take(self) -> int | None:
        """The payload index of the next request; None once the budget is spent."""
        if self._budget is not None:
            if self._budget <= 0:
                return None
            self._budget -= 1
        index = self._next % self._payloads
        self._next += 1
        return index


class StreamLevel:
    """One concurrency level: its slots, the records they fill, the windows cut from them."""

    def __init__(self, config: BenchConfig, client: StreamBenchClient, prepared: Sequence[Any], streams: int,
                 clock: Clock, stop: asyncio.Event) -> None:
        self._config = config
        self._client = client
        self._prepared = prepared
        self._streams = streams
        self._clock = clock
        self._stop = stop
        self._slots: list[StreamSlot] = []
        self.records: list[StreamRecord] = []

    async def _drive(self, slot: StreamSlot, tickets: Tickets, records: list[StreamRecord]) -> None:
        while (index := tickets.take()) is not None:
            record = StreamRecord(sent_s=self._clock())
            records.append(record)
            await slot.send(self._prepared[index], record)

    async def _run_all(self, tickets: Tickets, records: list[StreamRecord]) -> None:
        await asyncio.gather(*(self._drive(slot, tickets, records) for slot in self._slots))

    async def run(self, index: int) -> StreamLevelResult:
        cfg = self._config
        self._slots = [self._client.open() for _ in range(self._streams)]
        try:
            if index == 0 and cfg.warmup_requests > 0:
                await self._run_all(Tickets(len(self._prepared), cfg.warmup_requests), [])
            if cfg.request_count > 0:
                return await self._count_level()
            return await self._window_level(cfg.warmup_s if index == 0 else 0.0)
        finally:
            await asyncio.gather(*(slot.close() for slot in self._slots), return_exceptions=True)

    async def _count_level(self) -> StreamLevelResult:
        start = self._clock()
        run = asyncio.ensure_future(self._run_all(Tickets(len(self._prepared), self._config.request_count),
                                                  self.records))
        stop = asyncio.ensure_future(self._stop.wait())
        await asyncio.wait({run, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        interrupted = not run.done()
        if interrupted:
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)
        end = self._clock()
        window = StreamWindow(duration_s=end - start)
        for record in self.records:
            if record.done_s == record.done_s:  # finished (NaN: cut off by an interrupt)
                window.add(record)
        return stream_level_result(self._streams, window, stable=True, windows=1, interrupted=interrupted)

    async def _sleep_until(self, deadline: float) -> bool:
        """Wait until the clock reads ``deadline``; False when interrupted first."""
        delay = deadline - self._clock()
        if delay > 0:
            try:
                await asyncio.wait_for(self._stop.wait(), delay)
            except asyncio.TimeoutError:
                pass
        return not self._stop.is_set()

    async def _window_level(self, warmup_s: float) -> StreamLevelResult:
        cfg = self._config
        run = asyncio.ensure_future(self._run_all(Tickets(len(self._prepared)), self.records))
        windows: list[StreamWindow] = []
        stable = False
        try:
            t0 = self._clock() + warmup_s
            if not await self._sleep_until(t0):
                return stream_level_result(self._streams, StreamWindow(), stable=False, windows=0, interrupted=True)
            while not stable and len(windows) < cfg.max_trials:
                start = t0 + len(windows) * cfg.interval_s
                if not await self._sleep_until(start + cfg.interval_s):
                    break
                windows.append(window_of(self.records, start, start + cfg.interval_s))
                # Keep only what a later window may still count.
                self.records[:] = [r for r in self.records if not r.done_s < start + cfg.interval_s]
                w = windows[-1]
                if cfg.progress:
                    print(f"  streams {self._streams}: window {len(windows)}: {w.requests} requests, "
                          f"{w.responses} responses, {w.error_count} errors", file=sys.stderr, flush=True)
                if run.done():
                    run.result()  # a slot failed outside a request: surface it
                recent = windows[-STABILITY_WINDOWS:]
                stable = len(recent) == STABILITY_WINDOWS and stream_stable(recent, cfg.stability_percentage)
        finally:
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)
        interrupted = self._stop.is_set()
        used = windows if interrupted else windows[-STABILITY_WINDOWS:]
        return stream_level_result(self._streams, concat_windows(used), stable=stable, windows=len(used),
                                   interrupted=interrupted)


def _sigint_hook(stop: asyncio.Event) -> bool:
    """The first Ctrl-C ends the current level (its measurements kept); the second raises as usual."""
    loop = asyncio.get_running_loop()
    if threading.current_thread() is not threading.main_thread():
        return False

    def first() -> None:
        log.warning("interrupted: finishing the current level; Ctrl-C again to abort")
        loop.remove_signal_handler(signal.SIGINT)
        stop.set()

    try:
        loop.add_signal_handler(signal.SIGINT, first)
    except (NotImplementedError, RuntimeError):
        return False
    return True


async def run_stream_bench_async(config: BenchConfig, *, client_factory: StreamClientFactory = make_stream_client,
                                 clock: Clock = time.monotonic,
                                 payloads: Sequence[Any] | None = None) -> StreamBenchResult:
    """The streaming benchmark on the running event loop (``client_factory``: tests pass a fake).

    ``payloads``: what the client prepares (generation requests); None: built from the model's signature."""
    if not config.streaming:
        raise BenchError("run_stream_bench needs a config with streaming=True")
    client = client_factory(config)
    stop = asyncio.Event()
    hooked = False
    levels: list[StreamLevelResult] = []
    try:
        if payloads is None:
            signature = await client.signature()
            payloads = build_payloads(
                signature, batch_size=config.batch_size, input_data=config.input_data, shapes=config.shapes,
                seed=config.seed, int_range=config.int_range, string_length=config.string_length,
            )  # fmt: skip
        prepared = [client.prepare(p) for p in payloads]
        log.info("model %s: %d payload(s), streaming", config.model, len(prepared))
        hooked = _sigint_hook(stop)
        for index, streams in enumerate(config.concurrency):
            if stop.is_set():
                break
            if config.progress:
                print(f"streams {streams}: measuring", file=sys.stderr, flush=True)
            levels.append(await StreamLevel(config, client, prepared, streams, clock, stop).run(index))
    finally:
        if hooked:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGINT)
        await client.close()
    return StreamBenchResult(
        model=config.model, model_version=config.model_version, protocol=config.protocol.value, url=config.url,
        levels=tuple(levels), interrupted=stop.is_set(),
    )  # fmt: skip


def run_stream_bench(config: BenchConfig, *, client_factory: StreamClientFactory = make_stream_client,
                     payloads: Sequence[Any] | None = None) -> StreamBenchResult:
    """Run a streaming benchmark and return its results (blocking; safe inside a running loop)."""
    coro = run_stream_bench_async(config, client_factory=client_factory, payloads=payloads)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return run_with_uvloop(coro)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="bench") as pool:
        return pool.submit(run_with_uvloop, coro).result()
