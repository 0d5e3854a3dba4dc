"""``infergate batch``: run a model over a whole data set, offline and resumable.

Streams the rows of a ``.npy``/``.npz``, Parquet or JSON Lines file through
a KServe v2 server (the gateway, so the whole fleet: data parallel) and
writes the outputs in the same row order to ``--output`` (its format follows
its suffix). Progress goes to stderr. An interrupted job (Ctrl-C, SIGTERM,
a crash) keeps its finished chunks in ``OUTPUT.partial/``; rerun with
``--resume`` to continue. Rows the model cannot take are listed in
``OUTPUT.errors.jsonl`` and do not stop the job unless ``--fail-fast``.

Exit status: 0 done; 3 done, with bad rows; 1 the job failed (resumable);
2 bad usage or input; 130/143 interrupted by SIGINT/SIGTERM (resumable).

This module owns the command line, signals and the final summary; the job
itself is :mod:`batchjobs.job`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from dataclasses import asdict
from pathlib import Path

import orjson

from batchjobs.client import BatchJobError
from batchjobs.job import BatchJob, JobConfig, JobReport
from batchjobs.rows import BatchInputError
from loadtest.config import BenchError, parse_header

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_BAD_ROWS = 3
_SIGNAL_EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-m", "--model", required=True, help="model name")
    parser.add_argument("-x", "--model-version", default="", help="model version (default: the server's choice)")
    parser.add_argument("-i", "--input", required=True, type=Path, help="input rows: .npy, .npz, .parquet or .jsonl")
    parser.add_argument("-o", "--output", required=True, type=Path,
                        help="output file (.npy, .npz, .parquet or .jsonl), rows in input order")
    parser.add_argument("-u", "--url", default="127.0.0.1:8001",
                        help="gRPC HOST:PORT of the gateway (default %(default)s)")
    parser.add_argument("-b", "--batch-size", type=int, default=0,
                        help="rows per request (default: the model's max_batch_size)")
    parser.add_argument("-c", "--concurrency", type=int, default=8, help="requests in flight (default %(default)s)")
    parser.add_argument("--chunk-rows", type=int, default=0,
                        help="rows per chunk, the unit of checkpointing (default: about 4 MiB of input)")
    parser.add_argument("--outputs", default="", help="comma-separated outputs to keep (default: all)")
    parser.add_argument("--resume", action="store_true", help="continue the unfinished job of this output")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output or unfinished job")
    parser.add_argument("--fail-fast", action="store_true", help="stop at the first bad row")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per request (default %(default)s)")
    parser.add_argument("--retries", type=int, default=8,
                        help="retries of a request on UNAVAILABLE / overload (default %(default)s)")
    parser.add_argument("-H", "--header", action="append", default=[], metavar="KEY:VALUE",
                        help="gRPC metadata sent with every request, e.g. 'authorization:Bearer KEY' (repeatable)")
    parser.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    parser.add_argument("--report", type=Path, default=None, help="write the summary as JSON here")
    parser.add_argument("--log-level", default="WARNING")


def config_from_args(args: argparse.Namespace) -> JobConfig:
    if args.batch_size < 0 or args.concurrency < 1 or args.chunk_rows < 0 or args.retries < 0 or args.timeout <= 0:
        raise BenchError("--batch-size, --chunk-rows and --retries must be >= 0, --concurrency >= 1, --timeout > 0")
    if args.input.resolve() == args.output.resolve():
        raise BenchError("--output must differ from --input")
    return JobConfig(
        model=args.model, model_version=args.model_version, input=args.input, output=args.output, url=args.url,
        batch_size=args.batch_size, concurrency=args.concurrency, chunk_rows=args.chunk_rows,
        outputs=tuple(n.strip() for n in args.outputs.split(",") if n.strip()), resume=args.resume,
        overwrite=args.overwrite, fail_fast=args.fail_fast, timeout_s=args.timeout, retries=args.retries,
        headers=tuple(parse_header(h) for h in args.header), progress=not args.no_progress)


async def _run_job(config: JobConfig) -> tuple[JobReport, int | None]:
    """Run the job; the first SIGINT/SIGTERM stops it cleanly, a second exits at once."""
    job = BatchJob(config)
    loop = asyncio.get_running_loop()
    received: list[int] = []

    def on_signal(signum: int) -> None:
        received.append(signum)
        if len(received) > 1:
            # Every file the job names as done is already durable: exiting here loses nothing.
            os._exit(_SIGNAL_EXIT.get(signal.Signals(signum), EXIT_FAILED))
        print(f"\n{signal.Signals(signum).name}: finishing requests in flight (again to exit now)",
              file=sys.stderr, flush=True)
        job.request_stop()

    for signum in _SIGNAL_EXIT:
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        report = await job.run()
    finally:
        for signum in _SIGNAL_EXIT:
            loop.remove_signal_handler(signum)
    return report, (received[0] if received else None)


def _run_on_fast_loop(config: JobConfig) -> tuple[JobReport, int | None]:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(_run_job(config))
    return uvloop.run(_run_job(config))


def _summary(report: JobReport) -> str:
    if report.status == "done":
        bad = f", {report.bad_rows:,} bad rows listed in {report.errors_file}" if report.bad_rows else ""
        resumed = f" ({report.resumed_rows:,} done before)" if report.resumed_rows else ""
        return (f"done: {report.rows:,} rows{resumed} in {report.seconds:.1f}s, {report.rows_per_s:,.0f} rows/s"
                f"{bad} -> {report.output}")
    return (f"interrupted: {report.done_rows:,} of {report.rows:,} rows are done and kept; "
            f"rerun with --resume to continue")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.WARNING),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        config = config_from_args(args)
    except BenchError as exc:
        print(f"infergate batch: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        report, signum = _run_on_fast_loop(config)
    except BatchInputError as exc:
        print(f"infergate batch: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BatchJobError as exc:
        print(f"infergate batch: {exc}", file=sys.stderr)
        if (config.output.parent / f"{config.output.name}.partial").exists():
            print("infergate batch: finished work is kept; rerun with --resume to continue", file=sys.stderr)
        return EXIT_FAILED
    print(_summary(report), file=sys.stderr)
    if args.report is not None:
        args.report.write_bytes(orjson.dumps(asdict(report), option=orjson.OPT_INDENT_2))
    if report.status != "done":
        return _SIGNAL_EXIT.get(signal.Signals(signum), EXIT_FAILED) if signum else EXIT_FAILED
    return EXIT_BAD_ROWS if report.bad_rows else EXIT_OK
