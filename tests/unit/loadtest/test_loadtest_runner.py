"""The bench's coordinator and load agent against a fake server (no sockets).

The fake has a fixed service time and a fixed number of slots, so its
capacity is known: closed-loop counts must match exactly, and an open loop
offered far more than the capacity must show the backlog as latency and
count timeouts as errors instead of stopping.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from typing import Any

import pytest

from loadtest.clients import ServerStats
from loadtest.config import BenchConfig
from loadtest.inputs import ModelSignature, Payload, TensorSpec
from loadtest.latency import Window
from loadtest.report import LevelResult
from loadtest.runner import run_bench_async

SIG = ModelSignature("fake", "1", 8, (TensorSpec("X", "INT32", (4,)),), ())


class FakeServer:
    def __init__(self, service_s: float, slots: int) -> None:
        self.service_s = service_s
        self.slots = asyncio.Semaphore(slots)
        self.ok = 0
        self.rows = 0
        self.fail = 0


class FakeClient:
    def __init__(self, server: FakeServer, config: BenchConfig) -> None:
        self._server = server
        self._timeout_s = config.timeout_s

    async def signature(self) -> ModelSignature:
        return SIG

    async def stats(self) -> ServerStats | None:
        s = self._server
        return ServerStats(inference_count=s.rows, execution_count=s.ok, success_count=s.ok, fail_count=s.fail)

    def prepare(self, payload: Payload) -> Payload:
        return payload

    async def _serve(self, payload: Payload) -> None:
        async with self._server.slots:
            await asyncio.sleep(self._server.service_s)
            self._server.ok += 1
            self._server.rows += payload[0].shape[0]

    async def infer(self, prepared: Payload) -> str | None:
        try:
            await asyncio.wait_for(self._serve(prepared), self._timeout_s)
        except asyncio.TimeoutError:
            self._server.fail += 1
            return "timeout"
        return None

    async def close(self) -> None:
        pass


async def _run(server: FakeServer, progress: Any = None, **kwargs: Any):
    config = BenchConfig(model="fake", **kwargs)
    return await run_bench_async(config, progress, client_factory=lambda cfg: FakeClient(server, cfg))


async def test_closed_loop_request_count_matches_server() -> None:
    server = FakeServer(service_s=0.002, slots=2)
    result = await _run(server, concurrency=(1, 4), request_count=40, batch_size=3, warmup_requests=5)
    assert [lv.level for lv in result.levels] == [1.0, 4.0]
    for lv in result.levels:
        assert lv.requests == 40 and lv.error_count == 0
        assert lv.server is not None
        assert lv.server.requests == 40 and lv.server.inferences == 120
        assert lv.rows_per_s == pytest.approx(3 * lv.throughput_rps)
        assert lv.latency.min_us >= 2000  # never faster than the service time
        assert len(lv.client_cpu) == 1 and 0 <= lv.client_cpu[0] <= 1.5
    assert server.ok == 2 * 40 + 5  # and the warmup requests ran once, before the first level
    # Concurrency 4 on 2 slots queues: latency about doubles.
    assert result.levels[1].latency.p50_us > 1.5 * result.levels[0].latency.p50_us


async def test_time_windows_until_stable() -> None:
    server = FakeServer(service_s=0.005, slots=1)
    windows: list[int] = []

    class Recorder:
        def level_started(self, mode: str, level: float) -> None: ...
        def window(self, mode: str, level: float, index: int, window: Window) -> None:
            windows.append(window.ok)

        def level_done(self, result: LevelResult) -> None: ...

    result = await _run(server, Recorder(), concurrency=(2,), measurement_interval_ms=150,
                        stability_percentage=50, max_trials=6)
    (lv,) = result.levels
    assert lv.stable and lv.windows == 3 and 3 <= len(windows) <= 6
    assert lv.duration_s == pytest.approx(0.45)
    assert lv.requests == sum(windows[-3:])
    # Completions were counted once each: the server's delta over the same windows agrees
    # up to the requests in flight at the two boundaries.
    assert lv.server is not None and abs(lv.server.requests - lv.requests) <= 2


async def test_open_loop_above_capacity_counts_backlog_and_timeouts() -> None:
    # Capacity 100 req/s (one slot, 10 ms); offered 500 req/s for 60 requests.
    server = FakeServer(service_s=0.010, slots=1)
    result = await _run(server, request_rate=(500.0,), request_count=60, timeout_ms=300)
    (lv,) = result.levels
    assert lv.requests + lv.error_count == 60
    assert lv.errors.get("timeout", 0) > 0 and lv.requests > 10
    # Latency runs from the scheduled send: the backlog shows, far above the 10 ms service time.
    assert lv.latency.max_us > 150_000 and lv.latency.p50_us > 50_000
    assert lv.server is not None and lv.server.requests == lv.requests


async def test_open_loop_under_capacity_has_service_latency() -> None:
    server = FakeServer(service_s=0.002, slots=4)
    result = await _run(server, request_rate=(100.0,), request_count=30, distribution="poisson", seed=5)
    (lv,) = result.levels
    assert lv.requests == 30 and lv.error_count == 0
    assert 2000 <= lv.latency.p50_us < 50_000


async def test_open_loop_respects_max_outstanding() -> None:
    server = FakeServer(service_s=0.020, slots=100)
    result = await _run(server, request_rate=(1000.0,), request_count=40, max_outstanding=2)
    (lv,) = result.levels
    # Two in flight at 20 ms each is 100 req/s, not 1000: sends fall behind, and it shows.
    assert lv.requests == 40 and lv.max_send_lag_ms > 100
    assert lv.latency.max_us > 200_000


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="needs the main thread")
async def test_ctrl_c_keeps_what_was_measured() -> None:
    server = FakeServer(service_s=0.002, slots=1)

    class InterruptAfterTwoWindows:
        def level_started(self, mode: str, level: float) -> None: ...
        def window(self, mode: str, level: float, index: int, window: Window) -> None:
            if index == 1:
                os.kill(os.getpid(), signal.SIGINT)

        def level_done(self, result: LevelResult) -> None: ...

    result = await _run(server, InterruptAfterTwoWindows(), concurrency=(1, 2), measurement_interval_ms=100,
                        stability_percentage=0.001, max_trials=50)
    assert result.interrupted
    (lv,) = result.levels  # the second level never started
    assert lv.interrupted and not lv.stable and lv.windows >= 3  # two whole windows and the partial one
    assert lv.requests > 0 and lv.duration_s >= 0.2
    # The default handler is back once the run is over.
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
