"""The ONNX Runtime backend: device choice, config auto-complete, sessions.

Each model instance is one ``InferenceSession``. ``session.run`` releases the
GIL, so executions run on one bounded thread pool shared by every model of the
process: its size times the intra-op threads of a session stays within the
cores, so concurrent executions never oversubscribe the CPU. The event loop
only awaits the pool. On the CPU (``cpu_sessions``, default ``adaptive``) a
model version also holds one session on every core, which a run takes when
no other runs and none ran beside another for as long as a run takes: a lone
request gets every core, concurrent ones their instances' narrower sessions
side by side.

Device: ``--device auto`` picks CUDA only when ONNX Runtime has the CUDA
provider *and* the CUDA driver reports a device (see ``execution.devices``);
otherwise the CPU provider runs everything.

Strings: ONNX Runtime's string tensors hold text. BYTES inputs arrive as
numpy object arrays of ``bytes``, which ONNX Runtime would stringify as their
Python repr (``"b'A'"``), so each element is decoded as UTF-8 first; an
element that is not valid UTF-8 is the request's fault and is refused naming
the input and the element. String outputs come back as ``str`` and are
encoded as UTF-8 by the codec, so text round-trips byte for byte.

Failures: ONNX Runtime reports a kernel's refusal of its inputs (a ``Cast``
of ``"abc"`` to a number, an index out of range) as INVALID_ARGUMENT or
RUNTIME_EXCEPTION; both depend on the request's values alone, so they are
the request's fault (400 / INVALID_ARGUMENT) and carry ONNX Runtime's
message. Resource failures (memory, the CUDA device) and any other error are
the server's, and carry their cause too. ONNX Runtime's own console log is
off (fatal errors only) unless our log is at debug level: its message reaches
the client and our debug log instead of a coloured line per refused request.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from tritonclient.grpc import model_config_pb2 as mc

from protos.errors import InvalidArgument
from execution.backends.base import BackendOptions, Placement
from execution.backends.run_errors import classify_run_error
from execution.devices import cpu_count, cuda_device_count
from execution.sequences import server_filled_inputs

logger = logging.getLogger(__name__)

BACKEND_NAME = "onnxruntime"
PLATFORM = "onnxruntime_onnx"
DEFAULT_MODEL_FILENAME = "model.onnx"
# Triton's default for auto-completed batchable models (its `default-max-batch-size`).
DEFAULT_MAX_BATCH_SIZE = 4
# How CPU instances hold sessions (``--backend-option cpu_sessions=...``); see default_intra_op_threads.
# Adaptive: a lone request on every core, concurrent ones side by side (bench/results.md, "ONNX Runtime
# sessions on the CPU": on 2 cores, cnn_large's p50 at one client 0.57x per_instance's, req/s at 64 clients 1.00x).
DEFAULT_CPU_SESSIONS = "adaptive"
# ONNX Runtime's own console logger writes a coloured line to stderr for every request it refuses;
# its message reaches the client and our log (run_errors) instead. At --log-level debug it speaks again.
_ORT_QUIET, _ORT_WARNINGS = 4, 2  # ONNX Runtime's severities: fatal only; warnings and up
_CUDA = "CUDAExecutionProvider"
_CPU = "CPUExecutionProvider"
# Words in an ONNX Runtime error that mark a failure of the server's resources,
# not of the request's values.

_CONFIG_TYPES: dict[int, int] = {
    onnx.TensorProto.BOOL: mc.TYPE_BOOL,
    onnx.TensorProto.UINT8: mc.TYPE_UINT8,
    onnx.TensorProto.UINT16: mc.TYPE_UINT16,
    onnx.TensorProto.UINT32: mc.TYPE_UINT32,
    onnx.TensorProto.UINT64: mc.TYPE_UINT64,
    onnx.TensorProto.INT8: mc.TYPE_INT8,
    onnx.TensorProto.INT16: mc.TYPE_INT16,
    onnx.TensorProto.INT32: mc.TYPE_INT32,
    onnx.TensorProto.INT64: mc.TYPE_INT64,
    onnx.TensorProto.FLOAT16: mc.TYPE_FP16,
    onnx.TensorProto.FLOAT: mc.TYPE_FP32,
    onnx.TensorProto.DOUBLE: mc.TYPE_FP64,
    onnx.TensorProto.STRING: mc.TYPE_STRING,
    onnx.TensorProto.BFLOAT16: mc.TYPE_BF16,
}


CPU_SESSIONS = ("shared", "per_instance", "adaptive")


def default_intra_op_threads(cores: int, device: str, cpu_sessions: str = DEFAULT_CPU_SESSIONS) -> int:
    """Threads of one session's pool. One on CUDA, where the CPU only feeds the device.

    ``shared`` (one session per model version on the CPU, its instances
    concurrent ``Run`` calls on it): every core, so a lone request uses them
    all and concurrent ones share one pool. ``per_instance`` (a session per
    instance): a quarter of the cores, a few executions side by side with a
    few threads each (one instance per execution thread, ``cpu_instances``,
    so a model alone still uses every core). ``adaptive``: the instances as
    ``per_instance``, plus one session per model version on every core that a
    run takes when nothing else runs (see :class:`OnnxInstance`)."""
    if device == "cuda":
        return 1
    return max(1, cores) if cpu_sessions == "shared" else max(1, cores // 4)


class _Session:
    """An ONNX Runtime session, held by every instance that runs on it (one, or
    in shared mode all CPU instances of a model version): it lives while any does."""

    __slots__ = ("session", "__weakref__")

    def __init__(self, session: ort.InferenceSession) -> None:
        self.session = session


class _Activity:
    """Runs in progress across the backend's models, and when runs last met (event loop thread only).

    A run may take the wide session only when none is in progress *and* none
    started or ended beside another for as long as the last run took: under
    load, the instances' runs often end in one turn of the event loop, and the
    next waiting batch would otherwise find nothing running, take every core
    and leave the next one's narrow session to fight it for them."""

    __slots__ = ("running", "crowded_at", "run_s", "clock")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.running = 0
        self.crowded_at = -math.inf  # the last time a run started or ended while another ran
        self.run_s = 0.0  # how long the last run took (start to end, its wait for a thread included)
        self.clock = clock

    def start(self, wide_possible: bool) -> tuple[float, bool]:
        """Count a run in; (its start time, whether it may take the wide session)."""
        now = self.clock()
        if self.running:
            self.crowded_at = now
        wide = wide_possible and not self.running and now - self.crowded_at > self.run_s
        self.running += 1
        return now, wide

    def end(self, started: float) -> None:
        now = self.clock()
        self.running -= 1
        if self.running:
            self.crowded_at = now
        self.run_s = now - started


class OnnxInstance:
    """One execution instance: runs of its ONNX Runtime session (its own, or one
    its model version's CPU instances share) on the backend's thread pool.

    With a ``wide`` session (``adaptive``), a run that starts while no other
    runs in the backend, and none has run beside another for as long as a run
    takes, takes the wide one, on every core; one that starts beside others, or
    just after, takes the instance's own, narrow session, so under load the
    runs sit side by side on a core or few each (``_Activity``)."""

    def __init__(self, session: _Session, placement: Placement, executor: ThreadPoolExecutor, model: str = "",
                 *, wide: _Session | None = None, activity: _Activity | None = None) -> None:
        self.placement = placement
        self._held: tuple[_Session | None, ...] | None = (session, wide)
        self._session: ort.InferenceSession | None = session.session
        self._wide: ort.InferenceSession | None = wide.session if wide is not None else None
        self._activity = activity or _Activity()
        self._executor = executor
        self._model = model

    async def infer(self, inputs: Mapping[str, np.ndarray], output_names: Sequence[str]) -> dict[str, np.ndarray]:
        loop = asyncio.get_running_loop()
        activity = self._activity
        started, wide = activity.start(self._wide is not None)
        session = self._wide if wide else self._session
        try:
            return await loop.run_in_executor(self._executor, self._run, inputs, list(output_names), session)
        finally:
            activity.end(started)

    def _run(self, inputs: Mapping[str, np.ndarray], output_names: list[str],
             session: ort.InferenceSession | None) -> dict[str, np.ndarray]:  # fmt: skip
        if session is None or self._session is None:  # closed by a forced unload while this call was queued
            raise InvalidArgument("model instance was unloaded")
        feeds = {name: _text_feed(array, name, self._model) for name, array in inputs.items()}
        try:
            values = session.run(output_names, feeds)
        except Exception as exc:  # ONNX Runtime's status exceptions: the request's fault or the server's
            raise classify_run_error(exc, self._model) from None
        return dict(zip(output_names, values))

    def close(self) -> None:
        # A run already on a thread holds its own reference, so the session's
        # memory goes when that run returns; nothing new can start on it.
        self._session = self._wide = None
        self._held = None


class OnnxBackend:
    name = BACKEND_NAME
    platform = PLATFORM
    default_model_filename = DEFAULT_MODEL_FILENAME

    def __init__(self, options: BackendOptions) -> None:
        self.ort_log_severity = _ORT_WARNINGS if logger.isEnabledFor(logging.DEBUG) else _ORT_QUIET
        ort.set_default_logger_severity(self.ort_log_severity)
        available = ort.get_available_providers()
        cuda_ready = _CUDA in available and cuda_device_count() > 0
        if options.device == "cuda" and not cuda_ready:
            why = "this ONNX Runtime has no CUDA provider" if _CUDA not in available else "no CUDA device is usable"
            raise InvalidArgument(f"--device cuda: {why}")
        self.device = "cuda" if options.device in ("auto", "cuda") and cuda_ready else "cpu"
        self._gpu_count = cuda_device_count() if self.device == "cuda" else 0
        cores = cpu_count()
        self.cpu_sessions = str(options.extra.get("cpu_sessions", DEFAULT_CPU_SESSIONS))
        if self.cpu_sessions not in CPU_SESSIONS:
            raise InvalidArgument(f"--backend-option cpu_sessions={self.cpu_sessions}: expected one of {', '.join(CPU_SESSIONS)}")
        shared = self.cpu_sessions == "shared" and self.device == "cpu"
        self._adaptive = self.cpu_sessions == "adaptive" and self.device == "cpu"
        self._wide_threads = max(1, cores)
        self._activity = _Activity()
        self.intra_op_threads = options.intra_op_threads or default_intra_op_threads(cores, self.device, self.cpu_sessions)
        # Shared: as many Run calls at once as cores, all on the one pool of each session
        # (ONNX Runtime's Run is thread-safe); a lone call gets every core.
        self.execution_threads = options.execution_threads or (cores if shared else max(1, cores // self.intra_op_threads))
        self._shared = shared
        # Sessions the instances of one model version share (shared mode), by what they were built from.
        self._sessions: weakref.WeakValueDictionary[tuple[str, str, int, int, bytes], _Session] = weakref.WeakValueDictionary()
        # A model whose config names no instance group gets one instance per execution
        # thread: alone on the worker it keeps every core busy (instances x intra-op = cores).
        self.cpu_instances = self.execution_threads
        self.default_max_batch_size = int(options.extra.get("default_max_batch_size", DEFAULT_MAX_BATCH_SIZE))
        self.providers = [_CUDA, _CPU] if self.device == "cuda" else [_CPU]
        self._executor = ThreadPoolExecutor(max_workers=self.execution_threads, thread_name_prefix="onnx-exec")

    def gpu_count(self) -> int:
        return self._gpu_count

    def describe(self) -> str:
        gpus = f", {self._gpu_count} GPU(s)" if self._gpu_count else ""
        return (
            f"providers: {', '.join(self.providers)}{gpus}; "
            f"{self.execution_threads} execution threads x {self.intra_op_threads} intra-op threads"
            + ("; CPU instances of a model version share one session" if self._shared else "")
            + (f"; a lone run takes a session of {self._wide_threads} threads" if self._adaptive else "")
        )

    # --- config -----------------------------------------------------------

    def complete_config(self, config: mc.ModelConfig, version_dir: Path) -> mc.ModelConfig:
        if config.backend and config.backend != BACKEND_NAME:
            raise InvalidArgument(f"model '{config.name}' asks for backend '{config.backend}'; this worker runs '{BACKEND_NAME}'")
        if config.platform and config.platform != PLATFORM:
            raise InvalidArgument(f"model '{config.name}' has platform '{config.platform}'; this worker runs '{PLATFORM}'")
        config.backend = BACKEND_NAME
        config.platform = PLATFORM
        # As Triton normalizes a config: the file read is named in it (its /config shows it).
        config.default_model_filename = config.default_model_filename or DEFAULT_MODEL_FILENAME
        graph = _read_graph(version_dir / config.default_model_filename)
        initializers = {t.name for t in graph.initializer}
        model_inputs = {v.name: v for v in graph.input if v.name not in initializers}
        model_outputs = {v.name: v for v in graph.output}
        if (
            config.max_batch_size == 0
            and not config.input
            and not config.output
            and all(_batchable(v) for v in (*model_inputs.values(), *model_outputs.values()))
        ):
            config.max_batch_size = self.default_max_batch_size
        batched = config.max_batch_size > 0
        if not config.input:
            for value in model_inputs.values():
                config.input.add(name=value.name, data_type=_config_type(value), dims=_dims(value, batched, config.name))
        if not config.output:
            for value in model_outputs.values():
                config.output.add(name=value.name, data_type=_config_type(value), dims=_dims(value, batched, config.name))
        for tensor in config.input:
            _check_against_model(config, tensor, model_inputs, "input")
        for tensor in config.output:
            _check_against_model(config, tensor, model_outputs, "output")
        # Control and state inputs of a stateful model are filled in by the worker (execution.sequences).
        declared = {t.name for t in config.input} | server_filled_inputs(config)
        missing = [name for name in model_inputs if name not in declared]
        if missing:
            raise InvalidArgument(f"model '{config.name}': config lists no input {missing}, which the model needs")
        return config

    # --- instances ----------------------------------------------------------

    def load(self, model_dir: Path, version_dir: Path, config: mc.ModelConfig, placement: Placement) -> OnnxInstance:
        path = version_dir / (config.default_model_filename or DEFAULT_MODEL_FILENAME)
        if not path.is_file():
            raise InvalidArgument(f"model file {path.name} not found in version {version_dir.name}")
        if placement.kind != "cpu" or not (self._shared or self._adaptive):
            return OnnxInstance(_Session(self._create_session(path, version_dir, config, placement)), placement,
                                self._executor, model=config.name)
        # One session per model version (and placement) on every core: all its instances' (shared), or a lone run's (adaptive).
        stat = path.stat()
        key = (str(path), str(placement), stat.st_mtime_ns, stat.st_size, config.SerializeToString(deterministic=True))
        wide = self._sessions.get(key)
        if wide is None:
            threads = self.intra_op_threads if self._shared else self._wide_threads
            wide = _Session(self._create_session(path, version_dir, config, placement, threads))
            self._sessions[key] = wide
        if self._shared:
            return OnnxInstance(wide, placement, self._executor, model=config.name)
        own = _Session(self._create_session(path, version_dir, config, placement))
        return OnnxInstance(own, placement, self._executor, model=config.name, wide=wide, activity=self._activity)

    def _create_session(self, path: Path, version_dir: Path, config: mc.ModelConfig,
                        placement: Placement, threads: int = 0) -> ort.InferenceSession:  # fmt: skip
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads or self.intra_op_threads
        options.inter_op_num_threads = 1
        options.log_severity_level = self.ort_log_severity
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # Idle intra-op threads sleep instead of spinning: several sessions share
        # the cores, and a spinning pool steals them from the others (measured on a
        # busy 2-core machine: one 2-thread cnn session ran at 0.3-0.5x its rows/s
        # with spinning on).
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if placement.kind == "cuda":
            providers: list[str | tuple[str, dict[str, str]]] = [(_CUDA, {"device_id": str(placement.device_id)}), _CPU]
        else:
            providers = [_CPU]
        try:
            session = ort.InferenceSession(str(path), options, providers=providers)
        except Exception as exc:  # ONNX Runtime raises its own exception types for bad files.
            raise InvalidArgument(f"ONNX Runtime cannot load {version_dir.name}/{path.name}: {exc}") from None
        used = session.get_providers()
        if placement.kind == "cuda" and _CUDA not in used:
            logger.warning("model %s: CUDA provider unavailable for %s, running on %s", config.name, placement, used)
        logger.debug("model %s version %s: session on %s (%s)", config.name, version_dir.name, placement, used)
        return session

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


def _text_feed(array: np.ndarray, name: str, model: str) -> np.ndarray:
    """``array`` as ONNX Runtime takes it: object arrays of bytes become arrays of UTF-8 ``str``."""
    if array.dtype != np.object_:
        return array
    items = array.reshape(-1).tolist()
    try:
        texts = [item if isinstance(item, str) else item.decode("utf-8") for item in items]
    except UnicodeDecodeError:
        index = next(i for i, item in enumerate(items) if not _is_utf8(item))
        raise InvalidArgument(
            f"input '{name}' for model '{model}': BYTES element {index} is not valid UTF-8; "
            "ONNX Runtime string tensors hold UTF-8 text only (send arbitrary bytes as UINT8)"
        ) from None
    out = np.empty(len(texts), dtype=np.object_)
    out[:] = texts
    return out.reshape(array.shape)


def _is_utf8(item: bytes | str) -> bool:
    if isinstance(item, str):
        return True
    try:
        item.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _read_graph(path: Path) -> onnx.GraphProto:
    if not path.is_file():
        raise InvalidArgument(f"model file {path.parent.name}/{path.name} not found")
    try:
        return onnx.load(str(path), load_external_data=False).graph
    except Exception as exc:  # protobuf DecodeError and friends: an unreadable file.
        raise InvalidArgument(f"{path.parent.name}/{path.name} is not a valid ONNX model: {exc}") from None


def _shape(value: onnx.ValueInfoProto) -> list[int] | None:
    """Dims with -1 for symbolic or unknown ones; None when the rank is unknown."""
    tensor = value.type.tensor_type
    if not tensor.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else -1 for d in tensor.shape.dim]


def _batchable(value: onnx.ValueInfoProto) -> bool:
    shape = _shape(value)
    return bool(shape) and shape[0] == -1  # type: ignore[index]


def _config_type(value: onnx.ValueInfoProto) -> int:
    elem = value.type.tensor_type.elem_type
    if elem not in _CONFIG_TYPES:
        raise InvalidArgument(f"tensor '{value.name}' has ONNX type {onnx.TensorProto.DataType.Name(elem)}, which is not supported")
    return _CONFIG_TYPES[elem]


def _dims(value: onnx.ValueInfoProto, batched: bool, model: str) -> list[int]:
    shape = _shape(value)
    if shape is None:
        raise InvalidArgument(f"model '{model}': tensor '{value.name}' has no shape in the ONNX file; list it in config.pbtxt")
    if batched:
        if not shape or shape[0] != -1:
            raise InvalidArgument(f"model '{model}': max_batch_size > 0 but tensor '{value.name}' has a fixed first dim {shape[:1]}")
        return shape[1:]
    return shape


def _check_against_model(
    config: mc.ModelConfig,
    tensor: mc.ModelInput | mc.ModelOutput,
    model_tensors: Mapping[str, onnx.ValueInfoProto],
    role: str,
) -> None:
    """What config.pbtxt states must agree with the ONNX file, or the load fails (as in Triton)."""
    value = model_tensors.get(tensor.name)
    if value is None:
        raise InvalidArgument(f"model '{config.name}': unexpected {role} '{tensor.name}'; the model has {sorted(model_tensors)}")
    if tensor.HasField("reshape"):
        raise InvalidArgument(f"model '{config.name}': {role} '{tensor.name}' uses reshape, which this worker does not support")
    if tensor.data_type != _config_type(value):
        raise InvalidArgument(
            f"model '{config.name}': {role} '{tensor.name}' is {mc.DataType.Name(tensor.data_type)} in the config "
            f"but {mc.DataType.Name(_config_type(value))} in the model"
        )
    shape = _shape(value)
    if shape is None:
        return
    expected = ([-1] if config.max_batch_size > 0 else []) + list(tensor.dims)
    if len(shape) != len(expected) or any(m != -1 and c != -1 and m != c for m, c in zip(shape, expected)):
        raise InvalidArgument(
            f"model '{config.name}': {role} '{tensor.name}' has dims {list(tensor.dims)} in the config "
            f"(max_batch_size {config.max_batch_size}) but shape {shape} in the model"
        )
    if config.max_batch_size > 0 and shape[0] != -1:
        raise InvalidArgument(f"model '{config.name}': max_batch_size > 0 but {role} '{tensor.name}' has a fixed first dim {shape[0]}")


def create_backend(options: BackendOptions) -> OnnxBackend:
    return OnnxBackend(options)
