"""The seam between the worker and whatever executes a model, and the registry
that names the implementations (``--backend onnx``, ``--backend sim``).

A backend turns a model directory plus its ``ModelConfig`` into
:class:`ModelInstance` objects, one per execution instance of the config's
``instance_group``. The worker never calls a model synchronously: it awaits
``ModelInstance.infer``, so a backend that computes in threads (ONNX Runtime)
and one that only awaits a timer (the simulated accelerator) look the same.

``complete_config`` and ``load`` block (file I/O, graph optimisation) and are
called from a thread by the model manager, never on the event loop.

A decoupled model (``model_transaction_policy { decoupled: true }``) answers
one request with any number of responses: its instances are
:class:`DecoupledInstance` objects, which start an execution and report each
response as a :class:`StreamEvent` on the event loop thread.

``--backend`` picks the backend of ONNX models; a config naming a backend of
:data:`CONFIG_BACKENDS` (``backend: "python"``) goes to that one whatever
``--backend`` says (:class:`ConfigBackends`).
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from protos.errors import InferGateError, InvalidArgument

logger = logging.getLogger(__name__)

DeviceKind = Literal["cpu", "cuda"]
DeviceRequest = Literal["auto", "cpu", "cuda"]


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one model instance runs: the CPU, or one CUDA device by ordinal."""

    kind: DeviceKind
    device_id: int = 0

    def __str__(self) -> str:
        return "cpu" if self.kind == "cpu" else f"cuda:{self.device_id}"


@dataclass(frozen=True, slots=True)
class BackendOptions:
    """Process-wide settings every backend receives; built once from the CLI."""

    device: DeviceRequest = "auto"
    # Threads one instance may use for one execution; 0 lets the backend choose
    # so that (concurrent executions x intra-op threads) <= cores.
    intra_op_threads: int = 0
    # How many executions may run at once across all models; 0 = backend default.
    execution_threads: int = 0
    # Free-form ``--backend-option KEY=VALUE`` pairs for a backend's own knobs.
    extra: Mapping[str, str] = field(default_factory=dict)


class ModelInstance(Protocol):
    """One loaded execution instance of one model version.

    ``infer`` may be called again only after the previous call on the same
    instance has returned: the model manager hands each instance to one request
    at a time, the way Triton runs one execution per instance.
    """

    placement: Placement

    async def infer(self, inputs: Mapping[str, np.ndarray], output_names: Sequence[str]) -> dict[str, np.ndarray]:
        """Run one batch; returns exactly the ``output_names`` arrays."""
        ...

    def close(self) -> None:
        """Release the instance's memory (device memory above all) now."""
        ...


@dataclass(frozen=True, slots=True)
class RequestContext:
    """What a model may read of a request beyond its tensors."""

    request_id: str
    parameters: Mapping[str, object]  # the request's parameters, as JSON values
    output_names: Sequence[str]  # the outputs to return (all the model's when the request named none)


@dataclass(frozen=True, slots=True)
class StreamEvent:
    """One response of a decoupled request: outputs (maybe none) and whether it is the last.

    An event with an ``error`` ends the request.
    """

    outputs: Mapping[str, np.ndarray]
    final: bool
    error: InferGateError | None = None
    # Response parameters (str, int, float or bool values), e.g. a generation's finish_reason on its final response.
    parameters: Mapping[str, object] = field(default_factory=dict)


class DecoupledInstance(Protocol):
    """An instance of a decoupled model: one request, any number of responses."""

    placement: Placement

    def start_decoupled(
        self,
        inputs: Mapping[str, np.ndarray],
        context: RequestContext,
        emit: Callable[[StreamEvent], None],
        cancelled: threading.Event,
    ) -> asyncio.Future[None]:
        """Start executing one request; call on the event loop thread.

        ``emit`` is called on the event loop thread for each response, the last
        one final (or carrying an error). The returned future completes when
        the model's ``execute`` has returned: the instance may take the next
        request then, even if responses of this one are still to come.
        ``cancelled`` set means the client went away: the model may stop.
        """
        ...

    def close(self) -> None: ...


class Backend(Protocol):
    name: str  # the config's ``backend`` value this backend serves, e.g. "onnxruntime"
    platform: str  # the config's ``platform`` value, e.g. "onnxruntime_onnx"
    default_model_filename: str

    # Instances a model gets on the CPU when its config names no ``instance_group``:
    # enough that one model alone keeps every core busy.
    cpu_instances: int
    # Executions that may run at once across all models of the process (a shared
    # thread pool); 0 = no bound beyond the instances (each instance runs one).
    execution_threads: int

    def gpu_count(self) -> int:
        """CUDA devices this backend can really use (0 when it runs on the CPU only)."""
        ...

    def describe(self) -> str:
        """One line for the startup log: what executes models (providers, devices)."""
        ...

    def complete_config(self, config: mc.ModelConfig, version_dir: Path) -> mc.ModelConfig:
        """Fill what the config leaves out (inputs, outputs, batching) from the model file,
        and check that what it states agrees with the file. Raises InvalidArgument."""
        ...

    def load(self, model_dir: Path, version_dir: Path, config: mc.ModelConfig, placement: Placement) -> ModelInstance:
        """Create one instance. Raises InvalidArgument when the model cannot be loaded."""
        ...

    def close(self) -> None:
        """Stop the backend's threads; called once, after every instance is closed."""
        ...


BackendFactory = Callable[[BackendOptions], Backend]

# name -> "module:function" (imported on first use, so a backend's heavy
# imports are paid only by the processes that choose it) or a factory.
_REGISTRY: dict[str, str | BackendFactory] = {
    "onnx": "execution.backends.onnx:create_backend",
    "sim": "execution.backends.sim:create_backend",
    "python": "execution.backends.python:create_backend",
    "generate": "execution.backends.generate:create_backend",
    "embed": "execution.backends.embed:create_backend",
}

# A config's ``backend`` value -> the registry name of the backend that serves
# it whatever ``--backend`` says: Python models run their own code, generation
# models their own decoding loop, embedding models their tokenizer and pooling.
CONFIG_BACKENDS: Mapping[str, str] = {"python": "python", "generate": "generate", "embed": "embed"}


def register_backend(name: str, factory: str | BackendFactory) -> None:
    """Make ``--backend NAME`` available; ``factory`` is a callable or "module:function"."""
    _REGISTRY[name] = factory


def backend_names() -> list[str]:
    return sorted(_REGISTRY)


def create_backend(name: str, options: BackendOptions) -> Backend:
    """Build the backend registered under ``name``. Raises InvalidArgument if unknown."""
    factory = _REGISTRY.get(name)
    if factory is None:
        raise InvalidArgument(f"unknown backend {name!r}; available: {', '.join(backend_names())}")
    if isinstance(factory, str):
        module_name, _, attr = factory.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            raise InvalidArgument(f"backend {name!r} is not installed (no module {module_name})") from None
        factory = getattr(module, attr)
    return factory(options)


class ConfigBackends:
    """The backends a model's config picks by name (``backend: "python"``), created on first use.

    ``for_config`` is called from the model manager's load threads, hence the lock.
    """

    def __init__(self, options: BackendOptions) -> None:
        self._options = options
        self._lock = threading.Lock()
        self._created: dict[str, Backend] = {}

    def for_config(self, config: mc.ModelConfig) -> Backend | None:
        """The backend ``config`` names, or None when ``--backend`` serves it."""
        name = CONFIG_BACKENDS.get(config.backend)
        if name is None:
            return None
        with self._lock:
            backend = self._created.get(name)
            if backend is None:
                backend = self._created[name] = create_backend(name, self._options)
            return backend

    def close(self) -> None:
        with self._lock:
            created, self._created = list(self._created.values()), {}
        for backend in created:
            backend.close()
