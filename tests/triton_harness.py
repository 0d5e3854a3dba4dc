"""Start and stop a real NVIDIA Triton Inference Server for tests.

Owns finding the ``tritonserver`` binary that the ``nvidia-pytriton`` wheel
bundles (Linux x86_64 only), building the environment it and its Python
backend need, and the life of one server process (``start_triton`` ->
``TritonProc``).

How the bundled server is made to run:

- The backend directory is a fresh temporary one whose ``python/`` holds links
  to the wheel's Python backend library and helpers, plus the stub built for
  this interpreter's ``X.Y`` (the wheel ships one stub per Python version).
- ``LD_LIBRARY_PATH`` starts with this interpreter's ``LIBDIR``: the stub
  embeds Python and links ``libpython3.X.so``; another build of it (say the
  system's) found first runs this interpreter's standard library on a
  different C core, which breaks (``'_thread.RLock' object has no attribute
  '_recursion_count'``). The server and backend find the wheel's other
  libraries through their own run paths.
- ``PATH`` starts with this interpreter's ``bin``: the embedded interpreter
  locates itself through ``PATH``, and finding a virtualenv's ``python3`` there
  makes the stub use that virtualenv's site-packages.
- ``tritonserver`` refuses port 0, so we pick free ports (bind port 0, read,
  close) and retry with new ones when the server reports a port in use.

Readiness is ServerReady over HTTP (``/v2/health/ready``) and then over gRPC
(tritonclient), polled until a deadline while the process is alive. ``stop()``
sends SIGTERM; Triton then unloads its models (stopping their stubs) and exits
0, or exits 1 ("Exit timeout expired") when models do not unload within
``--exit-timeout-secs``, which ``stop()`` reports as a failure. ``kill()``
SIGKILLs the process group, stubs included, and removes the Python backend's
shared-memory regions they leave behind.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 30.0
# Shorter than STOP_TIMEOUT_S, so a stuck unload shows as Triton's own non-zero exit.
EXIT_TIMEOUT_S = 15
START_ATTEMPTS = 3
LOG_TAIL_CHARS = 4000
SHM_DIR = Path("/dev/shm")

# Protocol groups accepted by --grpc-restricted-protocol / --http-restricted-api.
RESTRICTABLE = frozenset(
    {
        "health", "metadata", "inference", "shared-memory", "model-config",
        "model-repository", "statistics", "trace", "logging",
    }
)
# Log lines with which Triton reports that a listener could not bind its port.
_PORT_IN_USE = ("already in use", "address in use", "failed to bind")

Restrictions = Mapping[str, tuple[str, str]]


@dataclass(frozen=True, slots=True)
class TritonDist:
    """The files of the Triton build bundled with the nvidia-pytriton wheel."""

    server: Path
    python_backend: Path
    stub: Path


def find_triton() -> tuple[TritonDist | None, str]:
    """The bundled Triton for this interpreter's Python version, or (None, why it is unusable)."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        here = f"{platform.system()} {platform.machine()}"
        return None, f"the nvidia-pytriton Triton build is Linux x86_64 only (this is {here})"
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        return None, "nvidia-pytriton is not installed"
    root = Path(next(iter(spec.submodule_search_locations))) / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    dist = TritonDist(
        server=root / "bin" / "tritonserver",
        python_backend=root / "backends" / "python",
        stub=root / "python_backend_stubs" / version / "triton_python_backend_stub",
    )
    if not os.access(dist.server, os.X_OK):
        return None, f"no tritonserver binary in {root}"
    if not (dist.python_backend / "libtriton_python.so").is_file():
        return None, f"no Python backend in {root}"
    if not dist.stub.is_file():
        return None, f"nvidia-pytriton has no Python backend stub for Python {version}"
    return dist, ""


def triton_available() -> tuple[bool, str]:
    """(True, "") when a real Triton can be started here, else (False, why not)."""
    dist, reason = find_triton()
    return dist is not None, reason


def triton_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for ``tritonserver`` (see the module docstring for why each entry)."""
    env = dict(os.environ if base is None else base)
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    lib_path = [p for p in (libdir, env.get("LD_LIBRARY_PATH", "")) if p]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(lib_path)
    env["PATH"] = os.pathsep.join(p for p in (str(Path(sys.executable).parent), env.get("PATH", "")) if p)
    return env


def make_backend_dir(dist: TritonDist, parent: Path) -> Path:
    """``parent/backends`` with ``python/`` linking the wheel's backend and this Python's stub."""
    backends = parent / "backends"
    python = backends / "python"
    python.mkdir(parents=True)
    for item in dist.python_backend.iterdir():
        if item.name != "__pycache__":
            (python / item.name).symlink_to(item)
    (python / "triton_python_backend_stub").symlink_to(dist.stub)
    return backends


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports that were free a moment ago (all held open together, then closed)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]


def process_group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of group ``pgid``, from /proc."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited while we looked
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
        state, _ppid, pgrp = stat[stat.rindex(")") + 2 :].split()[:3]
        if int(pgrp) == pgid and state != "Z":
            members.append(int(entry.name))
    return members


def grpc_header_key(key: str) -> str:
    """The gRPC metadata key Triton checks for a ``--grpc-restricted-protocol`` key (it adds a prefix)."""
    return f"triton-grpc-protocol-{key}"


def _restriction_flags(flag: str, restrictions: Restrictions) -> list[str]:
    """One ``FLAG=p1,p2:key=value`` per distinct (key, value), protocols in a stable order."""
    unknown = sorted(set(restrictions) - RESTRICTABLE)
    if unknown:
        raise ValueError(f"cannot restrict {unknown}; choose from {sorted(RESTRICTABLE)}")
    groups: dict[tuple[str, str], list[str]] = {}
    for protocol in sorted(restrictions):
        groups.setdefault(restrictions[protocol], []).append(protocol)
    return [f"{flag}={','.join(protocols)}:{key}={value}" for (key, value), protocols in groups.items()]


@dataclass
class TritonProc:
    """One running ``tritonserver``; ``stop()`` or ``kill()`` it (or use it as a context manager)."""

    popen: subprocess.Popen[bytes]
    http_port: int
    grpc_port: int
    metrics_port: int
    workdir: Path
    log_path: Path
    args: list[str]
    shm_prefix: str
    # Metadata / headers that pass every restriction this server was started with.
    grpc_headers: dict[str, str] = field(default_factory=dict)
    http_headers: dict[str, str] = field(default_factory=dict)
    startup_s: float = 0.0

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self) -> str:
        return self.log()[-LOG_TAIL_CHARS:]

    def stop(self, timeout_s: float = STOP_TIMEOUT_S, check: bool = True) -> int:
        """SIGTERM, wait for exit, and (by default) assert it exited 0 and left no stub behind."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
                message = f"tritonserver did not exit {timeout_s}s after SIGTERM"
                raise AssertionError(f"{message}\n{self.log_tail()}") from None
        leftovers = process_group_members(self.pid)
        self.kill()  # reaps leftovers and shared memory; a no-op after a clean exit
        rc = self.popen.returncode
        if check:
            assert rc == 0, f"tritonserver exited {rc}\n{self.log_tail()}"
            assert not leftovers, f"stub processes {leftovers} outlived tritonserver\n{self.log_tail()}"
        return rc

    def kill(self) -> None:
        """SIGKILL the server and its stubs (one process group), wait for them, free their shared memory."""
        # Also when the server is already gone: orphaned stubs may still hold the group.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait(timeout=STOP_TIMEOUT_S)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while members := process_group_members(self.popen.pid):
            if time.monotonic() > deadline:
                raise AssertionError(f"processes {members} of tritonserver's group survived SIGKILL")
            # Waiting for the kernel to finish the stubs, a condition with a deadline.
            time.sleep(0.02)
        self._remove_shm()

    def _remove_shm(self) -> None:
        if SHM_DIR.is_dir():
            for region in SHM_DIR.glob(f"{self.shm_prefix}*"):
                with contextlib.suppress(OSError):
                    region.unlink()

    def __enter__(self) -> TritonProc:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.stop()
        else:
            # Do not hide the test's own failure behind a shutdown assertion.
            self.stop(check=False)


def model_args(
    models: Sequence[str] | None,
    explicit: bool,
    restricted_grpc: Restrictions,
    restricted_http: Restrictions,
) -> list[str]:
    """The model-control and restriction flags of the command line; raises ValueError on bad options."""
    if explicit:
        # No --load-model at all loads nothing; '*' must be the only one when given.
        loads = ["--load-model=*"] if models is None else [f"--load-model={name}" for name in models]
        args = ["--model-control-mode=explicit", *loads]
    elif models is not None:
        raise ValueError("models selects what explicit mode loads; without explicit mode Triton loads everything")
    else:
        args = ["--model-control-mode=none"]
    args += _restriction_flags("--grpc-restricted-protocol", restricted_grpc)
    args += _restriction_flags("--http-restricted-api", restricted_http)
    return args


def server_args(
    dist: TritonDist, model_repository: Path, backend_dir: Path, ports: Sequence[int], shm_prefix: str
) -> list[str]:
    """Binary, repository, backends, loopback listeners (HTTP, gRPC, metrics ports) and shutdown bound."""
    http_port, grpc_port, metrics_port = ports
    return [
        str(dist.server),
        f"--model-repository={model_repository}",
        f"--backend-directory={backend_dir}",
        "--http-address=127.0.0.1",
        f"--http-port={http_port}",
        "--grpc-address=127.0.0.1",
        f"--grpc-port={grpc_port}",
        "--metrics-address=127.0.0.1",
        f"--metrics-port={metrics_port}",
        f"--exit-timeout-secs={EXIT_TIMEOUT_S}",
        # A per-server prefix so kill() can find the regions its stubs leave in /dev/shm.
        f"--backend-config=python,shm-region-prefix-name={shm_prefix}",
    ]


def _http_ready(proc: TritonProc) -> bool:
    # urllib, not tritonclient.http: its gevent pool must not outlive the thread that made it.
    request = urllib.request.Request(f"http://{proc.http_url}/v2/health/ready", headers=proc.http_headers)
    try:
        with urllib.request.urlopen(request, timeout=1.0) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _ready(proc: TritonProc, deadline: float) -> None:
    """Wait until ServerReady holds over HTTP and gRPC; raise if the process exits or the deadline passes."""
    import tritonclient.grpc as grpcclient

    grpc = grpcclient.InferenceServerClient(proc.grpc_url)

    def grpc_ready() -> bool:
        try:
            return bool(grpc.is_server_ready(headers=proc.grpc_headers or None, client_timeout=1.0))
        except grpcclient.InferenceServerException:
            return False

    try:
        for check in (lambda: _http_ready(proc), grpc_ready):
            while not check():
                if proc.popen.poll() is not None:
                    raise _StartFailed(proc.popen.returncode)
                if time.monotonic() > deadline:
                    raise TimeoutError
                # Polling a condition (ServerReady) until the deadline, not sleeping in its place.
                time.sleep(0.05)
    finally:
        grpc.close()


class _StartFailed(Exception):
    def __init__(self, returncode: int) -> None:
        super().__init__(returncode)
        self.returncode = returncode


def start_triton(
    model_repository: Path,
    *,
    models: list[str] | None = None,
    explicit: bool = True,
    extra_args: Sequence[str] = (),
    restricted_grpc: Restrictions | None = None,
    restricted_http: Restrictions | None = None,
    timeout_s: float = START_TIMEOUT_S,
    env: Mapping[str, str] | None = None,
    workdir: Path | None = None,
) -> TritonProc:
    """Start ``tritonserver`` on 127.0.0.1 serving ``model_repository`` and wait until it is ready.

    ``explicit`` (model control mode explicit) loads ``models`` at startup, or
    every model when ``models`` is None; without it Triton loads everything and
    refuses load/unload requests. ``restricted_grpc`` / ``restricted_http`` map
    a protocol group (see ``RESTRICTABLE``) to the (key, value) a request must
    carry; the started server's ``grpc_headers`` / ``http_headers`` hold them
    in wire form. ``env`` entries override the process environment. The log
    and backend directory go to a new directory under ``workdir`` (default: the
    system temporary directory).
    Raises ``RuntimeError`` with the log tail when the server does not come up.
    """
    dist, reason = find_triton()
    if dist is None:
        raise RuntimeError(f"Triton is not available: {reason}")
    model_repository = Path(model_repository).resolve()
    restricted_grpc = dict(restricted_grpc or {})
    restricted_http = dict(restricted_http or {})
    full_env = triton_env()
    full_env.update(env or {})
    options = model_args(models, explicit, restricted_grpc, restricted_http)
    for attempt in range(1, START_ATTEMPTS + 1):
        run_dir = Path(tempfile.mkdtemp(prefix="infergate-triton-", dir=workdir))
        backend_dir = make_backend_dir(dist, run_dir)
        shm_prefix = f"infergate_triton_{uuid.uuid4().hex[:12]}_"
        ports = free_ports(3)
        args = [*server_args(dist, model_repository, backend_dir, ports, shm_prefix), *options, *extra_args]
        log_path = run_dir / "tritonserver.log"
        started = time.monotonic()
        with open(log_path, "wb") as log:
            # Own session: kill() can take the server and its stub processes down as one group.
            popen = subprocess.Popen(
                args, cwd=run_dir, env=full_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        proc = TritonProc(
            popen=popen,
            http_port=ports[0],
            grpc_port=ports[1],
            metrics_port=ports[2],
            workdir=run_dir,
            log_path=log_path,
            args=args,
            shm_prefix=shm_prefix,
            grpc_headers={grpc_header_key(k): v for k, v in restricted_grpc.values()},
            http_headers={k: v for k, v in restricted_http.values()},
        )
        try:
            _ready(proc, started + timeout_s)
        except _StartFailed as failed:
            proc.kill()
            log_text = proc.log().lower()
            if attempt < START_ATTEMPTS and any(marker in log_text for marker in _PORT_IN_USE):
                logger.warning("tritonserver lost a port race (attempt %d), retrying on new ports", attempt)
                shutil.rmtree(run_dir, ignore_errors=True)
                continue
            raise RuntimeError(
                f"tritonserver exited {failed.returncode} before it was ready; command: {args}\n{proc.log_tail()}"
            ) from None
        except TimeoutError:
            proc.kill()
            message = f"tritonserver not ready after {timeout_s}s; command: {args}"
            raise RuntimeError(f"{message}\n{proc.log_tail()}") from None
        except BaseException:
            proc.kill()
            raise
        proc.startup_s = time.monotonic() - started
        logger.info("tritonserver pid %d ready in %.2fs: http %d grpc %d", proc.pid, proc.startup_s, ports[0], ports[1])
        return proc
    raise AssertionError("unreachable: the last attempt returns or raises")
