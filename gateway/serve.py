"""``infergate serve --model-repository DIR``: one process where one machine
serves. The gateway with local execution on: the repository's models run in
this process (``gateway.replicas.local``), with every gateway feature
in front of them, and any workers given (``--worker``) join each model's
rotation behind the local replica.

The same flags as ``infergate gateway``; ``--local`` is implied.
"""

from __future__ import annotations

import argparse

from gateway import app


def add_arguments(parser: argparse.ArgumentParser) -> None:
    app.add_arguments(parser)
    parser.set_defaults(local=True)


def run(args: argparse.Namespace) -> int:
    args.local = True
    return app.run(args)
