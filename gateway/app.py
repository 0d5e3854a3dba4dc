"""The gateway process: builds the parts and owns their start/stop order.

Start: cluster (first probe) -> core -> gRPC server -> HTTP site -> ready file.
Stop (SIGTERM/SIGINT): health NOT_SERVING -> stop accepting new connections
-> let queued and in-flight requests finish within the grace period -> close
the rest -> close worker channels. A second signal forces exit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from aiohttp import web

from .config import ConfigError, GatewayConfig, load_config
from .core import Gateway
from .grpc_api import add_grpc_services
from .http_api import create_http_app

log = logging.getLogger(__name__)

GRPC_MAX_MESSAGE_BYTES = 2**31 - 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default=None, help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--http-port", type=int, default=None, help="HTTP/REST port (default 8000; 0 picks a free one)")
    parser.add_argument("--grpc-port", type=int, default=None, help="gRPC port (default 8001; 0 picks a free one)")
    parser.add_argument(
        "--worker", action="append", default=[], metavar="[triton://]HOST:PORT",
        help="a worker server; repeat for more. triton:// marks a Triton Inference Server",
    )
    parser.add_argument("--config", default=None, help="YAML config file (see README: configuration)")
    parser.add_argument("--batching", dest="batching_mode", choices=["adaptive", "fixed", "off"], default=None,
                        help="default batching mode for every model (default adaptive)")
    parser.add_argument("--ready-file", default=None, help="write {http_port, grpc_port, pid} here once serving")
    parser.add_argument("--log-level", default="INFO")


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    return load_config(
        args.config,
        host=args.host,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        workers=args.worker or None,
        batching_mode=args.batching_mode,
    )


def write_ready_file(path: str | None, payload: dict[str, Any]) -> None:
    if not path:
        return
    tmp = Path(f"{path}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, path)


@dataclass
class RunningGateway:
    gateway: Gateway
    http_runner: web.AppRunner
    grpc_server: grpc.aio.Server
    frontend: Any
    http_port: int
    grpc_port: int

    async def stop(self, grace_s: float) -> None:
        self.frontend.set_serving(False)
        # Close the listeners first so no new connection arrives, then drain.
        with suppress(Exception):
            for site in list(self.http_runner.sites):
                await site.stop()
        grpc_stop = asyncio.create_task(self.grpc_server.stop(grace_s))
        await self.gateway.stop(grace_s)
        await grpc_stop
        await self.http_runner.cleanup()


async def start_gateway(config: GatewayConfig, gateway: Gateway | None = None) -> RunningGateway:
    gateway = gateway or Gateway(config)
    await gateway.start()

    grpc_server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", GRPC_MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", GRPC_MAX_MESSAGE_BYTES),
        ("grpc.so_reuseport", 0),
    ])
    frontend = add_grpc_services(grpc_server, gateway)
    grpc_port = grpc_server.add_insecure_port(f"{config.host}:{config.grpc_port}")
    if grpc_port == 0:
        raise ConfigError(f"cannot listen for gRPC on {config.host}:{config.grpc_port}")
    await grpc_server.start()

    app = create_http_app(gateway, max_request_bytes=config.max_request_bytes)
    runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=config.shutdown_grace_s)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.http_port, reuse_port=False)
    await site.start()
    http_port = runner.addresses[0][1]
    frontend.set_serving(True)
    log.info("gateway serving: HTTP %s:%d, gRPC %s:%d, %d worker(s)", config.host, http_port, config.host, grpc_port, len(config.workers))
    return RunningGateway(gateway, runner, grpc_server, frontend, http_port, grpc_port)


async def wait_for_signal() -> None:
    """Return on the first SIGTERM/SIGINT; a second one exits at once."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    count = 0

    def on_signal() -> None:
        nonlocal count
        count += 1
        if count > 1:
            log.warning("second signal: exiting now")
            os._exit(1)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    await stop.wait()


async def serve(config: GatewayConfig, ready_file: str | None) -> None:
    running = await start_gateway(config)
    write_ready_file(ready_file, {"http_port": running.http_port, "grpc_port": running.grpc_port, "pid": os.getpid()})
    await wait_for_signal()
    log.info("shutting down (grace %.1fs)", config.shutdown_grace_s)
    await running.stop(config.shutdown_grace_s)


def setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)


def install_event_loop_policy() -> None:
    try:
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    try:
        config = config_from_args(args)
    except ConfigError as e:
        print(f"infergate gateway: {e}", file=sys.stderr)
        return 2
    if not config.workers:
        log.warning("no workers configured: the gateway serves no model until workers are added")
    install_event_loop_policy()
    asyncio.run(serve(config, args.ready_file))
    return 0
