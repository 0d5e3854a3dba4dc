"""An offline batch job: stream a data set through a KServe v2 server, resumably.

Owns a job from its settings to its report: the model's signature and the
outputs asked for, the chunking, the checkpoint (a new one, or the one a
``--resume`` continues, refused when it is another job's), and the finished
output put in place with its errors file. The chunks themselves go through
``batchjobs.pipeline``.

A stop request (first Ctrl-C or SIGTERM) lets the pipeline write the chunks
in flight and returns an interrupted report; the chunks cut short are simply
repeated by ``--resume``. A fatal error does the same before it is raised.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from batchjobs.checkpoint import Checkpoint, CheckpointError, JobFingerprint, keep_errors_of_done, publish_errors
from batchjobs.client import BatchClient, BatchJobError, JobClient
from batchjobs.pipeline import ChunkPipeline, JobStop
from batchjobs.progress import Progress
from batchjobs.sinks import Sink, open_sink
from batchjobs.sources import Source, file_format, open_source
from loadtest.inputs import ModelSignature, TensorSpec

log = logging.getLogger(__name__)

TARGET_CHUNK_BYTES = 4 << 20
MAX_CHUNK_ROWS = 16384
_ASSUMED_VARIABLE_DIM = 64


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
        self._stop = JobStop()
        self.progress: Progress | None = None

    def request_stop(self) -> None:
        self._stop.request()

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
        bad_rows = keep_errors_of_done(errors_path, ckpt)
        resumed = ckpt.done.total()
        pending = ckpt.pending()
        if resumed:
            log.info("resuming: %d of %d rows already done, %d chunks to go", resumed, n_rows, len(pending))
        self.progress = Progress(n_rows, resumed, label=cfg.model, enabled=cfg.progress)
        pipeline = ChunkPipeline(
            self.client, self._stop, self.progress, out_specs=self.out_specs, batched=self.batched,
            batch_size=self.batch_size, concurrency=cfg.concurrency, fail_fast=cfg.fail_fast, input_path=cfg.input,
            bad_rows=bad_rows)
        started = time.monotonic()
        await pipeline.run(source, pending, sink, ckpt, errors_path)
        self.progress.finish()
        seconds = time.monotonic() - started
        if self._stop.error is not None:
            raise self._stop.error
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
            bad_rows=pipeline.bad_rows, seconds=seconds, rows_per_s=(done - resumed) / seconds if seconds > 0 else 0.0,
            retries=self.client.retried, output=str(cfg.output), errors_file=errors_file)

def _select_outputs(sig: ModelSignature, names: Sequence[str]) -> tuple[TensorSpec, ...]:
    if not names:
        return sig.outputs
    by_name = {s.name: s for s in sig.outputs}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise BatchJobError(f"model {sig.name} has no output {unknown[0]!r} (outputs: {', '.join(by_name)})")
    return tuple(by_name[n] for n in names)
