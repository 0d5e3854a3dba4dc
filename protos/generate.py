"""Regenerate the Python stubs of our own .proto files (never edit them by hand).

    python protos/generate.py          # needs grpcio-tools (the dev extra)

Compiled from the repository root with ``-I .`` so the generated modules
import each other as ``protos.<name>_pb2`` and register their files as
``protos/<name>.proto``: no clash with tritonclient's ``inference`` package.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ("protos/cluster.proto", "protos/collective.proto")


def main() -> int:
    try:
        from grpc_tools import protoc
    except ImportError:
        print("protos/generate.py needs grpcio-tools: pip install grpcio-tools", file=sys.stderr)
        return 2
    import grpc_tools

    include = str(Path(grpc_tools.__file__).parent / "_proto")
    for proto in PROTOS:
        args = ["grpc_tools.protoc", "-I", str(ROOT), "-I", include,
                f"--python_out={ROOT}", f"--grpc_python_out={ROOT}", f"--pyi_out={ROOT}", str(ROOT / proto)]
        if protoc.main(args) != 0:
            print(f"protoc failed on {proto}", file=sys.stderr)
            return 1
        print(f"generated stubs for {proto}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
