"""Triton's sequence batching on the worker: the sequences of one model
version, their control inputs and their implicit state.

A model whose ``config.pbtxt`` has ``sequence_batching`` is stateful. Each
request names its sequence with the ``sequence_id`` parameter (an unsigned
integer or a string; 0 and "" mean none) and flags its first and last
request with ``sequence_start`` / ``sequence_end``. For each request the
worker fills in what the config asks of the server:

- control inputs (``control_input``): START, END and READY with the values of
  ``int32_false_true`` / ``fp32_false_true`` / ``bool_false_true``, and CORRID
  carrying the sequence id in the control's ``data_type``;
- implicit state (``state``): the value the model produced on ``output_name``
  for the previous request of the sequence is fed back on ``input_name``;
  on the START request, the state's ``initial_state``: zeros
  (``zero_data``, or no initial_state at all) or the contents of
  ``data_file``, read once at load from the model's ``initial_state/``
  directory (raw row-major bytes; BYTES in the 4-byte length-prefixed form),
  as Triton reads it.

The requests of one sequence run one at a time, in arrival order (a FIFO
lock per sequence), each as its own execution: the direct and the oldest
strategies both hold at most one request per sequence in a batch, and this
worker never batches requests itself (the gateway does, and never batches
sequence requests). A sequence ends with its END request; one idle for
``max_sequence_idle_microseconds`` (Triton's default: 1 s) is released, and
a later request for it without START is refused, in Triton's words.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from protos import codec
from protos.errors import InferGateError, InvalidArgument
from execution.repository import wire_datatype

SEQUENCE_ID = "sequence_id"
SEQUENCE_START = "sequence_start"
SEQUENCE_END = "sequence_end"
DEFAULT_IDLE_US = 1_000_000  # Triton's default max_sequence_idle_microseconds
INITIAL_STATE_DIR = "initial_state"  # data_file names are relative to <model>/initial_state/, as in Triton
_Kind = mc.ModelSequenceBatching.Control
CorrelationId = int | str


@dataclass(frozen=True, slots=True)
class ControlInput:
    name: str
    kind: int  # ModelSequenceBatching.Control.Kind
    datatype: str  # KServe datatype
    false_value: Any = 0
    true_value: Any = 1


@dataclass(frozen=True, slots=True)
class StateSpec:
    input_name: str
    output_name: str
    datatype: str
    dims: tuple[int, ...]
    # The state at START, without the batch dim (None: zeros).
    initial: np.ndarray | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class SequenceSettings:
    """What a model's ``sequence_batching`` asks of the worker; built once per load."""

    controls: tuple[ControlInput, ...]
    states: tuple[StateSpec, ...]
    idle_s: float

    @classmethod
    def from_config(cls, config: mc.ModelConfig, model_dir: Path | None = None) -> SequenceSettings | None:
        """The settings of ``config`` (None when it is not stateful). Blocking: reads initial-state files.

        An ``initial_state`` with a ``data_file`` needs ``model_dir``, the model's directory.
        """
        if not config.HasField("sequence_batching"):
            return None
        sb = config.sequence_batching
        controls: list[ControlInput] = []
        for control_input in sb.control_input:
            for control in control_input.control:
                controls.append(_control(config.name, control_input.name, control))
        states: list[StateSpec] = []
        for state in sb.state:
            if any(d < 0 for d in state.dims):
                raise InvalidArgument(f"model '{config.name}': state '{state.input_name}' needs fixed dims, got {list(state.dims)}")
            spec = StateSpec(state.input_name, state.output_name, wire_datatype(state.data_type), tuple(state.dims))
            states.append(_with_initial(config.name, spec, state, model_dir))
        idle_us = sb.max_sequence_idle_microseconds or DEFAULT_IDLE_US
        return cls(tuple(controls), tuple(states), idle_us / 1e6)

    @property
    def filled_inputs(self) -> set[str]:
        """Model inputs the worker fills in: requests must not (and need not) send them."""
        return {c.name for c in self.controls} | {s.input_name for s in self.states}


def server_filled_inputs(config: mc.ModelConfig) -> set[str]:
    """The control and state inputs of ``config``'s ``sequence_batching`` (none without it)."""
    if not config.HasField("sequence_batching"):
        return set()
    sb = config.sequence_batching
    return {c.name for c in sb.control_input} | {s.input_name for s in sb.state}


def _with_initial(model: str, spec: StateSpec, state: Any, model_dir: Path | None) -> StateSpec:
    """``spec`` with its ``initial_state`` read (zeros stay None)."""
    where = f"model '{model}': state '{spec.input_name}'"
    if len(state.initial_state) > 1:
        raise InvalidArgument(f"{where} gives {len(state.initial_state)} initial_state entries; at most one is allowed")
    if not state.initial_state:
        return spec
    init = state.initial_state[0]
    if init.data_type != state.data_type or (init.dims and tuple(init.dims) != spec.dims):
        raise InvalidArgument(
            f"{where}: initial_state '{init.name}' must have the state's data_type and dims "
            f"({mc.DataType.Name(state.data_type)} {list(spec.dims)}), got "
            f"{mc.DataType.Name(init.data_type)} {list(init.dims)}")
    if init.WhichOneof("state_data") != "data_file":
        return spec  # zero_data
    if model_dir is None:
        raise InvalidArgument(f"{where}: initial_state '{init.name}' reads a data_file, which needs the model directory")
    root = (model_dir / INITIAL_STATE_DIR).resolve()
    path = (root / init.data_file).resolve()
    if root not in path.parents:
        raise InvalidArgument(f"{where}: initial_state data_file must name a file inside '{INITIAL_STATE_DIR}/'")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise InvalidArgument(f"{where}: cannot read {INITIAL_STATE_DIR}/{init.data_file}: {exc.strerror}") from None
    try:
        initial = codec.decode(spec.datatype, list(spec.dims), raw, name=spec.input_name)
    except InferGateError as exc:
        raise InvalidArgument(f"{where}: {INITIAL_STATE_DIR}/{init.data_file} does not hold a {spec.datatype}"
                              f"{list(spec.dims)} tensor: {exc.message}") from None
    return StateSpec(spec.input_name, spec.output_name, spec.datatype, spec.dims, np.array(initial, copy=True))


def _control(model: str, name: str, control: Any) -> ControlInput:
    kind = control.kind
    if kind == _Kind.CONTROL_SEQUENCE_CORRID:
        return ControlInput(name, kind, wire_datatype(control.data_type))
    for field_name, datatype in (("int32_false_true", "INT32"), ("fp32_false_true", "FP32"), ("bool_false_true", "BOOL")):
        values = list(getattr(control, field_name))
        if values:
            if len(values) != 2:
                raise InvalidArgument(f"model '{model}': control input '{name}' {field_name} must list two values")
            return ControlInput(name, kind, datatype, values[0], values[1])
    raise InvalidArgument(
        f"model '{model}': control input '{name}' ({_Kind.Kind.Name(kind)}) gives none of "
        "int32_false_true, fp32_false_true, bool_false_true"
    )


@dataclass(frozen=True, slots=True)
class SequenceFlags:
    corrid: CorrelationId
    start: bool
    end: bool


def read_flags(model: str, parameters: Mapping[str, Any]) -> SequenceFlags:
    """The request's sequence parameters (protobuf ``InferParameter``s), in Triton's words when wrong."""
    def value(key: str) -> Any:
        param = parameters.get(key) if key in parameters else None
        if param is None:
            return None
        which = param.WhichOneof("parameter_choice")
        return None if which is None else getattr(param, which)

    corrid = value(SEQUENCE_ID)
    if isinstance(corrid, bool) or not isinstance(corrid, (int, str)) or corrid == 0 or corrid == "":
        raise InvalidArgument(
            f"inference request to model '{model}' must specify a non-zero or non-empty correlation ID"
        )
    if isinstance(corrid, int) and corrid < 0:
        raise InvalidArgument(f"inference request to model '{model}': sequence_id must be an unsigned integer, got {corrid}")
    flags = {}
    for key in (SEQUENCE_START, SEQUENCE_END):
        flag = value(key)
        if flag is not None and not isinstance(flag, bool):
            raise InvalidArgument(f"inference request to model '{model}': parameter '{key}' must be a boolean")
        flags[key] = bool(flag)
    return SequenceFlags(corrid, flags[SEQUENCE_START], flags[SEQUENCE_END])


@dataclass(slots=True)
class Sequence:
    """One open sequence: its state between requests and the lock that orders its requests."""

    corrid: CorrelationId
    last_used: float
    states: dict[str, np.ndarray] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    pending: int = 0  # requests holding or waiting for the lock: such a sequence is never idle


class SequenceBook:
    """The open sequences of one model version (event loop thread only)."""

    def __init__(self, model: str, settings: SequenceSettings, batched: bool,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.model = model
        self.settings = settings
        self._batched = batched
        self._clock = clock
        self._open: dict[CorrelationId, Sequence] = {}
        self._next_sweep = 0.0

    def __len__(self) -> int:
        return len(self._open)

    def open(self, flags: SequenceFlags) -> Sequence:
        """The sequence a request belongs to (new on START); counts the request as pending on it."""
        now = self._clock()
        self._sweep(now)
        sequence = self._open.get(flags.corrid)
        if sequence is None:
            if not flags.start:
                raise InvalidArgument(
                    f"inference request for sequence {flags.corrid} to model '{self.model}' "
                    "must specify the START flag on the first request of the sequence"
                )
            sequence = self._open[flags.corrid] = Sequence(flags.corrid, now)
        sequence.last_used = now
        sequence.pending += 1
        return sequence

    def feeds(self, sequence: Sequence, flags: SequenceFlags, batch_size: int) -> dict[str, np.ndarray]:
        """The control and state inputs of this request (call holding the sequence's lock)."""
        lead = (batch_size,) if self._batched else ()
        if flags.start:  # a START on an open sequence restarts it, as Triton does
            sequence.states = {s.input_name: _initial(s, lead) for s in self.settings.states}
        arrays = {}
        for control in self.settings.controls:
            arrays[control.name] = self._control_value(control, flags, (*lead, 1))
        for spec in self.settings.states:
            arrays[spec.input_name] = sequence.states.get(spec.input_name, _initial(spec, lead))
        return arrays

    def state_outputs(self) -> list[str]:
        return [s.output_name for s in self.settings.states]

    def finish(self, sequence: Sequence, flags: SequenceFlags, outputs: Mapping[str, np.ndarray] | None) -> None:
        """Keep the new state (``outputs`` of a successful run) and close the sequence on END."""
        sequence.pending -= 1
        sequence.last_used = self._clock()
        if outputs is not None:
            for spec in self.settings.states:
                sequence.states[spec.input_name] = np.array(outputs[spec.output_name], copy=True)
        if flags.end and self._open.get(sequence.corrid) is sequence:
            del self._open[sequence.corrid]

    def _sweep(self, now: float) -> None:
        """Release sequences idle past ``max_sequence_idle_microseconds`` (at most every tenth of it)."""
        if now < self._next_sweep:
            return
        self._next_sweep = now + self.settings.idle_s / 10
        idle = [k for k, s in self._open.items() if s.pending == 0 and now - s.last_used >= self.settings.idle_s]
        for key in idle:
            del self._open[key]

    def _control_value(self, control: ControlInput, flags: SequenceFlags, shape: tuple[int, ...]) -> np.ndarray:
        dtype = codec.numpy_dtype(control.datatype)
        if control.kind == _Kind.CONTROL_SEQUENCE_CORRID:
            value: Any = flags.corrid
            if control.datatype == "BYTES":
                return np.full(shape, str(value).encode(), dtype=np.object_)
            if isinstance(value, str):
                try:
                    value = int(value)
                except ValueError:
                    raise InvalidArgument(
                        f"inference request for sequence {value} to model '{self.model}': its CORRID control is "
                        f"{control.datatype}, so the sequence id must be an integer"
                    ) from None
            return np.full(shape, value, dtype=dtype)
        on = {
            _Kind.CONTROL_SEQUENCE_START: flags.start,
            _Kind.CONTROL_SEQUENCE_END: flags.end,
            _Kind.CONTROL_SEQUENCE_READY: True,
        }.get(control.kind, False)
        return np.full(shape, control.true_value if on else control.false_value, dtype=dtype)


def _initial(spec: StateSpec, lead: tuple[int, ...]) -> np.ndarray:
    """The state at START: the initial_state's data (one per row of the batch dim), else zeros."""
    if spec.initial is None:
        return np.zeros((*lead, *spec.dims), dtype=codec.numpy_dtype(spec.datatype))
    return np.array(np.broadcast_to(spec.initial, (*lead, *spec.dims)), copy=True)
