"""``python -m loadtest.suite`` (``make bench``): the fixed benchmark suite.

Runs each registered section in order, prints progress on stderr, and writes
``<out>/results.json`` (everything measured) and ``<out>/results.md`` (one
table per section) -- the table the docs quote. Every measurement goes
through ``infergate bench``'s Python API; every process a section starts is
stopped by it. Sections on this repository:

- ``sim_check``: the simulated accelerator's latency model holds (A + n*B);
- ``overhead``: what the gateway adds at low load, gRPC and HTTP;
- ``batching``: batching off / fixed / adaptive against raw ONNX Runtime;
- ``scale``: 1..32 simulated workers behind one gateway;
- ``compute``: a compute-bound model through the gateway vs ONNX Runtime on every core;
- ``ceiling``: a light model straight to the worker, through the gateway and
  to a bare grpc.aio echo server (the Python ceiling), with CPU per request;
- ``streaming``: a decoupled model's time to first response and time between
  responses through the gateway vs straight to the worker, 1 and 16 streams;
- ``generation``: the example decoder's output tokens/s, time to first token
  and inter-token latency: continuous batching vs one sequence at a time on
  one worker, and 1 vs 2 workers;
- ``prefix``: the worker's prefix cache (time to first token of a prompt
  whose opening was served before vs cold) and prefix-aware against
  least-loaded routing over two workers;
- ``openai_servers``: a gateway in front of ``transformers serve`` against
  it direct, and infergate's worker on the same model's optimum export
  against it (time to first token, chunk gap, output tokens/s; 1 and 16
  streams; needs ``transformers[serving]`` and ``optimum-onnx``);
- ``triton``: ``bench/triton_compare.py``: a real Triton server directly,
  the gateway in front of it (relay lane and full path), the gateway in
  front of a worker, ``serve`` and a bare Python gRPC server, with CPU per
  request (needs the Triton server ``nvidia-pytriton`` bundles).

More rows come from more sections: :func:`register_section` adds one (a
``SuiteContext -> SectionResult`` function), e.g. model-parallel encoder rows;
``--only`` runs a subset and ``--list`` names them. A section that fails is
reported as such and the others still run; the exit status is then 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import logging
import os
import shlex
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from loadtest.suite_context import SuiteContext, SuiteSettings, describe_machine
from loadtest.suite_machine import run_ceiling, run_compute
from loadtest.suite_parallel import run_parallel, run_parallel_large
from loadtest.suite_report import SectionResult, format_markdown, write_results
from loadtest.suite_scale import run_scale, run_sim_check
from loadtest.suite_sections import run_batching, run_overhead
from loadtest.suite_streaming import run_streaming
from loadtest.suite_generate import run_generation
from loadtest.suite_prefix import run_prefix
from loadtest.suite_triton import run_triton
from loadtest.suite_openai_servers import run_openai_servers

log = logging.getLogger(__name__)

SectionRunner = Callable[[SuiteContext], SectionResult]

# Insertion order is run order and table order.
_SECTIONS: dict[str, SectionRunner] = {
    "sim_check": run_sim_check,
    "overhead": run_overhead,
    "batching": run_batching,
    "scale": run_scale,
    "parallel": run_parallel,
    "compute": run_compute,
    "ceiling": run_ceiling,
    "parallel_large": run_parallel_large,
    "streaming": run_streaming,
    "generation": run_generation,
    "prefix": run_prefix,
    "openai_servers": run_openai_servers,
    "triton": run_triton,
}


def register_section(key: str, runner: SectionRunner) -> None:
    """Add (or replace) a section; it runs after the built-in ones."""
    _SECTIONS[key] = runner


def section_names() -> list[str]:
    return list(_SECTIONS)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m loadtest.suite", description="Run the infergate benchmark suite.")
    parser.add_argument("--out", type=Path, default=Path("bench"), help="directory for results.json and results.md")
    parser.add_argument("--model-repository", type=Path, default=Path("models"), help="the built example repository")
    parser.add_argument("--large-repository", type=Path, default=None,
                        help="a repository holding encoder_large (`infergate models build DIR --large`); "
                             "without it the parallel_large section is skipped")
    parser.add_argument("--only", default="", metavar="A,B", help="run only these sections (see --list)")
    parser.add_argument("--quick", action="store_true", help="short windows and few levels: checks the pipeline, not numbers")
    parser.add_argument("--list", action="store_true", help="print the section names and exit")
    return parser.parse_args(argv)


def selected_sections(only: str) -> list[str]:
    if not only:
        return section_names()
    wanted = [name.strip() for name in only.split(",") if name.strip()]
    unknown = [name for name in wanted if name not in _SECTIONS]
    if unknown:
        raise SystemExit(f"unknown section(s) {unknown}; known: {', '.join(section_names())}")
    return wanted


def _failed_section(key: str, error: BaseException) -> dict[str, Any]:
    return {"key": key, "title": f"{key} (failed)", "columns": [], "rows": [],
            "notes": [f"failed: {type(error).__name__}: {error}".splitlines()[0]], "details": {}, "failed": True}  # fmt: skip


def run_suite(settings: SuiteSettings, sections: Sequence[str], workdir: Path) -> dict[str, Any]:
    ctx = SuiteContext(settings, workdir)
    started = time.monotonic()
    machine = describe_machine()
    results: dict[str, Any] = {
        "meta": {
            "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": machine["summary"],
            "machine_details": machine,
            "command": "python -m loadtest.suite " + shlex.join(sys.argv[1:]) if sys.argv[1:] else "python -m loadtest.suite",
            "quick": settings.quick,
            # Other work on the machine skews every number: say how busy it was.
            "loadavg_start": list(os.getloadavg()),
            "sections_run": list(sections),
        },
        "sections": [],
    }
    for key in sections:
        ctx.progress(f"section {key}: start (load average {os.getloadavg()[0]:.1f})")
        section_started = time.monotonic()
        try:
            section = _SECTIONS[key](ctx).to_dict()
        except Exception as exc:  # one broken section must not cost the others' numbers
            ctx.progress(f"section {key}: FAILED: {exc}")
            log.debug("section %s failed", key, exc_info=True)
            traceback.print_exc(file=sys.stderr)
            section = _failed_section(key, exc)
        section["duration_s"] = round(time.monotonic() - section_started, 1)
        results["sections"].append(section)
        ctx.progress(f"section {key}: done in {section['duration_s']:.0f}s")
    results["meta"]["duration_s"] = round(time.monotonic() - started, 1)
    results["meta"]["loadavg_end"] = list(os.getloadavg())
    return results


def _terminate(signum: int, frame: FrameType | None) -> None:
    # Turn SIGTERM into an exception so every ProcessGroup on the stack stops its processes.
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        print("\n".join(section_names()))
        return 0
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    sections = selected_sections(args.only)
    if not (args.model_repository / "mlp" / "1" / "model.onnx").is_file():
        print(f"no built model repository at {args.model_repository}: run `infergate models build {args.model_repository}`",
              file=sys.stderr)  # fmt: skip
        return 2
    signal.signal(signal.SIGTERM, _terminate)
    settings = SuiteSettings.for_run(args.model_repository.resolve(), args.quick)
    if args.large_repository is not None:
        settings = dataclasses.replace(settings, large_repository=args.large_repository.resolve())
    with tempfile.TemporaryDirectory(prefix="infergate-suite-") as workdir:
        results = run_suite(settings, sections, Path(workdir))
    json_path, md_path = write_results(results, args.out)
    print(format_markdown(results))
    print(f"wrote {md_path} and {json_path}", file=sys.stderr)
    return 1 if any(s.get("failed") for s in results["sections"]) else 0


if __name__ == "__main__":
    sys.exit(main())
