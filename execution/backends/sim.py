"""The simulated accelerator backend (``--backend sim``): serves a model
repository without running any model, for scale tests of everything around
the models (gateway, batching, routing) on machines without accelerators.

Each execution of a batch of ``n`` rows "runs" for

    (latency_ms + n * per_row_us / 1000) * (1 + u * jitter_pct / 100)  ms,  u ~ U(-1, 1)

by awaiting a timer on the worker's event loop, so a waiting batch costs no
CPU and no thread, as a batch queued on a real device would. The outputs have
the shapes and datatypes the model's config declares, filled with zeros or
seeded random values. A model that does not batch counts as one row.

Dynamic output dims (``-1``) are taken from the inputs: dim ``i`` of an
output gets the size of dim ``i`` (batch dim included) of the first input, in
config order, that has a dim ``i``; 1 if none has. For the example encoder
(``TOKENS [n, L]`` -> ``HIDDEN [n, -1, 64]``) that gives ``[n, L, 64]``.

Options (``--backend-option KEY=VALUE``, or the worker's ``--sim-*`` flags):
``latency_ms`` (default 1), ``per_row_us`` (default 0), ``jitter_pct``
(default 0), ``fill`` (``zeros`` or ``random``), ``seed`` (default 0),
``gpus`` (simulated devices for ``KIND_GPU`` instance groups, default 0).

The model file is not needed: the config's inputs and outputs are the
signature, whatever backend the config names. A config that leaves its
inputs or outputs out is completed from the ONNX file's graph signature, when
there is one (``onnx`` is imported for that alone; no session is created).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from protos import codec
from protos.errors import InvalidArgument
from execution.backends.base import BackendOptions, Placement
from execution.repository import wire_datatype

logger = logging.getLogger(__name__)

BACKEND_NAME = "onnxruntime"  # what a config naming no backend gets, as with the ONNX backend
PLATFORM = "onnxruntime_onnx"
DEFAULT_MODEL_FILENAME = "model.onnx"
DEFAULT_MAX_BATCH_SIZE = 4  # as the ONNX backend's auto-complete
# Event loop timers fire up to about a millisecond off (libuv counts whole
# milliseconds). Each instance carries its timing error into its next sleep,
# so the mean duration is exact; the carry is capped at one timer tick, so a
# loop that is late because the machine is busy is not "repaid" by shorter
# device times afterwards (the device would not have been faster).
TIMER_SLACK_S = 0.001


class Clock(Protocol):
    """The device's clock: tests pass a fake one, so no test waits on real timers."""

    def now(self) -> float: ...  # seconds, monotonic

    async def sleep(self, seconds: float) -> None: ...


class LoopClock:
    """Real time, waiting on the event loop's timers (no thread, no CPU)."""

    def now(self) -> float:
        return time.perf_counter()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


@dataclass(frozen=True, slots=True)
class LatencyModel:
    """How long a batch of ``rows`` rows takes on the simulated device."""

    latency_ms: float = 1.0
    per_row_us: float = 0.0
    jitter_pct: float = 0.0

    def __post_init__(self) -> None:
        if self.latency_ms < 0 or self.per_row_us < 0:
            raise InvalidArgument("sim backend: latency_ms and per_row_us must be >= 0")
        if not 0 <= self.jitter_pct < 100:
            raise InvalidArgument("sim backend: jitter_pct must be in [0, 100)")

    def mean_s(self, rows: int) -> float:
        return (self.latency_ms + rows * self.per_row_us / 1000.0) / 1000.0

    def sample_s(self, rows: int, rng: random.Random) -> float:
        mean = self.mean_s(rows)
        if self.jitter_pct == 0:
            return mean
        return mean * (1.0 + rng.uniform(-1.0, 1.0) * self.jitter_pct / 100.0)


@dataclass(frozen=True, slots=True)
class SimSettings:
    latency: LatencyModel
    fill: str = "zeros"  # zeros | random
    seed: int = 0
    gpus: int = 0

    @classmethod
    def from_options(cls, extra: Mapping[str, str]) -> SimSettings:
        known = {"latency_ms", "per_row_us", "jitter_pct", "fill", "seed", "gpus"}
        unknown = sorted(set(extra) - known - {"default_max_batch_size"})
        if unknown:
            raise InvalidArgument(f"sim backend: unknown option(s) {unknown}; known: {sorted(known)}")
        try:
            latency = LatencyModel(
                latency_ms=float(extra.get("latency_ms", 1.0)),
                per_row_us=float(extra.get("per_row_us", 0.0)),
                jitter_pct=float(extra.get("jitter_pct", 0.0)),
            )
            seed, gpus = int(extra.get("seed", 0)), int(extra.get("gpus", 0))
        except ValueError as exc:
            raise InvalidArgument(f"sim backend: bad option value: {exc}") from None
        fill = extra.get("fill", "zeros")
        if fill not in ("zeros", "random"):
            raise InvalidArgument(f"sim backend: fill must be zeros or random, not {fill!r}")
        if gpus < 0:
            raise InvalidArgument("sim backend: gpus must be >= 0")
        return cls(latency=latency, fill=fill, seed=seed, gpus=gpus)


@dataclass(frozen=True, slots=True)
class _OutputSpec:
    name: str
    dtype: np.dtype
    dims: tuple[int, ...]  # full shape without the batch dim; -1 = from the inputs


def output_shape(dims: Sequence[int], batched: bool, inputs: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    """An output's full shape: batch dim and ``-1`` dims taken from the inputs' full shapes (module docstring)."""
    full = ([-1] if batched else []) + list(dims)
    shape = []
    for i, dim in enumerate(full):
        if dim >= 0:
            shape.append(dim)
            continue
        shape.append(next((s[i] for s in inputs if len(s) > i), 1))
    return tuple(shape)


class SimInstance:
    """One simulated execution instance: a timer plus output buffers."""

    def __init__(self, config: mc.ModelConfig, placement: Placement, settings: SimSettings, seed: int, clock: Clock) -> None:
        self.placement = placement
        self._clock = clock
        self._latency = settings.latency
        self._random_fill = settings.fill == "random"
        self._batched = config.max_batch_size > 0
        self._input_order = [t.name for t in config.input]
        self._outputs = {
            t.name: _OutputSpec(t.name, codec.numpy_dtype(wire_datatype(t.data_type)), tuple(t.dims)) for t in config.output
        }
        self._timing_rng = random.Random(seed)
        self._fill_rng = np.random.default_rng(seed)
        self._carry_s = 0.0
        self._closed = False

    async def infer(self, inputs: Mapping[str, np.ndarray], output_names: Sequence[str]) -> dict[str, np.ndarray]:
        if self._closed:
            raise InvalidArgument("model instance was unloaded")
        shapes = [tuple(inputs[name].shape) for name in self._input_order if name in inputs]
        rows = shapes[0][0] if self._batched and shapes and shapes[0] else 1
        await self._run_for(self._latency.sample_s(rows, self._timing_rng))
        return {name: self._make(self._outputs[name], shapes) for name in output_names}

    async def _run_for(self, duration_s: float) -> None:
        # Only this instance's one running call touches _carry_s (one call per instance at a time).
        started = self._clock.now()
        await self._clock.sleep(max(0.0, duration_s - self._carry_s))
        error = self._clock.now() - started - duration_s
        self._carry_s = min(TIMER_SLACK_S, max(-TIMER_SLACK_S, self._carry_s + error))

    def _make(self, spec: _OutputSpec, input_shapes: Sequence[tuple[int, ...]]) -> np.ndarray:
        shape = output_shape(spec.dims, self._batched, input_shapes)
        if spec.dtype == np.object_:
            return np.full(shape, b"", dtype=np.object_)
        if not self._random_fill:
            return np.zeros(shape, dtype=spec.dtype)
        kind = spec.dtype.kind
        if kind == "f":
            return self._fill_rng.standard_normal(shape, dtype=np.float32).astype(spec.dtype)
        if kind == "b":
            return self._fill_rng.integers(0, 2, shape).astype(np.bool_)
        if kind in "iu":
            return self._fill_rng.integers(0, 100, shape).astype(spec.dtype)
        return np.zeros(shape, dtype=spec.dtype)  # e.g. BF16 without a random source of its own

    def close(self) -> None:
        self._closed = True


class SimBackend:
    name = BACKEND_NAME
    platform = PLATFORM
    default_model_filename = DEFAULT_MODEL_FILENAME
    # A simulated device runs one batch per instance at a time and waits on timers, not threads.
    cpu_instances = 1
    execution_threads = 0

    def __init__(self, options: BackendOptions, clock: Clock | None = None) -> None:
        self.settings = SimSettings.from_options(options.extra)
        self._clock = clock or LoopClock()
        if options.device == "cuda" and self.settings.gpus == 0:
            raise InvalidArgument("--device cuda: the sim backend simulates no GPU (set --backend-option gpus=N)")
        self._gpu_count = 0 if options.device == "cpu" else self.settings.gpus
        self.default_max_batch_size = int(options.extra.get("default_max_batch_size", DEFAULT_MAX_BATCH_SIZE))
        self._instances_made = 0

    def gpu_count(self) -> int:
        return self._gpu_count

    def describe(self) -> str:
        lat = self.settings.latency
        return (
            f"simulated accelerator: {lat.latency_ms:g} ms + {lat.per_row_us:g} us/row per batch, "
            f"jitter {lat.jitter_pct:g}%, {self.settings.fill} outputs, {self._gpu_count} simulated GPU(s)"
        )

    def complete_config(self, config: mc.ModelConfig, version_dir: Path) -> mc.ModelConfig:
        # Whatever backend the config names, the sim stands in for it: only the
        # signature matters here, and clients see the config unchanged.
        if not config.backend and not config.platform:
            config.backend, config.platform = BACKEND_NAME, PLATFORM
        if not config.input or not config.output:
            _complete_from_onnx(config, version_dir / (config.default_model_filename or DEFAULT_MODEL_FILENAME), self.default_max_batch_size)
        for tensor in config.input:
            wire_datatype(tensor.data_type)
        for tensor in config.output:
            wire_datatype(tensor.data_type)
            if any(d < -1 for d in tensor.dims):
                raise InvalidArgument(f"model '{config.name}': output '{tensor.name}' has an invalid dim in {list(tensor.dims)}")
        return config

    def load(self, model_dir: Path, version_dir: Path, config: mc.ModelConfig, placement: Placement) -> SimInstance:
        # Instances of one process draw different (but reproducible) random streams.
        self._instances_made += 1
        return SimInstance(config, placement, self.settings, self.settings.seed * 1_000_003 + self._instances_made, self._clock)

    def close(self) -> None:
        pass


def _complete_from_onnx(config: mc.ModelConfig, path: Path, default_max_batch_size: int) -> None:
    """Fill missing inputs/outputs from the graph's signature (no session is created)."""
    if not path.is_file():
        raise InvalidArgument(
            f"model '{config.name}': the sim backend needs the inputs and outputs in config.pbtxt, "
            f"or a {path.name} to read them from"
        )
    import onnx  # only here: a fully declared config never needs it
    from google.protobuf.message import DecodeError

    try:
        graph = onnx.load(str(path), load_external_data=False).graph
    except (DecodeError, OSError, ValueError) as exc:
        raise InvalidArgument(f"{path.parent.name}/{path.name} is not a valid ONNX model: {exc}") from None
    initializers = {t.name for t in graph.initializer}
    values = {"input": [v for v in graph.input if v.name not in initializers], "output": list(graph.output)}
    shapes = {role: [_onnx_shape(v) for v in vs] for role, vs in values.items()}
    if (
        config.max_batch_size == 0
        and not config.input
        and not config.output
        and all(s and s[0] == -1 for ss in shapes.values() for s in ss)
    ):
        config.max_batch_size = default_max_batch_size
    batched = config.max_batch_size > 0
    for role, field in (("input", config.input), ("output", config.output)):
        if len(field):
            continue
        for value, shape in zip(values[role], shapes[role]):
            if not shape:
                raise InvalidArgument(f"model '{config.name}': {role} '{value.name}' has no shape in the ONNX file")
            if batched and shape[0] != -1:
                raise InvalidArgument(f"model '{config.name}': max_batch_size > 0 but {role} '{value.name}' has a fixed first dim")
            dtype = onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
            data_type = mc.TYPE_STRING if dtype == np.object_ else _config_type(codec.datatype_of(dtype))
            field.add(name=value.name, data_type=data_type, dims=shape[1:] if batched else shape)


def _config_type(wire: str) -> int:
    return mc.DataType.Value("TYPE_" + wire)


def _onnx_shape(value: object) -> list[int] | None:
    tensor = value.type.tensor_type  # type: ignore[attr-defined]
    if not tensor.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else -1 for d in tensor.shape.dim]


def create_backend(options: BackendOptions) -> SimBackend:
    return SimBackend(options)
