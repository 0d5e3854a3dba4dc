"""``infergate bench``: load-test any KServe v2 server, perf_analyzer style.

Parses the options into one :class:`BenchConfig`, runs ``run_bench``, prints
the results table on stdout (progress goes to stderr) and writes the
``--csv``/``--json``/``--plot`` files. ``--streaming`` runs
``loadtest.stream_runner`` instead and prints its own table; ``--generate``
runs it with generation requests (``loadtest.generate``: time to first
token, inter-token latency, output tokens/s). Exit status: 0 when every level ran,
1 when requests failed at every level, 2 for a usage or setup problem, 130
after Ctrl-C (the results measured so far are still printed and written).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from loadtest.config import (
    BenchConfig,
    BenchError,
    parse_header,
    parse_int_range,
    parse_range,
    parse_shape,
    parse_warmup,
)

if TYPE_CHECKING:
    from loadtest.report import BenchResult
    from loadtest.stream_report import StreamBenchResult


class _DefaultsHelpFormatter(argparse.HelpFormatter):
    """Each option's help ends with its default, where it has one its help does not already give."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help_text = action.help or ""
        default = action.default
        if ("default" in help_text or default in (None, False, "", [], argparse.SUPPRESS)
                or not action.option_strings):
            return action.help
        return f"{help_text} (default: %(default)s)" if help_text else "default: %(default)s"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = _DefaultsHelpFormatter
    add = parser.add_argument
    target = parser.add_argument_group("target")
    target.add_argument("-m", "--model-name", dest="model", required=True, help="model to load-test")
    target.add_argument("-x", "--model-version", default="", help="model version (default: the server's choice)")
    target.add_argument("-u", "--url", default="", help="HOST:PORT (default localhost:8000 for http, :8001 for grpc)")
    target.add_argument("-i", "--protocol", choices=["http", "grpc", "openai"], default="http",
                        help="openai: the OpenAI-compatible API (with --generate)")
    target.add_argument("-H", "--header", dest="headers", action="append", default=[], metavar="KEY:VALUE",
                        help="HTTP header or gRPC metadata sent with every request (repeatable)")
    target.add_argument("--timeout-ms", type=int, default=30_000, help="client-side timeout per request")

    load = parser.add_argument_group("load")
    load.add_argument("--concurrency-range", default=None, metavar="START:END:STEP",
                      help="closed loop: requests in flight, e.g. 1:16:2 or 1:64:x2 (default 1)")
    load.add_argument("--request-rate-range", default=None, metavar="START:END:STEP",
                      help="open loop: requests/s, e.g. 100:1000:100 or 10:1000:x2")
    load.add_argument("--request-distribution", choices=["constant", "poisson"], default="constant",
                      help="open loop: spacing of the sends")
    load.add_argument("-b", "--batch-size", type=int, default=1, help="rows per request")
    load.add_argument("--processes", type=int, default=1, help="client processes sharing the load")
    load.add_argument("--streaming", action="store_true",
                      help="decoupled models: the concurrency is open streams (gRPC ModelStreamInfer, HTTP "
                           "generate_stream); reports time to first response, time between responses, responses/s")
    load.add_argument("--max-outstanding", type=int, default=4096,
                      help="open loop: requests in flight per process before sends wait (the wait counts as latency)")

    gen = parser.add_argument_group("generation (genai-perf style)")
    gen.add_argument("--generate", action="store_true",
                     help="generative model: time to first token, inter-token latency, output tokens/s")
    gen.add_argument("--prompt-tokens", type=int, default=64, metavar="N", help="prompt length in tokens (bytes)")
    gen.add_argument("--output-tokens", type=int, default=64, metavar="M", help="tokens generated per request")
    gen.add_argument("--num-prefix-prompts", type=int, default=0, metavar="K",
                     help="prompts open with one of K shared openings (system prompts), chosen at random")
    gen.add_argument("--prefix-prompt-length", type=int, default=0, metavar="P",
                     help="length of each shared opening in tokens (bytes), before the prompt's own --prompt-tokens")

    measure = parser.add_argument_group("measurement")
    measure.add_argument("-p", "--measurement-interval", type=int, default=5000, metavar="MS",
                         help="length of one measurement window")
    measure.add_argument("-s", "--stability-percentage", type=float, default=10.0,
                         help="the last 3 windows' throughput and latency must agree within this")
    measure.add_argument("-r", "--max-trials", type=int, default=10,
                         help="windows per level before giving up on stability")
    measure.add_argument("--request-count", type=int, default=0,
                         help="send exactly N requests per level instead of time windows")
    measure.add_argument("--warmup", default="0", metavar="2s|500ms|N",
                         help="before the first level: a duration, or a number of requests")

    data = parser.add_argument_group("input data")
    data.add_argument("--input-data", default="random", metavar="random|zero|FILE.json",
                      help="random (seeded), zeros, or a perf_analyzer JSON data file")
    data.add_argument("--shape", dest="shapes", action="append", default=[], metavar="NAME:D1,D2",
                      help="dims (without the batch dim) of an input with a variable shape (repeatable)")
    data.add_argument("--seed", type=int, default=0, help="seed of the random inputs and Poisson schedule")
    data.add_argument("--int-range", default="0:100", metavar="LO:HI",
                      help="random integer inputs are drawn from [LO, HI)")
    data.add_argument("--string-length", type=int, default=16, help="length of random BYTES elements")
    data.add_argument("--http-binary", action="store_true",
                      help="HTTP: send tensors with the binary data extension instead of JSON")

    out = parser.add_argument_group("output")
    out.add_argument("-f", "--csv", default=None, metavar="FILE", help="write one CSV row per level")
    out.add_argument("--json", default=None, metavar="FILE", help="write the full results as JSON")
    out.add_argument("--plot", default=None, metavar="FILE.png", help="plot latency percentiles against throughput")
    out.add_argument("--progress", action="store_true", default=None,
                     help="progress lines on stderr (default: only when stderr is a terminal)")
    add("-v", "--verbose", action="store_true", help="log more")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    if args.concurrency_range and args.request_rate_range:
        raise BenchError("give --concurrency-range or --request-rate-range, not both")
    concurrency = parse_range(args.concurrency_range, integer=True).values() if args.concurrency_range else ()
    rates = parse_range(args.request_rate_range, integer=False).values() if args.request_rate_range else ()
    warmup_s, warmup_requests = parse_warmup(args.warmup)
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    return BenchConfig(
        model=args.model, url=args.url, protocol=args.protocol, model_version=args.model_version,
        batch_size=args.batch_size,
        concurrency=tuple(int(c) for c in concurrency), request_rate=tuple(rates),
        distribution=args.request_distribution,
        measurement_interval_ms=args.measurement_interval, stability_percentage=args.stability_percentage,
        max_trials=args.max_trials, request_count=args.request_count,
        warmup_s=warmup_s, warmup_requests=warmup_requests,
        input_data=args.input_data, shapes=dict(parse_shape(s) for s in args.shapes), seed=args.seed,
        int_range=parse_int_range(args.int_range), string_length=args.string_length,
        http_binary=args.http_binary, timeout_ms=args.timeout_ms,
        headers=tuple(parse_header(h) for h in args.headers),
        processes=args.processes, max_outstanding=args.max_outstanding, progress=progress,
        streaming=args.streaming, generate=args.generate, prompt_tokens=args.prompt_tokens,
        output_tokens=args.output_tokens, prefix_prompts=args.num_prefix_prompts,
        prefix_tokens=args.prefix_prompt_length,
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    # Imported here so `infergate bench --help` stays quick.
    from loadtest.report import format_table, write_outputs
    from loadtest.runner import run_bench

    try:
        config = config_from_args(args)
        if config.generate:
            return _run_generate(config, args)
        if config.streaming:
            return _run_streaming(config, args)
        print(f"bench {config.model} at {config.url} over {config.protocol.value}, batch {config.batch_size}, "
              f"{config.mode.value} {', '.join(f'{v:g}' for v in config.levels)}, "
              f"{config.processes} client process(es)", file=sys.stderr)
        result = run_bench(config)
    except BenchError as exc:
        print(f"infergate bench: {exc}", file=sys.stderr)
        return 2
    print(format_table(result))
    return _finish(result, lambda: write_outputs(result, csv_path=args.csv, json_path=args.json,
                                                plot_path=args.plot))


def _run_streaming(config: BenchConfig, args: argparse.Namespace) -> int:
    from loadtest.stream_report import format_stream_table, write_stream_outputs
    from loadtest.stream_runner import run_stream_bench

    if args.plot:
        raise BenchError("--plot is not available with --streaming; use --csv or --json")
    print(f"bench {config.model} at {config.url} over {config.protocol.value}, streaming, "
          f"streams {', '.join(str(c) for c in config.concurrency)}", file=sys.stderr)
    result = run_stream_bench(config)
    print(format_stream_table(result))
    return _finish(result, lambda: write_stream_outputs(result, csv_path=args.csv, json_path=args.json))


def _run_generate(config: BenchConfig, args: argparse.Namespace) -> int:
    import orjson

    from loadtest.generate import format_gen_table, gen_json, gen_requests, make_gen_client
    from loadtest.stream_report import write_stream_outputs
    from loadtest.stream_runner import run_stream_bench

    if args.plot:
        raise BenchError("--plot is not available with --generate; use --csv or --json")
    print(f"bench {config.model} at {config.url} over {config.protocol.value}, generating "
          f"{config.output_tokens} tokens after {config.prompt_tokens}"
          f"{f' (after one of {config.prefix_prompts} shared openings of {config.prefix_tokens})' if config.prefix_prompts else ''}, "
          f"streams {', '.join(str(c) for c in config.concurrency)}", file=sys.stderr)
    result = run_stream_bench(config, client_factory=make_gen_client, payloads=gen_requests(config))
    print(format_gen_table(result))

    def write() -> None:
        write_stream_outputs(result, csv_path=args.csv, json_path=None)
        if args.json:
            Path(args.json).write_bytes(orjson.dumps(gen_json(result), option=orjson.OPT_INDENT_2))

    return _finish(result, write)


def _finish(result: BenchResult | StreamBenchResult, write: Callable[[], None]) -> int:
    """Writes the result files; the exit status: 2 when they cannot be written, 130 after Ctrl-C,
    1 when requests failed at every level, else 0."""
    try:
        write()
    except OSError as exc:
        print(f"infergate bench: cannot write results: {exc}", file=sys.stderr)
        return 2
    if result.interrupted:
        return 130
    if result.levels and all(lv.requests == 0 and lv.error_count > 0 for lv in result.levels):
        return 1
    return 0
