"""``infergate worker``: the worker process. Parses its options, builds the
backend, the model manager and the gRPC server, and owns their start and
stop order.

The gRPC server carries the KServe service, the health service and the
collective service (``collective_service``: peer groups of split models).

Start: bind the port -> load the models -> start serving -> health SERVING ->
write the ready file (``{"grpc_port": N, "pid": N}``, atomically) -> log
``infergate worker serving on HOST:PORT (providers: ...)``.

With ``--gateway HOST:PORT`` the worker registers with that gateway once it
serves and heartbeats to it (``workers/registration.py``); on stop it
deregisters first, so the gateway sends no new work before the listener closes.

Stop (SIGTERM or SIGINT): health NOT_SERVING and ServerReady false -> the
listener stops taking calls -> requests in progress finish (up to
``--grace-period``) -> whatever remains (idle streams, health watchers) is
cancelled -> models and backend threads are released -> exit 0. A second
signal exits at once.

Model control: ``--model-control-mode none`` (the default) loads every model
of the repository at start; ``explicit`` loads only the ``--load-model``
names (``*`` = all). In both modes the repository load/unload RPCs work,
as in Triton's explicit mode: a worker is told what to host by the gateway.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import signal
import tempfile
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from tritonclient.grpc import service_pb2_grpc

from protos.errors import InferGateError
from serverkit import process, tracing
from serverkit.grpc_server import BURST_OPTIONS, WORKER_KEEPALIVE_OPTIONS
from serverkit.listen import cannot_listen
from workers.auth import WorkerAuthError, WorkerSecurity
from workers.auth import add_arguments as add_access_arguments
from protos.collective_pb2_grpc import add_CollectiveServicer_to_server
from execution.backends.base import BackendOptions, ConfigBackends, backend_names, create_backend
from workers.collective_service import CollectiveService
from workers.groups import Groups
from execution.manager import ModelManager
from workers.peers import Mailbox, PeerAccess, PeerLinks
from workers.metrics import DeviceCollector, MetricsServer, WorkerModelCollector
from workers.registration import Registration, start_registration
from workers.registration import add_arguments as add_registration_arguments
from execution.repository import ModelRepository
from workers.service import InferenceService

logger = logging.getLogger(__name__)

# Triton accepts messages up to 2 GB; so do we (gRPC's default is 4 MB).
MAX_MESSAGE_BYTES = 2**31 - 1
SERVICE_NAME = "inference.GRPCInferenceService"


_SIM_FLAGS = (
    ("--sim-latency-ms", "latency_ms", "fixed time of every batch, ms"),
    ("--sim-per-row-us", "per_row_us", "added time per row of a batch, us"),
    ("--sim-jitter-pct", "jitter_pct", "uniform +-%% spread of each batch's time"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-repository", required=True, type=Path, help="Triton-layout model repository")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8001, help="gRPC port, 0 = any free port (default: %(default)s)")
    parser.add_argument("--backend", default="onnx", help=f"execution backend of ONNX models: {', '.join(backend_names())} "
                        "(default: %(default)s); a config with backend: \"python\" runs its model.py whatever this says")
    parser.add_argument(
        "--backend-option", action="append", default=[], metavar="KEY=VALUE", help="backend-specific setting (repeatable)"
    )
    # Shorthands for the sim backend's options (--backend-option latency_ms=... etc.).
    for flag, key, meaning in _SIM_FLAGS:
        parser.add_argument(flag, type=float, default=None, dest=f"sim_{key}", help=f"--backend sim: {meaning}")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto = CUDA when a GPU is usable")
    parser.add_argument("--intra-op-threads", type=int, default=0, help="threads per execution (0 = a quarter of the cores)")
    parser.add_argument(
        "--execution-threads", type=int, default=0, help="executions at once, all models (0 = cores / intra-op threads)"
    )
    parser.add_argument("--model-control-mode", choices=("none", "explicit"), default="none")
    parser.add_argument(
        "--load-model", action="append", default=[], metavar="NAME", help="explicit mode: model to load at start ('*' = all)"
    )
    parser.add_argument("--max-queue-size", type=int, default=1024, help="requests waiting per model before UNAVAILABLE")
    parser.add_argument("--grace-period", type=float, default=30.0, help="seconds to finish in-flight work on shutdown/unload")
    parser.add_argument(
        "--metrics-port", type=int, default=None,
        help="serve Prometheus /metrics over HTTP on this port (0 = any free port; default: off)",
    )
    parser.add_argument("--ready-file", type=Path, help="write {grpc_port, metrics_port, pid} as JSON here once serving")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    parser.add_argument("--trace-config", action="append", default=[], metavar="[MODE,]SETTING=VALUE",
                        help="Triton's trace flags; with mode=opentelemetry and opentelemetry,url=URL the worker "
                             "exports a compute span for each call that carries a sampled traceparent")
    add_access_arguments(parser)
    add_registration_arguments(parser)


def run(args: argparse.Namespace) -> int:
    process.setup_logging(args.log_level)
    try:
        trace_config = tracing.TraceConfig.parse(args.trace_config)
    except ValueError as exc:
        logger.error("%s", exc)
        return 2
    process.set_switch_interval()
    process.install_event_loop_policy()
    # Spans only under a sampled caller's context: the gateway decides what is traced.
    tracing.install("infergate-worker", trace_config, parent_based=True)
    try:
        return asyncio.run(serve(args))
    finally:
        tracing.shutdown()


def _backend_options(args: argparse.Namespace) -> BackendOptions:
    extra: dict[str, str] = {}
    for item in args.backend_option:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InferGateError(f"--backend-option {item!r}: expected KEY=VALUE")
        extra[key] = value
    for _, key, _ in _SIM_FLAGS:
        if getattr(args, f"sim_{key}", None) is not None:
            extra[key] = repr(getattr(args, f"sim_{key}"))
    return BackendOptions(
        device=args.device,
        intra_op_threads=max(0, args.intra_op_threads),
        execution_threads=max(0, args.execution_threads),
        extra=extra,
    )


def _startup_models(args: argparse.Namespace, repository: ModelRepository) -> list[str]:
    on_disk = repository.names()
    if args.model_control_mode == "none" or "*" in args.load_model:
        return on_disk
    return list(dict.fromkeys(args.load_model))


def write_ready_file(path: Path, port: int, metrics_port: int | None = None) -> None:
    payload: dict[str, int] = {"grpc_port": port, "pid": os.getpid()}
    if metrics_port is not None:
        payload["metrics_port"] = metrics_port
    process.write_ready_file(path, payload)


async def serve(args: argparse.Namespace) -> int:
    repository = ModelRepository(args.model_repository)
    if not args.model_repository.is_dir():
        logger.error("model repository %s is not a directory", args.model_repository)
        return 2
    try:
        security = WorkerSecurity.from_args(args)
    except WorkerAuthError as exc:
        logger.error("%s", exc)
        return 2
    try:
        options = _backend_options(args)
        backend = create_backend(args.backend, options)
    except InferGateError as exc:
        logger.error("cannot start the %s backend: %s", args.backend, exc.message)
        return 2
    config_backends = ConfigBackends(options)
    staging = Path(tempfile.mkdtemp(prefix="infergate-worker-"))
    manager = ModelManager(
        repository, backend, staging_root=staging, max_queue_size=args.max_queue_size, drain_timeout_s=args.grace_period,
        config_backends=config_backends,
    )
    service = InferenceService(manager)
    mailbox = Mailbox()
    peers = PeerLinks(PeerAccess(security.peer_credentials, security.peer_metadata()))
    collective = CollectiveService(Groups(manager, peers, mailbox), mailbox, service)
    devices = DeviceCollector()
    metrics = MetricsServer([WorkerModelCollector(manager), devices])
    health_service = health.aio.HealthServicer()
    server = grpc.aio.server(
        interceptors=security.interceptors(),
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            # Without this, a second worker on the same fixed port would silently share it.
            ("grpc.so_reuseport", 0),
            # Every call of a burst reaches the handlers: served, or refused while the model's queue is full.
            *BURST_OPTIONS,
            # The gateway's keepalive pings are never refused (serverkit.grpc_server).
            *WORKER_KEEPALIVE_OPTIONS,
        ]
    )
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(service, server)
    add_CollectiveServicer_to_server(collective, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_service, server)

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    registration: Registration | None = None

    def on_signal(signum: int) -> None:
        if stop.is_set():
            logger.warning("second %s: exiting now", signal.Signals(signum).name)
            os._exit(1)
        logger.info("%s received: shutting down", signal.Signals(signum).name)
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)

    try:
        port = security.add_port(server, f"{args.host}:{args.port}")
        if port == 0:
            logger.error("%s", cannot_listen("gRPC", args.host, args.port, "--port"))
            return 2
        logger.info("backend %s: %s; access: %s", args.backend, backend.describe(), security.describe())
        await manager.load_all(_startup_models(args, repository))
        if stop.is_set():
            return 0
        await server.start()
        metrics_port: int | None = None
        if args.metrics_port is not None:
            try:
                metrics_port = await metrics.start(args.host, args.metrics_port)
            except OSError as exc:
                logger.error("%s", cannot_listen("metrics", args.host, args.metrics_port, "--metrics-port", exc))
                await server.stop(None)
                return 2
            logger.info("metrics on http://%s:%d/metrics", args.host, metrics_port)
        for name in ("", SERVICE_NAME):
            await health_service.set(name, health_pb2.HealthCheckResponse.SERVING)
        # --gateway: join the gateways' clusters now that the port serves.
        registration = await start_registration(
            args, manager, use_gpus=backend.gpu_count() > 0, port=port, metrics_port=metrics_port)
        if args.ready_file is not None:
            write_ready_file(args.ready_file, port, metrics_port)
        logger.info("infergate worker serving on %s:%d (%s)", args.host, port, backend.describe())
        await stop.wait()
        if registration is not None:
            # Deregister first: the gateways stop sending work before the listener closes.
            await registration.stop()
        await _shutdown(server, service, health_service, args.grace_period)
        return 0
    finally:
        if registration is not None:
            await registration.stop()
        await peers.close()
        await metrics.stop()
        devices.close()
        await manager.close()
        backend.close()
        config_backends.close()
        shutil.rmtree(staging, ignore_errors=True)
        if args.ready_file is not None:
            args.ready_file.unlink(missing_ok=True)
        logger.info("infergate worker stopped")


SETTLE_S = 0.5


async def _shutdown(
    server: grpc.aio.Server, service: InferenceService, health_service: health.aio.HealthServicer, grace_s: float
) -> None:
    await health_service.enter_graceful_shutdown()
    service.begin_shutdown()
    # stop(grace) closes the listener at once and would wait the whole grace
    # for long-lived calls (health watchers, idle streams); so wait for our
    # own requests in progress, then cancel the rest.
    loop = asyncio.get_running_loop()
    stopping = loop.create_task(server.stop(grace_s))
    deadline = loop.time() + grace_s
    try:
        while True:
            await asyncio.wait_for(service.wait_idle(), max(0.0, deadline - loop.time()))
            # A call gRPC accepted before the listener closed may still be
            # arriving (a large request is read before our handler runs): stop
            # only after a settle window in which no new request began.
            seen = service.requests_started
            await asyncio.wait({stopping}, timeout=min(SETTLE_S, max(0.0, deadline - loop.time())))
            if stopping.done() or (service.requests_started == seen and service.idle):
                break
    except asyncio.TimeoutError:
        logger.warning("requests still running after the %.1fs grace period: cancelling them", grace_s)
    await server.stop(None)
    await stopping
