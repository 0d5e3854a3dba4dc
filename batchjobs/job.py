"""An offline batch job: stream a data set through a KServe v2 server, resumably.

Owns the pipeline and its invariants. One reader thread turns pending chunks
of the input into checked row groups (bounded queue of 2); the event loop
cuts each chunk into requests of ``batch_size`` rows and keeps at most
``concurrency`` of them in flight (through a gateway, the fleet's workers
share them: data parallelism); a finished chunk goes to one writer, which
makes it durable, appends its bad rows to the errors file and only then adds
its range to the checkpoint. Memory is bounded by the chunks alive at once:
at most ``MAX_CHUNKS_IN_FLIGHT`` dispatched or being written, plus the
reader's queue.

A request the server rejects for its rows is retried alone (no other
request of the job in flight) and split in halves until each bad row stands
by itself; the other rows are kept.

A stop request (first Ctrl-C or SIGTERM) stops dispatching, lets requests in
flight finish, writes the chunks they complete and returns; the chunks cut
short are simply repeated by ``--resume``. A fatal error does the same
before it is raised.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Awaitable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np

from batchjobs.checkpoint import (
    Checkpoint,
    CheckpointError,
    JobFingerprint,
    commit_chunk,
    keep_errors_of_done,
    publish_errors,
)
from batchjobs.client import BatchClient, BatchJobError, Isolation, JobClient, RowsRejected
from batchjobs.progress import Progress
from batchjobs.rows import Chunk, RowGroup
from batchjobs.sinks import ChunkResult, Sink, open_sink
from batchjobs.sources import Source, file_format, open_source
from loadtest.inputs import ModelSignature, TensorSpec

log = logging.getLogger(__name__)

MAX_CHUNKS_IN_FLIGHT = 4
TARGET_CHUNK_BYTES = 4 << 20
MAX_CHUNK_ROWS = 16384
_ASSUMED_VARIABLE_DIM = 64
T = TypeVar("T")


class _Stopped:
    """What a wait returns when a stop request cut it short."""


_STOPPED = _Stopped()


@dataclass(frozen=True, slots=True)
class JobConfig:
    model: str
    input: Path
    output: Path
    url: str = "127.0.0.1:8001"
    model_version: str = ""
    batch_size: int = 0  # 0: the model's max_batch_size
    concurrency: int = 8
    chunk_rows: int = 0  # 0: about TARGET_CHUNK_BYTES of input per chunk
    outputs: tuple[str, ...] = ()  # empty: every output of the model
    resume: bool = False
    overwrite: bool = False
    fail_fast: bool = False
    timeout_s: float = 60.0
    retries: int = 8
    headers: tuple[tuple[str, str], ...] = ()
    progress: bool = True


@dataclass(frozen=True, slots=True)
class JobReport:
    status: str  # "done" or "interrupted"
    rows: int
    done_rows: int
    resumed_rows: int
    bad_rows: int
    seconds: float
    rows_per_s: float
    retries: int
    output: str
    errors_file: str | None


@dataclass(slots=True)
class _ChunkRun:
    """A chunk being sent: how many of its requests are outstanding, and what came back."""

    result: ChunkResult
    pending: int = 0
    closed: bool = False  # no more requests will be dispatched for it
    complete: bool = False  # every request was dispatched (closed without a stop)


def work_dir_of(output: Path) -> Path:
    return output.with_name(output.name + ".partial")


def auto_chunk_rows(specs: Sequence[TensorSpec]) -> int:
    from protos import codec

    row_bytes = sum(codec.numpy_dtype(s.datatype).itemsize
                    * int(np.prod([d if d >= 0 else _ASSUMED_VARIABLE_DIM for d in s.dims], dtype=np.int64))
                    for s in specs)
    rows = TARGET_CHUNK_BYTES // max(row_bytes, 1)
    return int(min(MAX_CHUNK_ROWS, max(64, rows // 64 * 64)))


class BatchJob:
    def __init__(self, config: JobConfig, client: JobClient | None = None) -> None:
        self.config = config
        self.client: JobClient = client or BatchClient(
            config.url, config.model, config.model_version, headers=config.headers, timeout_s=config.timeout_s,
            retries=config.retries)
        self._stop = asyncio.Event()
        self._error: BatchJobError | None = None
        self.progress: Progress | None = None

    def request_stop(self) -> None:
        self._stop.set()

    def _fail(self, error: BatchJobError) -> None:
        if self._error is None:
            self._error = error
        self._stop.set()

    async def run(self) -> JobReport:
        try:
            return await self._run()
        finally:
            await self.client.close()

    async def _run(self) -> JobReport:
        cfg = self.config
        sig = await self.client.signature()
        self.out_specs = _select_outputs(sig, cfg.outputs)
        for spec in (*sig.inputs, *self.out_specs):
            if spec.datatype in ("BYTES", "BF16"):
                raise BatchJobError(f"{spec.name}: {spec.datatype} tensors are not supported by batch jobs")
        self.batched = sig.max_batch_size > 0
        self.batch_size = min(cfg.batch_size or sig.max_batch_size, sig.max_batch_size) if self.batched else 1
        self.specs = sig.inputs
        out_fmt = file_format(cfg.output)
        source = await asyncio.to_thread(open_source, cfg.input, sig.inputs)
        try:
            ckpt = self._checkpoint(sig, source.n_rows, out_fmt)
            sink = await asyncio.to_thread(open_sink, out_fmt, ckpt.path.parent, self.out_specs, source.n_rows)
            try:
                return await self._process(source, sink, ckpt)
            finally:
                sink.close()
        finally:
            source.close()

    def _checkpoint(self, sig: ModelSignature, n_rows: int, out_fmt: str) -> Checkpoint:
        cfg = self.config
        work = work_dir_of(cfg.output)
        path = work / "checkpoint.json"
        stat = cfg.input.stat()
        fingerprint = JobFingerprint(
            input_path=str(cfg.input.resolve()), input_size=stat.st_size, input_mtime_ns=stat.st_mtime_ns,
            model=sig.name, model_version=cfg.model_version, n_rows=n_rows,
            chunk_rows=cfg.chunk_rows or auto_chunk_rows(sig.inputs), output_format=out_fmt,
            outputs=tuple(s.name for s in self.out_specs))
        if path.exists() and cfg.resume and not cfg.overwrite:
            try:
                ckpt = Checkpoint.load(path)
            except CheckpointError as exc:
                raise BatchJobError(str(exc)) from None
            # The checkpoint's chunking wins: --chunk-rows may differ between runs.
            fingerprint = JobFingerprint(**{**fingerprint.to_json(), "chunk_rows": ckpt.fingerprint.chunk_rows,
                                            "outputs": fingerprint.outputs})
            diff = fingerprint.differences(ckpt.fingerprint)
            if diff:
                raise BatchJobError(f"the checkpoint in {work} is for another job (differs in {', '.join(diff)}); "
                                    "pass --overwrite to start over")
            return ckpt
        if path.exists() and not cfg.overwrite:
            raise BatchJobError(f"{work} holds an unfinished job: pass --resume to continue it "
                                "or --overwrite to start over")
        if cfg.output.exists() and not cfg.overwrite:
            raise BatchJobError(f"{cfg.output} exists: pass --overwrite to replace it")
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        ckpt = Checkpoint(path, fingerprint)
        ckpt.save()
        return ckpt

    async def _process(self, source: Source, sink: Sink, ckpt: Checkpoint) -> JobReport:
        cfg = self.config
        n_rows = ckpt.fingerprint.n_rows
        errors_path = ckpt.path.parent / "errors.jsonl"
        self._bad_rows = keep_errors_of_done(errors_path, ckpt)
        resumed = ckpt.done.total()
        pending = ckpt.pending()
        if resumed:
            log.info("resuming: %d of %d rows already done, %d chunks to go", resumed, n_rows, len(pending))
        self.progress = Progress(n_rows, resumed, label=cfg.model, enabled=cfg.progress)
        started = time.monotonic()
        await self._pipeline(source, pending, sink, ckpt, errors_path)
        self.progress.finish()
        seconds = time.monotonic() - started
        if self._error is not None:
            raise self._error
        done = ckpt.done.total()
        errors_file = None
        if done == n_rows:
            # A crash after the output was moved into place but before the clean-up leaves
            # a fully done checkpoint beside a finished output: assembling again would lose it.
            if not (resumed == n_rows and cfg.output.exists()):
                await asyncio.to_thread(sink.finish, cfg.output)
            errors_file = publish_errors(errors_path, cfg.output)
            shutil.rmtree(ckpt.path.parent, ignore_errors=True)
        return JobReport(
            status="done" if done == n_rows else "interrupted", rows=n_rows, done_rows=done, resumed_rows=resumed,
            bad_rows=self._bad_rows, seconds=seconds, rows_per_s=(done - resumed) / seconds if seconds > 0 else 0.0,
            retries=self.client.retried, output=str(cfg.output), errors_file=errors_file)

    async def _pipeline(self, source: Source, pending: list[tuple[int, int]], sink: Sink, ckpt: Checkpoint,
                        errors_path: Path) -> None:
        chunks: asyncio.Queue[Chunk | None] = asyncio.Queue(maxsize=2)
        finished: asyncio.Queue[_ChunkRun | None] = asyncio.Queue()
        self._chunk_slots = asyncio.Semaphore(MAX_CHUNKS_IN_FLIGHT)
        self._request_slots = asyncio.Semaphore(self.config.concurrency)
        self._finished = finished
        self._requests: set[asyncio.Task[None]] = set()
        self._isolation = Isolation()
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
            self._stop.set()
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
            self._fail(BatchJobError(f"reading {self.config.input}: {exc}"))
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
        assert self.progress is not None
        self.progress.advance(len(chunk.bad), bad=len(chunk.bad))
        if chunk.bad and self.config.fail_fast:
            row = min(chunk.bad)
            self._fail(BatchJobError(f"row {row}: {chunk.bad[row]}"))
        for group, i, j in _slices(chunk.groups, self.batch_size):
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
        if run.complete and self._error is None:
            self._finished.put_nowait(run)
        else:
            self._chunk_slots.release()  # cut short by a stop: repeated on resume

    async def _send(self, run: _ChunkRun, rows: np.ndarray, tensors: dict[str, np.ndarray]) -> None:
        try:
            await self._infer(run, rows, tensors)
        except BatchJobError as exc:
            run.complete = False
            self._fail(exc)
        except Exception as exc:  # a request task's top: never mark a chunk done that lacks rows
            log.error("request for rows %d.. failed unexpectedly", int(rows[0]), exc_info=True)
            run.complete = False
            self._fail(BatchJobError(f"internal error: {exc!r}"))
        finally:
            self._request_slots.release()
            run.pending -= 1
            if run.closed and run.pending == 0:
                self._settle(run)

    async def _infer(self, run: _ChunkRun, rows: np.ndarray, tensors: dict[str, np.ndarray]) -> None:
        await self._isolation.enter_shared()
        try:
            outputs = await self.client.infer(tensors, self.out_specs, self.batched)
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
        assert self.progress is not None
        self.progress.advance(len(rows))

    async def _bisect(self, run: _ChunkRun, rows: np.ndarray, tensors: dict[str, np.ndarray]) -> None:
        """Send the rows; when the server rejects them, halve until the bad rows are alone."""
        assert self.progress is not None
        try:
            outputs = await self.client.infer(tensors, self.out_specs, self.batched)
        except RowsRejected as exc:
            if len(rows) == 1:
                row = int(rows[0])
                run.result.bad[row] = str(exc)
                self.progress.advance(1, bad=1)
                if self.config.fail_fast:
                    raise BatchJobError(f"row {row}: {exc}") from None
                return
            mid = len(rows) // 2
            await self._bisect(run, rows[:mid], {k: v[:mid] for k, v in tensors.items()})
            await self._bisect(run, rows[mid:], {k: v[mid:] for k, v in tensors.items()})
            return
        run.result.parts.append((rows, outputs))
        self.progress.advance(len(rows))

    async def _write(self, sink: Sink, ckpt: Checkpoint, errors_path: Path,
                     finished: asyncio.Queue[_ChunkRun | None]) -> None:
        while (run := await finished.get()) is not None:
            try:
                if self._error is None:
                    extra = await asyncio.to_thread(sink.write, run.result)
                    bad = {**run.result.bad, **extra}
                    await asyncio.to_thread(commit_chunk, ckpt, run.result.start, run.result.stop, bad, errors_path)
                    self._bad_rows += len(bad)  # counted once committed: exact even when interrupted
            except (OSError, ValueError) as exc:
                self._fail(BatchJobError(f"writing the output: {exc}"))
            finally:
                self._chunk_slots.release()


def _slices(groups: Sequence[RowGroup], batch_size: int) -> Iterator[tuple[RowGroup, int, int]]:
    for group in groups:
        for i in range(0, len(group.rows), batch_size):
            yield group, i, min(i + batch_size, len(group.rows))


def _select_outputs(sig: ModelSignature, names: Sequence[str]) -> tuple[TensorSpec, ...]:
    if not names:
        return sig.outputs
    by_name = {s.name: s for s in sig.outputs}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise BatchJobError(f"model {sig.name} has no output {unknown[0]!r} (outputs: {', '.join(by_name)})")
    return tuple(by_name[n] for n in names)
