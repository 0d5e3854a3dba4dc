"""``infergate up``: a whole local cluster in one command.

Starts N worker processes on the model repository (each on a free port), a
gateway in this process in front of them, prints the endpoints, and keeps the
workers running: a worker that dies is restarted on its port, so the gateway's
probes bring it back into rotation. Ctrl-C/SIGTERM stops the gateway first
(draining requests), then the workers. With ``--register`` the gateway starts
first and the workers join it by registering (``infergate worker --gateway``),
as a fleet does. With ``--local`` the gateway runs the repository's models
itself too, first in each model's rotation (``--workers 0``: it alone).
Process wiring above the composition root: it reads the whole config.

Before anything starts, the gateway's two ports are checked: a taken one (or
both) is one line naming each, and no worker is started. The workers' shared
token lives in a private temporary directory, removed on every way out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import math
from collections.abc import Mapping
from contextlib import suppress
from dataclasses import replace
from functools import partial
from pathlib import Path

from gateway.app import (RunningGateway, add_local_arguments, add_triton_arguments, check_ports, local_overrides,
                         start_gateway, triton_overrides, wait_for_signal)
from gateway.observability.trace_settings import trace_config
from gateway.config import load_config
from gateway.fleet.cluster import Cluster, ModelInfo
from gateway.multiproc.supervisor import GatewayProcesses, process_count
from gateway.security.setup import add_security_arguments, local_worker_token, security_overrides
from gateway.settings import ConfigError, GatewayConfig, WorkerSpec
from serverkit.process import die_with_parent, install_event_loop_policy, set_switch_interval, setup_logging, write_ready_file

log = logging.getLogger(__name__)

WORKER_START_TIMEOUT_S = 120.0
RESTART_BACKOFF_S = 0.5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=2, help="number of local workers (default 2)")
    parser.add_argument("--model-repository", default="models", help="model repository for the workers (default models)")
    parser.add_argument("--host", default=None, help="gateway listen address (default 127.0.0.1)")
    parser.add_argument("--http-port", type=int, default=None, help="gateway HTTP port (default 8000; 0 = free port)")
    parser.add_argument("--grpc-port", type=int, default=None, help="gateway gRPC port (default 8001; 0 = free port)")
    parser.add_argument("--config", default=None, help="gateway YAML config file")
    parser.add_argument("--batching", dest="batching_mode", choices=["adaptive", "fixed", "off"], default=None)
    parser.add_argument("--worker-arg", action="append", default=[], metavar="ARG",
                        help="extra argument passed to every worker (repeatable), e.g. --worker-arg=--backend=sim")
    parser.add_argument("--register", action="store_true",
                        help="the workers register with the gateway (worker --gateway) instead of being listed; "
                             "add --worker-arg=--model-control-mode=explicit to let placement decide what each loads")
    parser.add_argument("--ready-file", default=None, help="write the endpoints as JSON here once serving")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--no-worker-token", action="store_true",
                        help="start the workers without a shared token: anyone who can reach their ports may call them")
    parser.add_argument("--gateway-processes", type=int, default=1, metavar="N",
                        help="gateway processes sharing the HTTP and gRPC ports (default 1; 0: one per core)")
    add_triton_arguments(parser)
    add_security_arguments(parser)
    add_local_arguments(parser)


class LocalWorker:
    """One supervised worker subprocess with a stable port."""

    def __init__(self, index: int, repository: str, extra_args: list[str], workdir: Path) -> None:
        self.index = index
        self.repository = repository
        self.extra_args = extra_args
        self.workdir = workdir
        self.port = 0
        self.metrics_port = 0  # kept across restarts, like the gRPC port
        self.process: asyncio.subprocess.Process | None = None
        self.stopping = False

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        ready = self.workdir / f"worker{self.index}.ready.json"
        with suppress(FileNotFoundError):
            ready.unlink()
        cmd = [
            sys.executable, "-m", "infergate", "worker",
            "--model-repository", self.repository,
            "--host", "127.0.0.1", "--port", str(self.port), "--metrics-port", str(self.metrics_port),
            "--ready-file", str(ready), *self.extra_args,
        ]
        # Own session: a terminal's Ctrl-C reaches only `up`, which stops the
        # workers after the gateway has drained. The parent-death signal makes
        # sure no worker outlives an `up` that was killed outright.
        self.process = await asyncio.create_subprocess_exec(*cmd, start_new_session=True, preexec_fn=die_with_parent)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WORKER_START_TIMEOUT_S
        while not ready.exists():
            if self.process.returncode is not None:
                raise RuntimeError(f"worker {self.index} exited with {self.process.returncode} while starting")
            if loop.time() > deadline:
                self.process.kill()
                raise RuntimeError(f"worker {self.index} not ready after {WORKER_START_TIMEOUT_S:.0f}s")
            # Polling a condition (the ready file); the worker writes it once it serves.
            await asyncio.sleep(0.05)
        info = json.loads(ready.read_text())
        self.port = int(info["grpc_port"])
        self.metrics_port = int(info["metrics_port"])

    async def supervise(self) -> None:
        """Restart the worker on its port whenever it exits unexpectedly."""
        while not self.stopping:
            assert self.process is not None
            rc = await self.process.wait()
            if self.stopping:
                return
            log.warning("worker %d (%s) exited with %s; restarting", self.index, self.address, rc)
            await asyncio.sleep(RESTART_BACKOFF_S)
            try:
                await self.start()
            except RuntimeError as e:
                log.error("restarting worker %d failed: %s", self.index, e)
                await asyncio.sleep(RESTART_BACKOFF_S * 4)

    async def stop(self, timeout_s: float) -> None:
        self.stopping = True
        proc = self.process
        if proc is None or proc.returncode is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), timeout_s)
        except asyncio.TimeoutError:
            log.warning("worker %d did not stop in %.0fs; killing it", self.index, timeout_s)
            proc.kill()
            await proc.wait()


# A JSON value for one element of each KServe datatype, for the banner's example request.
_EXAMPLE_VALUE = {"BOOL": False, "BYTES": "text"}
_PREFERRED_EXAMPLES = ("simple", "mlp")
# Inputs larger than this many elements make a curl line too long to read; metadata is suggested instead.
_MAX_EXAMPLE_ELEMENTS = 16


def try_request(models: Mapping[str, ModelInfo], base_url: str) -> str:
    """The banner's suggestion: an inference request for a model that is served.

    A model with small inputs gets a ready-to-run ``curl`` of its ``/infer``
    (dynamic dims as 1, zeros as data, optional inputs left out); a larger
    one its metadata. A decoupled model (only when nothing else is served)
    gets a ``/generate_stream`` of its required inputs. With no model served,
    the repository index.
    """
    if not models:
        return f"  no model is served yet; see the repository: curl -s -X POST {base_url}/v2/repository/index"
    unary = [m for m in models if not models[m].config.model_transaction_policy.decoupled]
    name = next((m for m in _PREFERRED_EXAMPLES if m in models), min(unary or models))
    optional = {t.name for t in models[name].config.input if t.optional}
    inputs = []
    for tensor in models[name].metadata.inputs:
        if tensor.name in optional:
            continue
        shape = [d if d > 0 else 1 for d in tensor.shape]
        count = math.prod(shape)
        if count > _MAX_EXAMPLE_ELEMENTS:
            return f"  try: curl -s {base_url}/v2/models/{name}"
        value = _EXAMPLE_VALUE.get(tensor.datatype, 0)
        inputs.append({"name": tensor.name, "shape": shape, "datatype": tensor.datatype, "data": [value] * count})
    if models[name].config.model_transaction_policy.decoupled:
        fields = {i["name"]: i["data"][0] for i in inputs}
        return f"  try: curl -sN -d '{json.dumps(fields, separators=(',', ':'))}' {base_url}/v2/models/{name}/generate_stream"
    body = json.dumps({"inputs": inputs}, separators=(",", ":"))
    return f"  try: curl -s -d '{body}' {base_url}/v2/models/{name}/infer"


async def _registered(cluster: Cluster, addresses: list[str]) -> None:
    """Wait until every worker has registered and is up (polled, bounded)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WORKER_START_TIMEOUT_S
    while not all((w := cluster.worker(a)) is not None and w.is_up for a in addresses):
        if loop.time() > deadline:
            raise RuntimeError(f"workers did not register within {WORKER_START_TIMEOUT_S:.0f}s")
        await asyncio.sleep(0.05)


async def _registered_everywhere(group: GatewayProcesses, addresses: list[str]) -> None:
    """Wait until every gateway process has every worker registered and up (polled, bounded)."""
    assert group.peers is not None
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WORKER_START_TIMEOUT_S
    while True:
        views = [json.loads(doc) for doc in await group.peers.gather("GET", "cluster")]
        if all(set(addresses) <= {w["address"] for w in view["workers"] if w["state"] != "down"}
               for view in views):
            return
        if loop.time() > deadline:
            raise RuntimeError(f"workers did not register within {WORKER_START_TIMEOUT_S:.0f}s")
        await asyncio.sleep(0.05)


def _registration_target(host: str, grpc_port: int) -> str:
    """The gateway's gRPC address as a local worker reaches it."""
    host = "127.0.0.1" if host in ("", "0.0.0.0", "::") else host
    return f"[{host}]:{grpc_port}" if ":" in host else f"{host}:{grpc_port}"


async def serve(args: argparse.Namespace, config: GatewayConfig) -> int:
    # The workers' shared token and ready files live here, and go with it on every way out: a stop or
    # a failed start here; a second signal's forced exit, which skips this block, in its last word.
    with tempfile.TemporaryDirectory(prefix="infergate-up-", ignore_cleanup_errors=True) as workdir:
        return await _serve_from(Path(workdir), args, config)


async def _serve_from(workdir: Path, args: argparse.Namespace, config: GatewayConfig) -> int:
    worker_args = list(args.worker_arg)
    token_file: Path | None = None
    if not args.no_worker_token:
        # One token for both sides, so only this gateway can drive these workers.
        token_file = local_worker_token(workdir, config.security)
        worker_args += ["--auth-token-file", str(token_file)]
        config = replace(config, security=replace(config.security, worker_token_file=str(token_file)))
    # Workers export their spans to the gateway's OpenTelemetry endpoint.
    worker_args += [f"--trace-config={entry}" for entry in trace_config(config.extra).worker_entries()]
    workers = [LocalWorker(i, args.model_repository, worker_args, workdir) for i in range(args.workers)]
    supervisors: set[asyncio.Task[None]] = set()
    running = None
    processes = process_count(args.gateway_processes)
    if processes > 1:
        return await _serve_processes(config, workers, processes, token_file, workdir, args)
    try:
        if args.register:
            # The gateway first: the workers need its gRPC port to register (their metrics ports come with it).
            running = await start_gateway(config)
            for w in workers:
                w.extra_args = [*w.extra_args, "--gateway", _registration_target(config.host, running.grpc_port)]
            await asyncio.gather(*(w.start() for w in workers))
            await _registered(running.gateway.cluster, [w.address for w in workers])
        else:
            await asyncio.gather(*(w.start() for w in workers))
            config = replace(config, workers=tuple(config.workers) + tuple(WorkerSpec(w.address) for w in workers))
            metrics_urls = {w.address: f"http://127.0.0.1:{w.metrics_port}/metrics" for w in workers}
            running = await start_gateway(config, worker_metrics_urls=metrics_urls)
        for w in workers:
            task = asyncio.create_task(w.supervise(), name=f"supervise-worker-{w.index}")
            supervisors.add(task)
            task.add_done_callback(supervisors.discard)
        endpoints = {
            "http_port": running.http_port,
            "grpc_port": running.grpc_port,
            "gateway_pid": os.getpid(),
            "gateway_pids": [os.getpid()],
            # For tools that call the workers directly (readable by this user only).
            "worker_token_file": str(token_file) if token_file is not None else None,
            "workers": [
                {"address": w.address, "metrics_port": w.metrics_port, "pid": w.process.pid if w.process else None}
                for w in workers
            ],
        }
        write_ready_file(args.ready_file, endpoints)
        host = config.host
        local = "127.0.0.1" if host in ("", "0.0.0.0", "::") else host
        print(
            f"infergate is up: HTTP http://{host}:{running.http_port}  gRPC {host}:{running.grpc_port}  "
            f"workers: {', '.join(w.address for w in workers) or 'none'}"
            f"{'  models run in the gateway too' if config.local.enabled else ''}\n"
            f"{try_request(running.gateway.cluster.models(), f'http://{local}:{running.http_port}')}\n"
            "  Ctrl-C stops everything.",
            flush=True,
        )
        await wait_for_signal(on_forced_exit=partial(shutil.rmtree, workdir, ignore_errors=True))
        log.info("stopping the local cluster")
        return 0
    finally:
        await _stop_local_cluster(config, workers, running, supervisors)


async def _serve_processes(config: GatewayConfig, workers: list[LocalWorker], count: int, token_file: Path | None,
                           workdir: Path, args: argparse.Namespace) -> int:
    """``--gateway-processes N``: the workers, then N gateway processes in front of them (``gateway.multiproc``)."""
    supervisors: set[asyncio.Task[None]] = set()
    group: GatewayProcesses | None = None
    try:
        if args.register:
            # The gateway first: the workers need its gRPC port; a registration reaches every process.
            group = GatewayProcesses(config, count, log_level=args.log_level)
            await group.start()
            for w in workers:
                w.extra_args = [*w.extra_args, "--gateway", _registration_target(config.host, group.grpc_port)]
            await asyncio.gather(*(w.start() for w in workers))
            await _registered_everywhere(group, [w.address for w in workers])
        else:
            await asyncio.gather(*(w.start() for w in workers))
            config = replace(config, workers=tuple(config.workers) + tuple(WorkerSpec(w.address) for w in workers))
            metrics_urls = {w.address: f"http://127.0.0.1:{w.metrics_port}/metrics" for w in workers}
            group = GatewayProcesses(config, count, log_level=args.log_level, worker_metrics_urls=metrics_urls)
            await group.start()
        for w in workers:
            task = asyncio.create_task(w.supervise(), name=f"supervise-worker-{w.index}")
            supervisors.add(task)
            task.add_done_callback(supervisors.discard)
        write_ready_file(args.ready_file, {
            "http_port": group.http_port, "grpc_port": group.grpc_port, "gateway_pid": os.getpid(),
            "gateway_pids": group.pids,
            "worker_token_file": str(token_file) if token_file is not None else None,
            "workers": [{"address": w.address, "metrics_port": w.metrics_port, "pid": w.process.pid if w.process else None}
                        for w in workers],
        })
        local = "127.0.0.1" if config.host in ("", "0.0.0.0", "::") else config.host
        print(f"infergate is up: HTTP http://{config.host}:{group.http_port}  gRPC {config.host}:{group.grpc_port}  "
              f"{count} gateway processes  workers: {', '.join(w.address for w in workers)}\n"
              f"  try: curl -s -X POST http://{local}:{group.http_port}/v2/repository/index\n"
              "  Ctrl-C stops everything.", flush=True)
        signalled = asyncio.ensure_future(wait_for_signal(on_forced_exit=partial(shutil.rmtree, workdir, ignore_errors=True)))
        died = asyncio.ensure_future(group.wait_any_exit())
        await asyncio.wait({signalled, died}, return_when=asyncio.FIRST_COMPLETED)
        signalled.cancel()
        if died.done():
            log.error("gateway process %d exited with %s; stopping the local cluster", *died.result())
            return 1
        died.cancel()
        log.info("stopping the local cluster")
        return 0
    finally:
        await _stop_local_cluster(config, workers, group, supervisors)


async def _stop_local_cluster(config: GatewayConfig, workers: list[LocalWorker],
                              gateway: RunningGateway | GatewayProcesses | None, supervisors: set[asyncio.Task[None]]) -> None:
    """The gateway first (it drains against live workers), then the workers' supervisors and the workers."""
    for w in workers:
        w.stopping = True  # a worker stopping now is not restarted
    if gateway is not None:
        await gateway.stop(config.shutdown_grace_s)
    for task in list(supervisors):
        task.cancel()
    await asyncio.gather(*(w.stop(config.shutdown_grace_s + 5) for w in workers), return_exceptions=True)


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    if args.gateway_processes < 0:
        print("infergate up: --gateway-processes must be >= 0 (0: one per core)", file=sys.stderr)
        return 2
    if args.workers < 0:
        print("infergate up: --workers must be >= 0", file=sys.stderr)
        return 2
    if not Path(args.model_repository).is_dir():
        print(f"infergate up: model repository {args.model_repository!r} is not a directory "
              "(build the examples with `infergate models build`)", file=sys.stderr)
        return 2
    try:
        # The gateway reads the workers' repository too: logical models declared
        # with `from: <model>` are split from it.
        config = load_config(args.config,
                             host=args.host,
                             http_port=args.http_port,
                             grpc_port=args.grpc_port,
                             batching={"mode": args.batching_mode},
                             model_repository=str(Path(args.model_repository).resolve()),
                             **triton_overrides(args),
                             **security_overrides(args),
                             **local_overrides(args))
        check_ports(config)  # before any worker starts or loads a model
    except ConfigError as e:
        print(f"infergate up: {e}", file=sys.stderr)
        return 2
    set_switch_interval()
    install_event_loop_policy()
    try:
        return asyncio.run(serve(args, config))
    except ConfigError as e:  # found while starting, e.g. a logical model that cannot be split
        print(f"infergate up: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # a worker or gateway process that did not start
        print(f"infergate up: {e}", file=sys.stderr)
        return 1
