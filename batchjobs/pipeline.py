"""A job's pipeline: chunks of rows read, sent as concurrent requests and
written, with bounded memory.

One reader thread turns pending chunks of the input into checked row groups
(bounded queue of 2); the event loop cuts each chunk into requests of
``batch_size`` rows and keeps at most ``concurrency`` of them in flight
(through a gateway, the fleet's workers share them: data parallelism); a
finished chunk goes to one writer, which makes it durable, appends its bad
rows to the errors file and only then adds its range to the checkpoint.
Memory is bounded by the chunks alive at once: at most
``MAX_CHUNKS_IN_FLIGHT`` dispatched or being written, plus the reader's queue.

A request the server rejects for its rows is retried alone (no other
request of the job in flight) and split in halves until each bad row stands
by itself; the other rows are kept.

A stop (:class:`JobStop`: asked for, or the first fatal error) stops
dispatching, lets requests in flight finish and writes the chunks they
complete; the chunks cut short are simply repeated by ``--resume``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np

from batchjobs.checkpoint import Checkpoint, commit_chunk
from batchjobs.client import BatchJobError, Isolation, JobClient, RowsRejected
from batchjobs.progress import Progress
from batchjobs.rows import Chunk, RowGroup
from batchjobs.sinks import ChunkResult, Sink
from batchjobs.sources import Source
from loadtest.inputs import TensorSpec

log = logging.getLogger(__name__)

MAX_CHUNKS_IN_FLIGHT = 4
T = TypeVar("T")


class _Stopped:
    """What a wait returns when a stop request cut it short."""


_STOPPED = _Stopped()


class JobStop:
    """A job's stop: asked for (first Ctrl-C or SIGTERM), or forced by its first
    fatal error, which is kept for the job to raise."""

    def __init__(self) -> None:
        self._event = asyncio.Event()
        self.error: BatchJobError | None = None

    def request(self) -> None:
        self._event.set()

    def fail(self, error: BatchJobError) -> None:
        if self.error is None:
            self.error = error
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    async def wait(self) -> None:
        await self._event.wait()


@dataclass(slots=True)
class _ChunkRun:
    """A chunk being sent: how many of its requests are outstanding, and what came back."""

    result: ChunkResult
    pending: int = 0
    closed: bool = False  # no more requests will be dispatched for it
    complete: bool = False  # every request was dispatched (closed without a stop)


class ChunkPipeline:
    """Sends a job's pending chunks and writes what comes back; one per run.

    ``bad_rows`` counts the rows the errors file holds, those of earlier runs
    (``bad_rows`` given) and those this run commits.
    """

    def __init__(self, client: JobClient, stop: JobStop, progress: Progress, *, out_specs: tuple[TensorSpec, ...],
                 batched: bool, batch_size: int, concurrency: int, fail_fast: bool, input_path: Path,
                 bad_rows: int = 0) -> None:
        self._client = client
        self._stop = stop
        self._progress = progress
        self._out_specs = out_specs
        self._batched = batched
        self._batch_size = batch_size
        self._fail_fast = fail_fast
        self._input = input_path
        self.bad_rows = bad_rows
        self._chunk_slots = asyncio.Semaphore(MAX_CHUNKS_IN_FLIGHT)
        self._request_slots = asyncio.Semaphore(concurrency)
        self._finished: asyncio.Queue[_ChunkRun | None] = asyncio.Queue()
        self._requests: set[asyncio.Task[None]] = set()
        self._isolation = Isolation()

    async def run(self, source: Source, pending: list[tuple[int, int]], sink: Sink, ckpt: Checkpoint,
                  errors_path: Path) -> None:
        """Send the ``pending`` chunks of ``source``; return once each is written or cut short by a stop."""
        chunks: asyncio.Queue[Chunk | None] = asyncio.Queue(maxsize=2)
        finished = self._finished
        reader = asyncio.create_task(self._read(source.chunks(pending), chunks), name="batch-reader")
        writer = asyncio.create_task(self._write(sink, ckpt, errors_path, finished), name="batch-writer")
        reader_done = False
        try:
            while not self._stop.is_set():
                chunk = chunks.get_nowait() if not chunks.empty() else await self._unless_stopped(chunks.get())
                if chunk is _STOPPED:
                    break
                if chunk is None:
                    reader_done = True
                    break
                if not await self._acquire(self._chunk_slots):
                    break
                await self._dispatch(chunk)
        finally:
            # Requests in flight finish (each bounded by the request timeout); their chunks get written.
            if self._requests:
                await asyncio.gather(*self._requests, return_exceptions=True)
            finished.put_nowait(None)
            await writer
            # The reader ends by itself once stopped; it is not cancelled, so that its thread never
            # reads a file closed under it. Consuming unblocks its put until its closing None.
            self._stop.request()
            while not reader_done:
                reader_done = await chunks.get() is None
            await reader

    async def _read(self, it: Iterator[Chunk], chunks: asyncio.Queue[Chunk | None]) -> None:
        try:
            while not self._stop.is_set():
                chunk = await asyncio.to_thread(next, it, None)
                if chunk is None:
                    break
                await chunks.put(chunk)
        except Exception as exc:  # the reader task's top: any failure stops the job, with its reason
            log.debug("reader failed", exc_info=True)
            self._stop.fail(BatchJobError(f"reading {self._input}: {exc}"))
        await chunks.put(None)

    async def _acquire(self, slots: asyncio.Semaphore) -> bool:
        """Take a slot unless a stop is requested first (then hold none)."""
        if self._stop.is_set():
            return False
        if not slots.locked():
            await slots.acquire()  # free: returns without suspending
            return True
        acquired = await self._unless_stopped(slots.acquire())
        if acquired is _STOPPED:
            return False
        if self._stop.is_set():
            slots.release()
            return False
        return True

    async def _unless_stopped(self, aw: Awaitable[T]) -> T | _Stopped:
        """The awaitable's result, or ``_STOPPED`` (and it is cancelled) once a stop is requested."""
        task = asyncio.ensure_future(aw)
        stop = asyncio.ensure_future(self._stop.wait())
        await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if task.done():
            return task.result()
        task.cancel()
        return _STOPPED

    async def _dispatch(self, chunk: Chunk) -> None:
        run = _ChunkRun(ChunkResult(chunk.start, chunk.stop, bad=dict(chunk.bad)))
        self._progress.advance(len(chunk.bad), bad=len(chunk.bad))
        if chunk.bad and self._fail_fast:
            row = min(chunk.bad)
            self._stop.fail(BatchJobError(f"row {row}: {chunk.bad[row]}"))
        for group, i, j in _slices(chunk.groups, self._batch_size):
            if not await self._acquire(self._request_slots):
                break
            run.pending += 1
            task = asyncio.create_task(self._send(run, group.rows[i:j], {k: v[i:j] for k, v in group.tensors.items()}))
            self._requests.add(task)
            task.add_done_callback(self._requests.discard)
        else:
            run.complete = not self._stop.is_set()
        run.closed = True
        if run.pending == 0:
            self._settle(run)

    def _settle(self, run: _ChunkRun) -> None:
        """Called once per chunk, when its last request is done and no more will come."""
        if run.complete and self._stop.error is None:
            self._finished.put_nowait(run)
        else:
            self._chunk_slots.release()  # cut short by a stop: repeated on resume

    async def _send(self, run: _ChunkRun, rows: np.ndarray, tensors: dict[str, np.ndarray]) -> None:
        try:
            await self._infer(run, rows, tensors)
        except BatchJobError as exc:
            run.complete = False
            self._stop.fail(exc)
        except Exception as exc:  # a request task's top: never mark a chunk done that lacks rows
            log.error("request for rows %d.. failed unexpectedly", int(rows[0]), exc_info=True)
            run.complete = False
            self._stop.fail(BatchJobError(f"internal error: {exc!r}"))
        finally:
            self._request_slots.release()
            run.pending -= 1
            if run.closed and run.pending == 0:
                self._settle(run)

    async def _infer(self, run: _ChunkRun, rows: np.ndarray, tensors: dict[str, np.ndarray]) -> None:
        await self._isolation.enter_shared()
        try:
            outputs = await self._client.infer(tensors, self._out_specs, self._batched)
        except RowsRejected:
            outputs = None
        finally:
            self._isolation.leave_shared()
        if outputs is None:
            # Alone, so the server cannot mix these rows with other requests of ours.
            async with self._isolation.exclusive():
                await self._bisect(run, rows, tensors)
            return
        run.result.parts.append((rows, outputs))
        self._progress.advance(len(rows))

    async def _bisect(self, run: _ChunkRun, rows: np.ndarray, tensors: dict[str, np.ndarray]) -> None:
        """Send the rows; when the server rejects them, halve until the bad rows are alone."""
        try:
            outputs = await self._client.infer(tensors, self._out_specs, self._batched)
        except RowsRejected as exc:
            if len(rows) == 1:
                row = int(rows[0])
                run.result.bad[row] = str(exc)
                self._progress.advance(1, bad=1)
                if self._fail_fast:
                    raise BatchJobError(f"row {row}: {exc}") from None
                return
            mid = len(rows) // 2
            await self._bisect(run, rows[:mid], {k: v[:mid] for k, v in tensors.items()})
            await self._bisect(run, rows[mid:], {k: v[mid:] for k, v in tensors.items()})
            return
        run.result.parts.append((rows, outputs))
        self._progress.advance(len(rows))

    async def _write(self, sink: Sink, ckpt: Checkpoint, errors_path: Path,
                     finished: asyncio.Queue[_ChunkRun | None]) -> None:
        while (run := await finished.get()) is not None:
            try:
                if self._stop.error is None:
                    extra = await asyncio.to_thread(sink.write, run.result)
                    bad = {**run.result.bad, **extra}
                    await asyncio.to_thread(commit_chunk, ckpt, run.result.start, run.result.stop, bad, errors_path)
                    self.bad_rows += len(bad)  # counted once committed: exact even when interrupted
            except (OSError, ValueError) as exc:
                self._stop.fail(BatchJobError(f"writing the output: {exc}"))
            finally:
                self._chunk_slots.release()


def _slices(groups: Sequence[RowGroup], batch_size: int) -> Iterator[tuple[RowGroup, int, int]]:
    for group in groups:
        for i in range(0, len(group.rows), batch_size):
            yield group, i, min(i + batch_size, len(group.rows))
