"""The gateway process: serves what the composition root builds and owns the start/stop order.

Start: both ports checked (a taken one, or both, named in one line before
anything starts) -> cluster (first probe) -> core -> gRPC server -> HTTP site
-> ready file.
Stop (SIGTERM/SIGINT): health NOT_SERVING -> stop accepting new connections
-> let queued and in-flight requests finish within the grace period -> close
the rest -> close worker channels. A second signal forces exit.

Process wiring above the composition root: it reads the whole config (ports,
limits, security, which parts start) and hands the parts below only theirs.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Mapping
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from aiohttp import web

from gateway.composition import compose
from gateway.config import load_config, parse_bool
from gateway.core import Gateway
from gateway.fleet.drain import LocalDrains
from gateway.fleet.registry import add_registry_service
from gateway.frontends.admin_routes import add_drain_routes
from gateway.frontends.grpc_api import add_grpc_services
from gateway.frontends.grpc_guard import MalformedRequestGuard
from gateway.frontends.http_api import create_http_app
from gateway.multiproc.peers import ProcessGroup
from gateway.multiproc.registrations import add_group_registry_service
from gateway.multiproc.routes import GroupViews, add_group_routes, internal_app
from gateway.multiproc.spec import PEER_HOST, ProcessSpec
from gateway.multiproc.supervisor import process_count, serve_processes
from gateway.observability.cluster_api import add_cluster_routes
from gateway.observability.dashboard import add_dashboard_routes
from gateway.observability.metrics import add_metrics_routes
from gateway.observability.trace_settings import trace_config
from gateway.requests.cuda_ipc import probe_cuda
from gateway.requests.shared_memory import SharedMemoryRegistry
from gateway.security.setup import GatewaySecurity, add_security_arguments, security_overrides
from gateway.settings import MODEL_CONTROL_MODES, ConfigError, GatewayConfig
from serverkit import tracing
from serverkit.grpc_server import BURST_OPTIONS, KEEPALIVE_SERVER_OPTIONS
from serverkit.listen import Listener, cannot_listen, cannot_listen_on, unavailable_ports
from serverkit.process import install_event_loop_policy, set_switch_interval, setup_logging, wait_for_signal, write_ready_file

log = logging.getLogger(__name__)

GRPC_MAX_MESSAGE_BYTES = 2**31 - 1
# Connections waiting to be accepted. aiohttp's default (128) overflows when
# thousands of clients connect at once: their connects are dropped and retried
# after a second or more. The kernel caps it at net.core.somaxconn (4096 on
# current kernels), as it does gRPC's listener, which asks for somaxconn.
HTTP_LISTEN_BACKLOG = 65535
# On shutdown, once every request is answered: time left to write the answers out.
_ANSWER_FLUSH_S = 1.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default=None, help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--http-port", type=int, default=None, help="HTTP/REST port (default 8000; 0 picks a free one)")
    parser.add_argument("--grpc-port", type=int, default=None, help="gRPC port (default 8001; 0 picks a free one)")
    parser.add_argument(
        "--worker", action="append", default=[], metavar="[triton://|openai://]HOST:PORT",
        help="a worker server; repeat for more. triton:// marks a Triton Inference Server, "
             "openai:// an OpenAI-protocol server (vLLM, SGLang, llama.cpp, transformers serve)",
    )
    parser.add_argument(
        "--worker-dns", action="append", default=[], metavar="[triton://]NAME:PORT",
        help="every address NAME resolves to is a worker (re-resolved; e.g. a Kubernetes headless service)",
    )
    parser.add_argument("--load-on-demand", action="store_true", default=None,
                        help="load a model on a worker when its first request comes (see docs/fleets-and-operations.md)")
    parser.add_argument("--config", default=None, help="YAML config file (see docs/configuration.md)")
    parser.add_argument("--model-repository", default=None,
                        help="the workers' model repository, read to split logical models declared with `from:`; "
                             "with --local, the models this process runs itself")
    add_local_arguments(parser)
    parser.add_argument("--batching", dest="batching_mode", choices=["adaptive", "fixed", "off"], default=None,
                        help="default batching mode for every model (default adaptive)")
    parser.add_argument("--ready-file", default=None, help="write {http_port, grpc_port, pid} here once serving (with --processes N: also gateway_pids, peer_ports)")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--processes", type=int, default=1, metavar="N",
                        help="gateway processes sharing the HTTP and gRPC ports (default 1; 0: one per core); "
                             "see docs/fleets-and-operations.md")
    # Internal: how the parent of several processes starts each one.
    parser.add_argument("--process-spec", default=None, help=argparse.SUPPRESS)
    add_triton_arguments(parser)
    add_security_arguments(parser)


def add_local_arguments(parser: argparse.ArgumentParser, *, switch: bool = True) -> None:
    """Local execution's flags (``infergate gateway --local``, ``serve``, ``up --local``)."""
    if switch:
        parser.add_argument("--local", action="store_true", default=None,
                            help="run the models of --model-repository in this process too, first in each "
                                 "model's rotation (see docs/single-process.md)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None,
                        help="local execution: auto = CUDA when a GPU is usable")
    parser.add_argument("--intra-op-threads", type=int, default=None,
                        help="local execution: threads per ONNX Runtime session (0 = the worker's default)")
    parser.add_argument("--execution-threads", type=int, default=None,
                        help="local execution: executions at once, all models (0 = the worker's default)")
    parser.add_argument("--cpu-sessions", choices=("adaptive", "shared", "per_instance"), default=None,
                        help="local execution: how ONNX Runtime sessions use the CPU (see docs/single-process.md)")


def local_overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {"local": {"enabled": getattr(args, "local", None), "device": args.device,
                      "intra_op_threads": args.intra_op_threads, "execution_threads": args.execution_threads,
                      "cpu_sessions": args.cpu_sessions}}


def _bool_flag(text: str) -> bool:
    try:
        return parse_bool(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}") from None


def add_triton_arguments(parser: argparse.ArgumentParser) -> None:
    """Triton's server flags of the same names (``infergate gateway`` and ``infergate up``)."""
    parser.add_argument("--strict-readiness", type=_bool_flag, default=None, metavar="true|false",
                        help="ready only while every model the gateway is asked to serve is servable "
                             "(default true); false: ready whenever the gateway is up")
    parser.add_argument("--model-control-mode", choices=MODEL_CONTROL_MODES, default=None,
                        help="explicit (default): clients may load and unload models through the gateway; "
                             "none: such requests are refused (the gateway's own placement still loads)")
    parser.add_argument("--server-name", default=None, metavar="NAME",
                        help="the name server metadata gives (default infergate); `triton` for clients that check it")
    parser.add_argument("--cache-size", type=int, default=None, metavar="BYTES",
                        help="response cache size in bytes (default 0, off); models with "
                             "`response_cache { enable: true }` in their config.pbtxt are answered from it")
    parser.add_argument("--trace-config", action="append", default=None, metavar="[MODE,]SETTING=VALUE",
                        help="Triton's trace settings (repeatable): level=OFF|TIMESTAMPS|TENSORS, rate=N, count=N, "
                             "mode=triton|opentelemetry, triton,file=PATH, triton,log-frequency=N, "
                             "opentelemetry,url=http://HOST:4318/v1/traces (see docs/fleets-and-operations.md#tracing)")


def triton_overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {"strict_readiness": args.strict_readiness, "model_control_mode": args.model_control_mode,
            "server_name": args.server_name,
            "cache": {"size_bytes": args.cache_size}, "trace_config": args.trace_config}


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    config = load_config(
        args.config,
        host=args.host,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        workers=args.worker or None,
        worker_dns=args.worker_dns or None,
        placement={"load_on_demand": args.load_on_demand},
        batching={"mode": args.batching_mode},
        model_repository=str(Path(args.model_repository).resolve()) if args.model_repository else None,
        **triton_overrides(args),
        **security_overrides(args),
        **local_overrides(args),
    )
    trace_config(config.extra)  # a bad --trace-config entry stops here, with its reason
    return config


@dataclass
class RunningGateway:
    gateway: Gateway
    http_runner: web.AppRunner
    grpc_server: grpc.aio.Server
    frontend: Any
    http_port: int
    grpc_port: int
    peer_runner: web.AppRunner | None = None  # the internal endpoint of a process among several
    shm: SharedMemoryRegistry | None = None  # the clients' regions: unmapped, CUDA handles closed, at the end

    async def stop(self, grace_s: float) -> None:
        self.gateway.begin_shutdown()
        self.frontend.set_serving(False)
        # Close the listeners first so no new connection arrives, then drain.
        with suppress(Exception):
            for site in list(self.http_runner.sites):
                await site.stop()
        grpc_stop = asyncio.create_task(self.grpc_server.stop(grace_s))
        await self.gateway.stop(grace_s)
        # Every request has its answer now; what still holds the server open is
        # long-lived calls (health watchers, idle streams). A moment to send the
        # last answers, then those are cancelled rather than waiting out the grace.
        await self.grpc_server.stop(min(grace_s, _ANSWER_FLUSH_S))
        await grpc_stop
        await self.http_runner.cleanup()
        if self.peer_runner is not None:
            await self.peer_runner.cleanup()
        # The last traces: the trace file's remainder, the spans still buffered for the exporter.
        self.gateway.tracing.close()
        await asyncio.to_thread(tracing.shutdown)
        if self.shm is not None:
            self.shm.close()


async def start_gateway(
    config: GatewayConfig, *, worker_metrics_urls: Mapping[str, str] | None = None,
    group: ProcessGroup | None = None,
) -> RunningGateway:
    """Start every part; ``worker_metrics_urls`` (address -> /metrics URL) lets the cluster API show devices.

    With ``group`` this is one process among several (``gateway.multiproc``): its parts are the
    group's (``gateway.composition.group_seams``), the public ports are shared (SO_REUSEPORT), the
    observability and drain routes answer for the whole gateway, and the internal peer endpoint is served too.
    """
    # Keys and certificates are read before anything starts: a bad file stops here.
    security = GatewaySecurity.from_settings(config.security, config.host)
    composed = compose(config, group)
    gateway = composed.gateway
    # trace_mode opentelemetry: this process's spans go to the configured OTLP endpoint.
    tracing.install("infergate-gateway", trace_config(config.extra))
    if composed.local is not None:  # its models loaded (and warmed up) before the cluster's first probe reads them
        await composed.local.start()
    await gateway.start()

    # The decoding guard goes first, so it wraps the others: they never see a malformed message.
    grpc_server = grpc.aio.server(interceptors=[MalformedRequestGuard(), *security.grpc_interceptors()], options=[
        # The same bound as an HTTP body: a larger message is refused (RESOURCE_EXHAUSTED) before it is read.
        ("grpc.max_receive_message_length", min(GRPC_MAX_MESSAGE_BYTES, config.max_request_bytes)),
        ("grpc.max_send_message_length", GRPC_MAX_MESSAGE_BYTES),
        ("grpc.so_reuseport", 1 if group is not None else 0),
        # Every call of a burst reaches the handlers, which serve it or refuse it with a retry hint.
        *BURST_OPTIONS,
        # Clients' keepalive pings as often as a gateway sends its workers are accepted.
        *KEEPALIVE_SERVER_OPTIONS,
    ])
    # One registry of client shared-memory regions and one set of log settings for both frontends, as in Triton.
    # CUDA shared memory is served only where this process really sees a GPU (asked once, here).
    cuda, no_cuda = probe_cuda()
    if cuda is None:
        log.info("CUDA shared memory: off, %s", no_cuda)
    else:
        log.info("CUDA shared memory: on (cuda-python, CUDA IPC)")
    # Among several processes, ones that every process holds alike (gateway.multiproc.replicated).
    shm, logs = composed.shm, composed.logs
    shm.use_cuda(cuda, no_cuda)
    frontend = add_grpc_services(grpc_server, gateway, shm=shm, logs=logs, tracing=gateway.tracing)
    # Workers started with --gateway register here (protos/cluster.proto).
    if group is None:
        add_registry_service(grpc_server, gateway.fleet.registry)
    else:  # a registration through any process reaches every process
        add_group_registry_service(grpc_server, gateway.fleet.registry, group)
    grpc_port = security.add_grpc_port(grpc_server, f"{config.host}:{config.grpc_port}")
    if grpc_port == 0:
        await gateway.stop(0)
        # The HTTP port is named too when it is taken as well: one line for every port to change.
        http_listener, grpc_listener = listeners(config)
        failures: list[tuple[Listener, OSError | None]] = [(grpc_listener, None)]
        if unavailable_ports(config.host, [http_listener]) is not None:
            failures.insert(0, (http_listener, None))
        raise ConfigError(cannot_listen_on(config.host, failures))
    await grpc_server.start()

    app = create_http_app(gateway, max_request_bytes=config.max_request_bytes, shm=shm, logs=logs,
                          tracing=gateway.tracing)
    security.install_http(app)
    # Observability routes join the REST app before setup freezes it.
    peer_runner = None
    if group is None:
        add_metrics_routes(app, gateway)
        devices = add_cluster_routes(app, gateway, worker_metrics_urls=worker_metrics_urls)
        add_drain_routes(app, LocalDrains(gateway), default_timeout_s=config.placement.drain_timeout_s)
    else:
        assert composed.replicator is not None
        views = GroupViews(gateway, group, composed.replicator, worker_metrics_urls, composed.local,
                           default_timeout_s=config.default_timeout_s,
                           drain_timeout_s=config.placement.drain_timeout_s)
        devices = views.devices
        add_group_routes(app, views)
        peer_runner = web.AppRunner(internal_app(views), access_log=None, handle_signals=False)
        await peer_runner.setup()
        await web.TCPSite(peer_runner, PEER_HOST, group.peer_port, reuse_port=True).start()
    gateway.fleet.registry.on_metrics(devices.set_metrics_url)  # registered workers' devices on /v2/cluster
    add_dashboard_routes(app)
    runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=config.shutdown_grace_s)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.http_port, reuse_port=group is not None,
                       ssl_context=security.ssl_context, backlog=HTTP_LISTEN_BACKLOG)
    try:
        await site.start()
    except OSError as e:  # the port taken, most often: one line for the person who started us, all of it stopped
        await RunningGateway(gateway, runner, grpc_server, frontend, 0, grpc_port, peer_runner, shm).stop(0)
        raise ConfigError(cannot_listen("HTTP", config.host, config.http_port, "--http-port", e)) from None
    http_port = runner.addresses[0][1]
    frontend.set_serving(True)
    log.info("gateway serving: HTTP %s:%d, gRPC %s:%d, %d worker(s)%s", config.host, http_port, config.host, grpc_port,
             len(config.workers), ", models run in this process too" if composed.local is not None else "")
    return RunningGateway(gateway, runner, grpc_server, frontend, http_port, grpc_port, peer_runner, shm)


def listeners(config: GatewayConfig) -> tuple[Listener, Listener]:
    """The gateway's public ports (HTTP, gRPC), each with the flag that chooses it."""
    return Listener("HTTP", config.http_port, "--http-port"), Listener("gRPC", config.grpc_port, "--grpc-port")


def check_ports(config: GatewayConfig) -> None:
    """Refuse to start, naming every port taken, before any model is loaded or any worker started."""
    busy = unavailable_ports(config.host, listeners(config))
    if busy is not None:
        raise ConfigError(busy)


async def serve(config: GatewayConfig, ready_file: str | None) -> None:
    running = await start_gateway(config)
    write_ready_file(ready_file, {"http_port": running.http_port, "grpc_port": running.grpc_port, "pid": os.getpid()})
    await wait_for_signal()
    log.info("shutting down (grace %.1fs)", config.shutdown_grace_s)
    await running.stop(config.shutdown_grace_s)


async def serve_in_group(spec: ProcessSpec) -> None:
    """One process among several: serve until the parent's SIGTERM, then drain."""
    group = ProcessGroup(spec)
    try:
        running = await start_gateway(spec.config, worker_metrics_urls=spec.worker_metrics_urls, group=group)
        write_ready_file(spec.ready_file, {"pid": os.getpid(), "index": spec.index})
        await wait_for_signal()
        log.info("gateway process %d shutting down (grace %.1fs)", spec.index, spec.config.shutdown_grace_s)
        await running.stop(spec.config.shutdown_grace_s)
    finally:
        await group.close()


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    name = f"infergate {getattr(args, 'command', None) or 'gateway'}"  # `gateway` or `serve`
    try:
        if args.process_spec:
            spec = ProcessSpec.read(args.process_spec)
            config = spec.config
        else:
            config = config_from_args(args)
        if args.processes < 0:
            raise ConfigError("--processes must be >= 0 (0: one per core)")
        if not args.process_spec:  # a group's process binds ports its parent holds
            check_ports(config)
    except ConfigError as e:
        print(f"{name}: {e}", file=sys.stderr)
        return 2
    if not config.workers and not args.process_spec and not config.local.enabled:
        log.warning("no workers configured: the gateway serves no model until workers are added")
    set_switch_interval()
    install_event_loop_policy()
    processes = process_count(args.processes)
    try:
        if args.process_spec:
            asyncio.run(serve_in_group(spec))
        elif processes > 1:
            return asyncio.run(serve_processes(config, processes, args.ready_file, args.log_level))
        else:
            asyncio.run(serve(config, args.ready_file))
    except ConfigError as e:  # found while starting, e.g. a logical model that cannot be split
        print(f"{name}: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # a gateway process that did not start
        print(f"{name}: {e}", file=sys.stderr)
        return 1
    return 0
