"""The ``infergate`` command line: one subcommand per module.

Each subcommand lives in the package that owns it and exposes
``add_arguments(parser)`` and ``run(args) -> int``; this module only
dispatches, importing the chosen module lazily so ``infergate worker`` does
not pay for the gateway's imports and the other way round.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "worker": ("workers.server", "run a worker server on a model repository"),
    "models": ("models.build", "build the example model repository"),
    "gateway": ("gateway.app", "run the gateway in front of workers"),
    "serve": ("gateway.serve", "run the gateway with the repository's models in its own process"),
    "up": ("gateway.up", "start a local cluster: N workers and a gateway"),
    "bench": ("loadtest.cli", "load-test any KServe v2 server (perf_analyzer style)"),
    "split": ("splitter.cli", "split an ONNX model for tensor/pipeline parallelism"),
    "drain": ("infergate.drain", "drain a worker: move its models, finish its work"),
    "batch": ("batchjobs.cli", "stream a data set through the gateway (offline job)"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="infergate", description="Batched inference gateway (KServe v2 / Triton protocol).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    wanted = argv[0] if argv and argv[0] in COMMANDS else None
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == wanted:
            module = importlib.import_module(module_name)
            module.add_arguments(p)
            p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
