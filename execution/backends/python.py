"""The Python backend: models written as Triton Python-backend ``model.py``
files (``backend: "python"``), run in the worker's own process.

Owns loading ``<version>/model.py`` (its ``TritonPythonModel``: ``initialize``
with Triton's ``args``, ``execute``, ``finalize``), the
``triton_python_backend_utils`` module such files import (ours,
``python_api``, placed into ``sys.modules`` under that name while Python
models are loaded, never over another module of that name), and running
``execute``: one request per call, on a thread of the instance's own (so an
instance runs one ``execute`` at a time, as each Triton instance does),
never on the event loop.

Ordinary models return one ``InferenceResponse`` per request (or send one
through the response sender). Decoupled models send any number through
``request.get_response_sender()``, from any thread, the last with
``TRITONSERVER_RESPONSE_COMPLETE_FINAL``; each reaches the event loop with
``call_soon_threadsafe`` as a ``StreamEvent``.

Ends of a decoupled request other than the final flag: an exception from
``execute`` (an error event, in Triton's words), an error response, or the
model dropping its response sender without the final flag (an error event,
so that the client is never left waiting).

Risk: ``model.py`` is user code run with the worker's rights, in its process;
a model that blocks in ``execute`` keeps its instance (and, at shutdown, the
process) until it returns. Serve only model repositories you trust.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import importlib.util
import itertools
import json
import logging
import sys
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2 as mc

from protos.errors import (
    AlreadyExists,
    Cancelled,
    InferGateError,
    Internal,
    InvalidArgument,
    ModelNotFound,
    Unavailable,
    Unsupported,
)
from execution.backends import python_api as api
from execution.backends.base import BackendOptions, Placement, RequestContext, StreamEvent

logger = logging.getLogger(__name__)

BACKEND_NAME = "python"
DEFAULT_MODEL_FILENAME = "model.py"

_ERROR_BY_CODE: dict[int, type[InferGateError]] = {
    api.TritonError.INTERNAL: Internal,
    api.TritonError.NOT_FOUND: ModelNotFound,
    api.TritonError.INVALID_ARG: InvalidArgument,
    api.TritonError.UNAVAILABLE: Unavailable,
    api.TritonError.UNSUPPORTED: Unsupported,
    api.TritonError.ALREADY_EXISTS: AlreadyExists,
    api.TritonError.CANCELLED: Cancelled,
}


def model_error(error: api.TritonError) -> InferGateError:
    """A model's ``TritonError`` as our error of the same code (INTERNAL when unknown)."""
    return _ERROR_BY_CODE.get(error.code(), Internal)(error.message())


def execute_failure(exc: BaseException) -> InferGateError:
    """An exception out of ``execute``, as Triton's Python backend words it (without its traceback)."""
    return Internal(f"{type(exc).__name__}: {exc}")


# --- the triton_python_backend_utils module -------------------------------------


class _UtilsModule:
    """Counts the instances that need ``triton_python_backend_utils`` and keeps ours installed while any does."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0

    def acquire(self) -> None:
        with self._lock:
            present = sys.modules.get(api.MODULE_NAME)
            if present is not None and present is not api:
                raise InvalidArgument(
                    f"a module named '{api.MODULE_NAME}' other than the worker's is already imported in this "
                    "process; Python models cannot be loaded beside it"
                )
            sys.modules[api.MODULE_NAME] = api
            self._users += 1

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0 and sys.modules.get(api.MODULE_NAME) is api:
                del sys.modules[api.MODULE_NAME]


UTILS_MODULE = _UtilsModule()
_module_numbers = itertools.count()


def config_as_json(config: mc.ModelConfig) -> str:
    """The config as the JSON string Triton gives ``initialize``: proto field names, every field, numbers as numbers."""
    normalized = mc.ModelConfig()
    normalized.CopyFrom(config)
    normalized.model_transaction_policy.SetInParent()  # Triton's normalised config always has it
    as_dict = json_format.MessageToDict(
        normalized, always_print_fields_with_no_presence=True, preserving_proto_field_name=True, unquote_int64_if_possible=True
    )
    return json.dumps(as_dict)


# --- where a request's responses go ---------------------------------------------


class _StreamSink:
    """Responses of one decoupled request, from the model's threads to the event loop."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, emit: Callable[[StreamEvent], None], cancelled: threading.Event,
        output_names: Sequence[str], request_id: str,
    ) -> None:  # fmt: skip
        self._loop = loop
        self._emit = emit
        self._cancelled = cancelled
        self._output_names = output_names
        self._request_id = request_id
        self._lock = threading.Lock()
        self._ended = False

    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def send(self, response: api.InferenceResponse | None, final: bool) -> None:
        if response is not None and response.has_error():
            error = response.error()
            assert error is not None
            self.end(model_error(error))
            return
        outputs = _outputs(response, self._output_names) if response is not None else {}
        parameters = _parameters(response) if response is not None else {}
        self._deliver(StreamEvent(outputs, final, parameters=parameters), ending=final)

    def end(self, error: InferGateError) -> None:
        """End the request with ``error`` unless it has already ended."""
        self._deliver(StreamEvent({}, True, error), ending=True)

    def released(self) -> None:
        """The model dropped the response sender (garbage collected): end the request if it did not."""
        self.end(Internal(f"the model released request '{self._request_id}' without sending its final response"))

    def _deliver(self, event: StreamEvent, ending: bool) -> None:
        # Scheduled under the lock: events reach the loop in the order they were accepted,
        # and nothing after the one that ended the request.
        with self._lock:
            if self._ended:
                return
            self._ended = ending
            if self._cancelled.is_set():
                return  # nobody listens any more
            with contextlib.suppress(RuntimeError):  # the loop is closed: the worker is exiting
                self._loop.call_soon_threadsafe(self._emit, event)


class _ResponseSlot:
    """The one response of an ordinary request, if the model sends it through the response sender."""

    def __init__(self, cancelled: threading.Event) -> None:
        self._cancelled = cancelled
        self.response: api.InferenceResponse | None = None

    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def send(self, response: api.InferenceResponse | None, final: bool) -> None:
        if response is not None:
            self.response = response


def _parameters(response: api.InferenceResponse) -> dict[str, object]:
    """The response's parameters (``InferenceResponse(parameters=...)``): str, int, float or bool values."""
    try:
        values = json.loads(response.parameters() or "{}")
    except ValueError:
        return {}
    if not isinstance(values, dict):
        return {}
    return {k: v for k, v in values.items() if isinstance(v, (str, int, float, bool))}


def _outputs(response: api.InferenceResponse, wanted: Sequence[str]) -> dict[str, np.ndarray]:
    """The response's tensors the request asked for (Triton drops the others)."""
    return {t.name(): t.as_numpy() for t in response.output_tensors() if t.name() in wanted}


# --- one instance -----------------------------------------------------------------


class PythonInstance:
    """One ``TritonPythonModel`` object and the thread its ``execute`` runs on."""

    def __init__(self, model: Any, module_name: str, config: mc.ModelConfig, version: int, placement: Placement,
                 instance_name: str) -> None:  # fmt: skip
        self.placement = placement
        self._model = model
        self._module_name = module_name
        self._name = config.name
        self._version = version
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"python-model-{instance_name}")

    def _request(self, inputs: Mapping[str, np.ndarray], context: RequestContext, sink: api.ResponseSink,
                 ) -> tuple[api.InferenceRequest, api.InferenceResponseSender]:  # fmt: skip
        sender = api.InferenceResponseSender(sink)
        tensors = [api.Tensor(name, array) for name, array in inputs.items()]
        request = api.InferenceRequest(
            tensors, context.request_id, 0, list(context.output_names), dict(context.parameters), sender,
            self._name, self._version,
        )  # fmt: skip
        return request, sender

    async def infer(self, inputs: Mapping[str, np.ndarray], output_names: Sequence[str]) -> dict[str, np.ndarray]:
        """An ordinary (not decoupled) request with no id or parameters (warmup samples)."""
        return await self.infer_with_context(inputs, output_names, RequestContext("", {}, output_names))

    async def infer_with_context(self, inputs: Mapping[str, np.ndarray], output_names: Sequence[str],
                                 context: RequestContext) -> dict[str, np.ndarray]:  # fmt: skip
        """An ordinary (not decoupled) request: ``execute`` returns its one response (or sends it)."""
        cancelled = threading.Event()
        slot = _ResponseSlot(cancelled)
        request, _ = self._request(inputs, context, slot)
        future = asyncio.get_running_loop().run_in_executor(self._thread, self._execute_one, request, slot)
        del request
        try:
            response = await asyncio.shield(future)
        except asyncio.CancelledError:
            # The caller went away: tell the model, and keep the instance until execute returns.
            cancelled.set()
            await asyncio.wait({future})
            raise
        if response.has_error():
            error = response.error()
            assert error is not None
            raise model_error(error)
        return _outputs(response, output_names)

    def _execute_one(self, request: api.InferenceRequest, slot: _ResponseSlot) -> api.InferenceResponse:
        try:
            responses = self._model.execute([request])
        except Exception as exc:
            raise execute_failure(exc) from None
        if responses is None and slot.response is not None:
            return slot.response  # sent through the response sender
        if not isinstance(responses, (list, tuple)) or len(responses) != 1 \
                or not isinstance(responses[0], api.InferenceResponse):
            raise Internal(f"model '{self._name}': execute must return a list of one InferenceResponse per request")
        return responses[0]

    def start_decoupled(self, inputs: Mapping[str, np.ndarray], context: RequestContext,
                        emit: Callable[[StreamEvent], None], cancelled: threading.Event) -> asyncio.Future[None]:  # fmt: skip
        loop = asyncio.get_running_loop()
        sink = _StreamSink(loop, emit, cancelled, list(context.output_names), context.request_id)
        request, sender = self._request(inputs, context, sink)
        # When the model lets go of the sender without the final flag, end the request
        # (the sender holds no reference back to the request, nor do we after this).
        weakref.finalize(sender, sink.released)
        del sender
        return loop.run_in_executor(self._thread, self._execute_decoupled, [request], sink)

    def _execute_decoupled(self, requests: list[api.InferenceRequest], sink: _StreamSink) -> None:
        try:
            result = self._model.execute(requests)
        except Exception as exc:
            # Caught here, not left in the future: its traceback would keep the request alive.
            sink.end(execute_failure(exc))
            return
        if result is not None:
            logger.warning("model %s: decoupled execute returned %r; responses go through the response sender",
                           self._name, type(result).__name__)  # fmt: skip

    def close(self) -> None:
        """Call the model's ``finalize`` on its thread (after any running ``execute``), then let the thread go."""
        self._thread.submit(self._finalize)
        self._thread.shutdown(wait=False)

    def _finalize(self) -> None:
        try:
            finalize = getattr(self._model, "finalize", None)
            if callable(finalize):
                finalize()
        except Exception:
            logger.exception("model %s: finalize failed", self._name)
        finally:
            sys.modules.pop(self._module_name, None)
            UTILS_MODULE.release()


# --- the backend ------------------------------------------------------------------


class PythonBackend:
    name = BACKEND_NAME
    platform = ""  # Triton leaves a Python model's platform empty
    default_model_filename = DEFAULT_MODEL_FILENAME
    cpu_instances = 1
    execution_threads = 0  # each instance has its own thread

    def __init__(self, options: BackendOptions) -> None:
        self._options = options
        self._instance_numbers: dict[tuple[str, int], itertools.count[int]] = {}
        self._lock = threading.Lock()

    def gpu_count(self) -> int:
        return 0

    def describe(self) -> str:
        return "Python models (model.py) in the worker's process"

    def complete_config(self, config: mc.ModelConfig, version_dir: Path) -> mc.ModelConfig:
        if not config.input or not config.output:
            raise InvalidArgument(f"model '{config.name}': a Python model's config.pbtxt must list its inputs and outputs")
        filename = config.default_model_filename or DEFAULT_MODEL_FILENAME
        if not (version_dir / filename).is_file():
            raise InvalidArgument(f"model '{config.name}': no {filename} in version directory {version_dir.name}")
        return config

    def load(self, model_dir: Path, version_dir: Path, config: mc.ModelConfig, placement: Placement) -> PythonInstance:
        version = int(version_dir.name)
        path = version_dir / (config.default_model_filename or DEFAULT_MODEL_FILENAME)
        if not path.is_file():
            raise InvalidArgument(f"model '{config.name}': no {path.name} in version directory {version_dir.name}")
        with self._lock:
            number = next(self._instance_numbers.setdefault((config.name, version), itertools.count()))
        instance_name = f"{config.name}_0_{number}"
        module_name = f"_infergate_python_model_{next(_module_numbers)}"
        UTILS_MODULE.acquire()
        try:
            module = _import(path, module_name)
            model_class = getattr(module, "TritonPythonModel", None)
            if model_class is None:
                raise InvalidArgument(f"model '{config.name}': {path.name} defines no class TritonPythonModel")
            model = model_class()
            initialize = getattr(model, "initialize", None)
            if callable(initialize):
                initialize({
                    "model_config": config_as_json(config),
                    "model_instance_kind": "GPU" if placement.kind == "cuda" else "CPU",
                    "model_instance_name": instance_name,
                    "model_instance_device_id": str(placement.device_id),
                    "model_repository": str(model_dir),
                    "model_version": str(version),
                    "model_name": config.name,
                })  # fmt: skip
        except BaseException as exc:
            sys.modules.pop(module_name, None)
            UTILS_MODULE.release()
            if isinstance(exc, InferGateError) or not isinstance(exc, Exception):
                raise
            raise InvalidArgument(f"model '{config.name}': {path.name} failed to load: {type(exc).__name__}: {exc}") from None
        logger.info("model %s version %d: Python instance %s initialized", config.name, version, instance_name)
        return PythonInstance(model, module_name, config, version, placement, instance_name)

    def close(self) -> None:
        pass


def _import(path: Path, module_name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise InvalidArgument(f"cannot import {path.name}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # some code (dataclasses, pickling) looks its module up while it runs
    spec.loader.exec_module(module)
    return module


def create_backend(options: BackendOptions) -> PythonBackend:
    return PythonBackend(options)
