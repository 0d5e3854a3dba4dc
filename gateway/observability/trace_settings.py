"""Triton's trace settings at the gateway (``/v2/trace/setting``, gRPC
``TraceSetting``): the global settings, each model's overrides, and the
sampling they imply.

The settings, as in Triton: ``trace_level`` (``OFF``, or ``TIMESTAMPS``
and/or ``TENSORS``), ``trace_rate`` (trace one request in N),
``trace_count`` (traces still to take; -1 no limit; each trace taken counts
it down), ``log_frequency`` (triton mode: write the trace file every N
traces; 0 at shutdown), ``trace_file`` and ``trace_mode`` (both fixed at
start with ``--trace-config``; Triton refuses ``trace_file`` over the network
and so do we). A model's update overrides the named settings for that model
only; a null value (gRPC: no values) clears the override and the model
follows the global setting again (a cleared global setting returns to its
start-up value). Updating the global settings rebuilds
every model's sampling state from its overrides and the new globals.

Values are validated before any is applied; the messages are Triton's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gateway.settings import ConfigError
from protos.errors import InvalidArgument, Unsupported
from serverkit.tracing import TraceConfig

_OFF = ("OFF",)
_UINT32_MAX = 2**32 - 1
_INT32_MAX = 2**31 - 1
KEYS = ("trace_level", "trace_rate", "trace_count", "log_frequency", "trace_file", "trace_mode")


@dataclass(slots=True)
class Sampler:
    """One set of effective settings (the global one, or a model's) and its sampling state."""

    level: tuple[str, ...]
    rate: int
    count: int
    log_frequency: int
    seen: int = 0

    def take(self) -> bool:
        """Whether this request is traced: every ``rate``-th one while ``count`` lasts (Triton's rule)."""
        if self.level == _OFF or self.count == 0:
            return False
        self.seen += 1
        if self.seen % self.rate:
            return False
        if self.count > 0:
            self.count -= 1
        return True

    @property
    def on(self) -> bool:
        return self.level != _OFF and self.count != 0


def trace_config(extra: Mapping[str, Any]) -> TraceConfig:
    """The ``trace_config`` entries among the config's other keys (``GatewayConfig.extra``: the YAML
    list, then the ``--trace-config`` flags)."""
    entries = extra.get("trace_config") or []
    if isinstance(entries, str) or not all(isinstance(e, str) for e in entries):
        raise ConfigError(f"config key 'trace_config' must be a list of Triton --trace-config entries, got {entries!r}")
    try:
        return TraceConfig.parse(entries)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _parse_int(key: str, text: str, minimum: int, maximum: int) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise InvalidArgument(f"Unable to parse '{key}', got: {text}") from None
    if key == "trace_count" and value < minimum:
        raise InvalidArgument(f"Unable to parse 'trace_count'. Expecting value >= {minimum}, got:{text}")
    if not minimum <= value <= maximum:
        raise InvalidArgument(f"Unable to parse '{key}', value is out of range [ {minimum}, {maximum} ], got: {text}")
    return value


def _parse_level(values: list[str]) -> tuple[str, ...]:
    if "OFF" in values:
        if len(values) != 1:
            raise InvalidArgument("Expect only one trace level 'OFF' is specified")
        return _OFF
    unknown = [v for v in values if v not in ("TIMESTAMPS", "TENSORS")]
    if unknown or not values:
        raise InvalidArgument(f"Unable to parse 'trace_level', expecting OFF, TIMESTAMPS or TENSORS, got: {unknown or values}")
    return tuple(level for level in ("TIMESTAMPS", "TENSORS") if level in values)


def normalize_json(doc: Mapping[str, Any]) -> dict[str, list[str] | None]:
    """An HTTP request body in the gRPC shape: each key to its list of strings, or None to clear."""
    out: dict[str, list[str] | None] = {}
    for key, value in doc.items():
        if value is None:
            out[key] = None
        elif key == "trace_level":
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise InvalidArgument(f"Unable to parse 'trace_level', expecting an array of strings, got: {value!r}")
            out[key] = list(value)
        elif isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)):
            out[key] = [str(value)]
        else:
            raise InvalidArgument(f"Unable to parse '{key}', expecting a string, got: {value!r}")
    return out


class TraceSettings:
    """The process's trace settings, global and per model; ``active`` is the cheap check of the hot path."""

    def __init__(self, config: TraceConfig, known_model: Callable[[str], bool] = lambda name: True) -> None:
        self.mode = config.mode
        self.file = config.file
        self.url = config.url
        self._known_model = known_model
        self._global: dict[str, Any] = {"trace_level": tuple(config.level), "trace_rate": config.rate,
                                        "trace_count": config.count, "log_frequency": config.log_frequency}
        self._startup = dict(self._global)  # what clearing a global setting returns to, as in Triton
        self._overrides: dict[str, dict[str, Any]] = {}
        self._global_sampler = self._sampler({})
        self._samplers: dict[str, Sampler] = {}
        self.active = self._global_sampler.on

    def _sampler(self, overrides: Mapping[str, Any]) -> Sampler:
        merged = {**self._global, **overrides}
        return Sampler(merged["trace_level"], merged["trace_rate"], merged["trace_count"], merged["log_frequency"])

    def sampler(self, model: str) -> Sampler:
        return self._samplers.get(model, self._global_sampler)

    def sample(self, model: str) -> Sampler | None:
        """The sampler that takes this request of ``model``, or None when it is not traced."""
        sampler = self._samplers.get(model, self._global_sampler)
        return sampler if sampler.take() else None

    # -- the extension

    def _check_model(self, model: str) -> None:
        if model and not self._known_model(model):
            raise InvalidArgument(f"Request for unknown model : {model}")

    def current(self, model: str = "") -> dict[str, Any]:
        """The effective settings in Triton's JSON shape (strings, and a list for the level)."""
        self._check_model(model)
        sampler = self.sampler(model)
        out: dict[str, Any] = {"trace_level": list(sampler.level), "trace_rate": str(sampler.rate),
                               "trace_count": str(sampler.count)}
        if self.mode == "triton":
            out["log_frequency"] = str(sampler.log_frequency)
            out["trace_file"] = self.file
        out["trace_mode"] = self.mode
        if self.mode == "opentelemetry":
            out["url"] = self.url
        return out

    def update(self, model: str, settings: Mapping[str, list[str] | None]) -> dict[str, Any]:
        """Apply ``settings`` (key -> values, None clears) to ``model`` ("" = global); all checked first."""
        self._check_model(model)
        self.assign(model, settings)
        return self.current(model)

    async def apply(self, model: str, settings: Mapping[str, list[str] | None]) -> dict[str, Any]:
        """An update as both frontends make it: here, :meth:`update`; a process group's applies it in every process."""
        return self.update(model, settings)

    def assign(self, model: str, settings: Mapping[str, list[str] | None]) -> None:
        """:meth:`update` without the check that ``model`` is known (a change another process checked)."""
        parsed: dict[str, Any] = {}
        for key, values in settings.items():
            if key == "trace_file":
                raise Unsupported("trace file location can not be updated through network protocol")
            if key == "trace_mode":
                raise Unsupported("trace mode can not be updated through network protocol; "
                                  "start the server with --trace-config mode=triton|opentelemetry")
            if key not in KEYS:
                raise InvalidArgument(f"unknown trace setting '{key}'; the settings are {', '.join(KEYS)}")
            if values is None or not values:
                parsed[key] = None
            elif key == "trace_level":
                parsed[key] = _parse_level(values)
            elif len(values) != 1:
                raise InvalidArgument(f"expect only 1 value for '{key}'")
            elif key == "trace_count":
                parsed[key] = _parse_int(key, values[0], -1, _INT32_MAX)
            else:
                parsed[key] = _parse_int(key, values[0], 1 if key == "trace_rate" else 0, _UINT32_MAX)
        if model:
            overrides = self._overrides.setdefault(model, {})
            for key, value in parsed.items():
                if value is None:
                    overrides.pop(key, None)
                else:
                    overrides[key] = value
            if overrides:
                self._samplers[model] = self._sampler(overrides)
            else:  # nothing of its own left: the model follows the global settings again
                del self._overrides[model]
                self._samplers.pop(model, None)
        elif parsed:
            for key, value in parsed.items():
                self._global[key] = self._startup[key] if value is None else value
            self._global_sampler = self._sampler({})
            self._samplers = {m: self._sampler(o) for m, o in self._overrides.items()}
        self.active = self._global_sampler.on or any(s.on for s in self._samplers.values())
