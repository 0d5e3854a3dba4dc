"""The gateway's configuration: one loader, validated once, passed down.

Sources, later wins: built-in defaults, the YAML file (``--config``), the
command-line flags. This is the only module that reads the environment
(``INFERGATE_*`` variables name a config file or single keys for containers).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Mapping

import yaml

WORKER_KINDS = ("infergate", "triton")
BATCHING_MODES = ("adaptive", "fixed", "off")


class ConfigError(ValueError):
    """The configuration is invalid; the message names the key."""


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """One worker server: ``HOST:PORT`` (infergate) or ``triton://HOST:PORT``."""

    address: str
    kind: str = "infergate"
    # Sent as gRPC metadata on statistics and repository calls (Triton's
    # restricted-protocol tokens, e.g. triton-grpc-protocol-triton-access-token).
    headers: tuple[tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, text: str) -> "WorkerSpec":
        text = text.strip()
        kind = "infergate"
        for prefix in ("triton://", "grpc://", "infergate://"):
            if text.startswith(prefix):
                kind = "triton" if prefix == "triton://" else "infergate"
                text = text[len(prefix):]
        _check_address(text)
        return cls(address=text, kind=kind)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | str) -> "WorkerSpec":
        if isinstance(data, str):
            return cls.parse(data)
        if "address" not in data:
            raise ConfigError(f"workers entry {dict(data)!r} needs an 'address'")
        spec = cls.parse(str(data["address"]))
        kind = str(data.get("kind", spec.kind))
        if kind not in WORKER_KINDS:
            raise ConfigError(f"workers entry {spec.address}: kind must be one of {WORKER_KINDS}, got {kind!r}")
        headers = data.get("headers") or {}
        if not isinstance(headers, Mapping):
            raise ConfigError(f"workers entry {spec.address}: headers must be a mapping")
        return cls(address=spec.address, kind=kind, headers=tuple((str(k).lower(), str(v)) for k, v in headers.items()))


def _check_address(address: str) -> None:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"worker address must be HOST:PORT, got {address!r}")


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    workers: tuple[WorkerSpec, ...] = ()
    # Batching defaults for every model; per-model keys in `models` win.
    batching_mode: str = "adaptive"
    max_queue_size: int = 1024
    max_inflight_per_replica: int = 2
    probe_interval_s: float = 2.0
    probe_failures_to_down: int = 2
    default_timeout_s: float = 60.0
    retry_limit: int = 3
    max_request_bytes: int = 256 * 2**20
    shutdown_grace_s: float = 10.0
    # model name -> settings: batching overrides (BatchPolicy keys) and, for
    # logical models, parallel layouts (from, tensor_parallel, ...).
    models: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # Everything else in the file, kept for the parts that read their own section.
    extra: Mapping[str, Any] = field(default_factory=dict)

    def model_settings(self, name: str) -> Mapping[str, Any]:
        return self.models.get(name, {})


_SCALARS = {f.name: f for f in fields(GatewayConfig) if f.name not in ("workers", "models", "extra")}


def _coerce(key: str, value: Any) -> Any:
    default = getattr(GatewayConfig(), key)
    try:
        if isinstance(default, bool):
            return bool(value)
        if isinstance(default, int):
            return int(value)
        if isinstance(default, float):
            return float(value)
        return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"config key {key!r}: expected {type(default).__name__}, got {value!r}") from None


def load_config(path: str | os.PathLike[str] | None = None, **overrides: Any) -> GatewayConfig:
    """Build the config from the YAML file at ``path`` and keyword overrides.

    Overrides whose value is None are ignored (unset command-line flags);
    ``workers`` overrides are appended to the file's workers.
    """
    if path is None:
        path = os.environ.get("INFERGATE_CONFIG") or None
    data: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
        data = loaded

    values: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in data.items():
        if key in _SCALARS:
            values[key] = _coerce(key, value)
        elif key not in ("workers", "models"):
            extra[key] = value

    workers = [WorkerSpec.from_mapping(w) for w in (data.get("workers") or [])]
    models_raw = data.get("models") or {}
    if not isinstance(models_raw, Mapping):
        raise ConfigError("config key 'models' must map model names to settings")
    models: dict[str, Mapping[str, Any]] = {}
    for name, settings in models_raw.items():
        if settings is None:
            settings = {}
        if not isinstance(settings, Mapping):
            raise ConfigError(f"models.{name} must be a mapping of settings")
        models[str(name)] = dict(settings)

    for key, value in overrides.items():
        if value is None:
            continue
        if key == "workers":
            workers.extend(w if isinstance(w, WorkerSpec) else WorkerSpec.parse(str(w)) for w in value)
        elif key in _SCALARS:
            values[key] = _coerce(key, value)
        else:
            raise ConfigError(f"unknown config key {key!r}")

    config = GatewayConfig(**values, workers=tuple(_dedupe(workers)), models=models, extra=extra)
    _validate(config)
    return config


def _dedupe(workers: list[WorkerSpec]) -> list[WorkerSpec]:
    seen: dict[str, WorkerSpec] = {}
    for w in workers:
        seen.setdefault(w.address, w)
    return list(seen.values())


def _validate(config: GatewayConfig) -> None:
    if config.batching_mode not in BATCHING_MODES:
        raise ConfigError(f"batching_mode must be one of {BATCHING_MODES}, got {config.batching_mode!r}")
    for key in ("max_queue_size", "max_inflight_per_replica", "probe_failures_to_down", "max_request_bytes"):
        if getattr(config, key) <= 0:
            raise ConfigError(f"{key} must be positive, got {getattr(config, key)}")
    for key in ("http_port", "grpc_port"):
        if not 0 <= getattr(config, key) < 65536:
            raise ConfigError(f"{key} must be a port number (0 picks a free one)")
    if config.probe_interval_s <= 0 or config.default_timeout_s <= 0:
        raise ConfigError("probe_interval_s and default_timeout_s must be positive")
    for name, settings in config.models.items():
        mode = settings.get("mode")
        if mode is not None and mode not in BATCHING_MODES:
            raise ConfigError(f"models.{name}.mode must be one of {BATCHING_MODES}, got {mode!r}")


def with_workers(config: GatewayConfig, workers: list[WorkerSpec]) -> GatewayConfig:
    return replace(config, workers=tuple(_dedupe(list(config.workers) + workers)))
