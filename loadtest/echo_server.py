"""``python -m loadtest.echo_server``: the Python ceiling for the bench.

A bare ``grpc.aio`` server of ``inference.GRPCInferenceService`` that answers
every ``ModelInfer`` with one prebuilt reply, never parsing the request: the
least work a Python gRPC server on this machine can do per call. The suite
sets the gateway's requests/s and CPU per request against it.

It copies one model from a real server (``--like HOST:PORT --model NAME``):
its ModelMetadata and ModelConfig answers, and the reply that server gives to
a single-row request of zeros, so clients such as ``infergate bench`` see
the same signature and reply size. Ready file: ``{"grpc_port": N, "pid": N}``.
SIGTERM stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
from collections.abc import Callable
from pathlib import Path

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from loadtest.inputs import build_payloads, make_signature
from serverkit import process
from serverkit.grpc_server import BURST_OPTIONS

SERVICE = "inference.GRPCInferenceService"


def copy_model(address: str, model: str, headers: tuple[tuple[str, str], ...] = ()) -> dict[str, bytes]:
    """Method name -> the serialized reply ``address`` gives for ``model`` (metadata, config, one-row infer)."""
    with grpc.insecure_channel(address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        metadata = stub.ModelMetadata(service_pb2.ModelMetadataRequest(name=model), metadata=headers, timeout=30)
        config = stub.ModelConfig(service_pb2.ModelConfigRequest(name=model), metadata=headers, timeout=30)
        (payload,) = build_payloads(make_signature(metadata, config.config.max_batch_size), batch_size=1, input_data="zero")
        request = service_pb2.ModelInferRequest(model_name=model)
        for tensor in payload:
            request.inputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
            request.raw_input_contents.append(tensor.raw)
        reply = stub.ModelInfer(request, metadata=headers, timeout=30)
    return {
        "ModelMetadata": metadata.SerializeToString(),
        "ModelConfig": config.SerializeToString(),
        "ModelInfer": reply.SerializeToString(),
        "ServerLive": service_pb2.ServerLiveResponse(live=True).SerializeToString(),
        "ServerReady": service_pb2.ServerReadyResponse(ready=True).SerializeToString(),
        "ModelReady": service_pb2.ModelReadyResponse(ready=True).SerializeToString(),
    }


def _answer(reply: bytes) -> Callable[[bytes, grpc.aio.ServicerContext], object]:
    async def handler(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return reply

    return handler


async def serve(replies: dict[str, bytes], host: str, port: int, ready_file: Path | None) -> int:
    # No (de)serializers: requests stay bytes and replies go out as they are.
    handlers = {name: grpc.unary_unary_rpc_method_handler(_answer(reply)) for name, reply in replies.items()}
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0), *BURST_OPTIONS])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    process.write_ready_file(ready_file, {"grpc_port": bound, "pid": os.getpid()})
    await stop.wait()
    await server.stop(None)
    if ready_file is not None:
        ready_file.unlink(missing_ok=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.echo_server", description=__doc__.split("\n\n")[0])
    parser.add_argument("--like", required=True, metavar="HOST:PORT", help="the gRPC server to copy the model from")
    parser.add_argument("--model", required=True)
    parser.add_argument("--header", action="append", default=[], metavar="KEY:VALUE", help="gRPC metadata for --like")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--ready-file", type=Path)
    args = parser.parse_args(argv)
    headers = tuple((k.strip().lower(), v.strip()) for k, _, v in (h.partition(":") for h in args.header))
    replies = copy_model(args.like, args.model, headers)
    process.set_switch_interval()
    process.install_event_loop_policy()
    return asyncio.run(serve(replies, args.host, args.port, args.ready_file))


if __name__ == "__main__":
    raise SystemExit(main())
