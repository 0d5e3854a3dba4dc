"""The gateway's configuration: one loader, validated once, passed down.

Sources, later wins: built-in defaults, the YAML file (``--config``, or the
file ``INFERGATE_CONFIG`` names), the command-line flags (keyword overrides
of :func:`load_config`). This is the only module that reads the environment:
besides ``INFERGATE_CONFIG``, only the secrets (``INFERGATE_API_KEYS``,
``INFERGATE_ADMIN_KEYS``, ``INFERGATE_WORKER_TOKEN``).

The settings are grouped per concern (``retry.budget_percent``; the records
live in gateway/settings.py). The flat keys of earlier releases
(``retry_budget_percent``) are still read, each with one warning naming its
new key; one source giving a setting in both forms is refused.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

import yaml

from gateway.settings import (
    BATCHING_MODES,
    GROUPS,
    MODEL_CONTROL_MODES,
    PARALLEL_KEYS,
    PLACEMENT_KEYS,
    RELAY_MODES,
    WORKER_CALLS,
    WORKER_STREAMS,
    WORKER_KINDS,
    ConfigError,
    GatewayConfig,
    WorkerSpec,
    check_address,
    config_keys,
)
from serverkit.grpc_server import MIN_KEEPALIVE_TIME_MS

__all__ = ["BATCHING_MODES", "DEPRECATED_KEYS", "MODEL_CONTROL_MODES", "PARALLEL_KEYS", "PLACEMENT_KEYS",
           "WORKER_KINDS", "ConfigError", "GatewayConfig", "WorkerSpec", "load_config", "parse_bool"]

log = logging.getLogger(__name__)

# The flat keys of earlier releases -> (group, key): read still, with a warning.
DEPRECATED_KEYS: dict[str, tuple[str, str]] = {
    "batching_mode": ("batching", "mode"),
    "max_queue_size": ("batching", "max_queue_size"),
    "max_inflight_per_replica": ("batching", "max_inflight_per_replica"),
    "busy_inflight_per_replica": ("batching", "busy_inflight_per_replica"),
    "light_row_ms": ("batching", "light_row_ms"),
    "cache_size": ("cache", "size_bytes"),
    "probe_interval_s": ("probe", "interval_s"),
    "probe_failures_to_down": ("probe", "failures_to_down"),
    "probe_timeout_s": ("probe", "timeout_s"),
    "retry_limit": ("retry", "limit"),
    "retry_budget_percent": ("retry", "budget_percent"),
    "retry_min_concurrency": ("retry", "min_concurrency"),
    "retry_backoff_base_s": ("retry", "backoff_base_s"),
    "retry_backoff_max_s": ("retry", "backoff_max_s"),
    **{f"outlier_{k}": ("outlier", k) for k in ("consecutive_failures", "base_ejection_s", "max_ejection_s",
                                                "max_ejection_percent", "latency_factor", "latency_min_excess_s")},
    "hedge_percentile": ("hedge", "percentile"),
    "hedge_min_delay_s": ("hedge", "min_delay_s"),
    "hang_multiplier": ("hedge", "hang_multiplier"),
    "hang_min_s": ("hedge", "hang_min_s"),
    **{k: ("admission", k) for k in ("max_inflight_requests", "max_inflight_bytes", "priority_reserve_percent")},
    **{k: ("membership", k) for k in ("dns_refresh_s", "heartbeat_interval_s", "heartbeat_misses_to_down")},
    "placement_interval_s": ("placement", "interval_s"),
    "load_on_demand": ("placement", "load_on_demand"),
    "model_idle_ttl_s": ("placement", "idle_ttl_s"),
    **{k: ("placement", k) for k in ("worker_memory_cap_bytes", "worker_memory_fraction",
                                     "default_model_memory_bytes", "drain_timeout_s")},
    **{f"autoscale_{k}": ("autoscale", k) for k in ("up_rate", "down_rate", "max_replicas", "cooldown_s")},
    **{k: ("security", k) for k in ("api_key_file", "admin_key_file", "tls_cert", "tls_key", "worker_token_file",
                                    "worker_tls_ca", "worker_tls_cert", "worker_tls_key")},
}
# Top-level scalar keys and their defaults (the groups, lists and mappings are read apart).
_SCALARS = {f.name: f.default for f in fields(GatewayConfig)
            if f.name not in ("workers", "models", "extra", "worker_dns", *GROUPS)}
_GROUP_DEFAULTS = {name: group() for name, group in GROUPS.items()}
_GROUP_KEYS = {name: config_keys(group) for name, group in GROUPS.items()}
# File paths: relative ones in the YAML file are relative to the file.
_SECURITY_PATH_KEYS = ("api_key_file", "admin_key_file", "tls_cert", "tls_key", "worker_token_file",
                       "worker_tls_ca", "worker_tls_cert", "worker_tls_key")


def relay_setting(value: Any) -> Any:
    """A relay setting as written: YAML reads a bare ``off`` as false (and ``on`` as true, which is ``auto``)."""
    if isinstance(value, bool):
        return "auto" if value else "off"
    return value


def _coerce(key: str, default: Any, value: Any) -> Any:
    if key == "relay":
        value = relay_setting(value)
    try:
        if isinstance(default, bool):
            return parse_bool(value)
        if isinstance(default, int):
            return int(value)
        if isinstance(default, float):
            return float(value)
        return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"config key {key!r}: expected {type(default).__name__}, got {value!r}") from None


def parse_bool(value: Any) -> bool:
    """A boolean from YAML, a flag or the environment: true/false, yes/no, on/off, 1/0."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "yes", "on", "1"):
        return True
    if text in ("false", "no", "off", "0"):
        return False
    raise ValueError(f"not a boolean: {value!r}")


class _Settings:
    """The scalar and group values gathered from the sources, later ones over earlier."""

    def __init__(self) -> None:
        self.top: dict[str, Any] = {}
        self.groups: dict[str, dict[str, Any]] = {name: {} for name in GROUPS}
        self.deprecated: dict[str, str] = {}  # old key -> new key, in the order met

    def take(self, source: Mapping[str, Any]) -> list[str]:
        """Read one source's settings; returns its keys that are none of them."""
        nested: set[tuple[str, str]] = set()
        rest: list[str] = []
        for key, value in source.items():
            if key in _SCALARS:
                self.top[key] = _coerce(key, _SCALARS[key], value)
            elif key in GROUPS:
                nested.update(self._take_group(key, value))
            elif key not in DEPRECATED_KEYS:
                rest.append(key)
        for key, value in source.items():
            if key not in DEPRECATED_KEYS:
                continue
            group, name = DEPRECATED_KEYS[key]
            self.deprecated.setdefault(key, f"{group}.{name}")
            if (group, name) in nested:
                raise ConfigError(f"config key {key!r} and {group}.{name} are the same setting: "
                                  f"keep only {group}.{name}")
            self.groups[group][name] = _coerce(f"{group}.{name}", getattr(_GROUP_DEFAULTS[group], name), value)
        return rest

    def _take_group(self, group: str, values: Any) -> set[tuple[str, str]]:
        if values is None:
            return set()
        if not isinstance(values, Mapping):
            raise ConfigError(f"config key {group!r} must be a mapping of settings ({', '.join(_GROUP_KEYS[group])})")
        for key, value in values.items():
            if key not in _GROUP_KEYS[group]:
                raise ConfigError(f"unknown config key '{group}.{key}' (known: {', '.join(_GROUP_KEYS[group])})")
            self.groups[group][key] = _coerce(f"{group}.{key}", getattr(_GROUP_DEFAULTS[group], key), value)
        return {(group, key) for key in values}


def load_config(path: str | os.PathLike[str] | None = None, **overrides: Any) -> GatewayConfig:
    """Build the config from the YAML file at ``path`` and keyword overrides.

    Overrides are top-level keys or groups (``retry={"limit": 5}``, merged
    over the file's group); those whose value is None are ignored (unset
    command-line flags), in a group too; ``workers`` overrides are appended
    to the file's workers.
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

    settings = _Settings()
    extra = {key: data[key] for key in settings.take(data) if key not in ("workers", "models", "worker_dns")}
    workers = [WorkerSpec.from_mapping(w) for w in (data.get("workers") or [])]
    dns_raw = data.get("worker_dns") or []
    worker_dns = [str(n) for n in ([dns_raw] if isinstance(dns_raw, str) else dns_raw)]
    models = _models(data.get("models") or {})

    given: dict[str, Any] = {}
    for key, value in overrides.items():
        if value is None:
            continue
        if key == "workers":
            workers.extend(w if isinstance(w, WorkerSpec) else WorkerSpec.parse(str(w)) for w in value)
        elif key == "worker_dns":
            worker_dns.extend(str(n) for n in value)
        elif key == "trace_config":  # Triton's --trace-config flags, after the file's entries
            extra["trace_config"] = [*(extra.get("trace_config") or []), *value]
        elif key in GROUPS and isinstance(value, Mapping):
            given[key] = {k: v for k, v in value.items() if v is not None}
        else:
            given[key] = value
    unknown = settings.take(given)
    if unknown:
        raise ConfigError(f"unknown config key {unknown[0]!r}")
    for old, new in settings.deprecated.items():
        log.warning("config key %r is deprecated: write %s", old, new)

    # Paths in the file are relative to the file.
    base = Path(path).parent if path is not None else Path.cwd()
    if settings.top.get("model_repository"):
        settings.top["model_repository"] = str((base / settings.top["model_repository"]).resolve())
    security = settings.groups["security"]
    for key in _SECURITY_PATH_KEYS:
        if security.get(key):
            security[key] = str((base / security[key]).resolve())
    security.update(_secrets_from_env())
    for name, model in models.items():
        if model.get("path"):
            models[name] = model = {**model, "path": str((base / str(model["path"])).resolve())}
        if isinstance(model.get("input_values"), Mapping):
            resolved = {k: str((base / str(v)).resolve()) for k, v in model["input_values"].items()}
            models[name] = {**model, "input_values": resolved}
    groups = {name: group(**settings.groups[name]) for name, group in GROUPS.items()}
    config = GatewayConfig(**settings.top, **groups, workers=tuple(_dedupe(workers)), models=models, extra=extra,
                           worker_dns=tuple(dict.fromkeys(worker_dns)))
    _validate(config)
    return config


def _models(raw: Any) -> dict[str, Mapping[str, Any]]:
    if not isinstance(raw, Mapping):
        raise ConfigError("config key 'models' must map model names to settings")
    models: dict[str, Mapping[str, Any]] = {}
    for name, settings in raw.items():
        if settings is None:
            settings = {}
        if not isinstance(settings, Mapping):
            raise ConfigError(f"models.{name} must be a mapping of settings")
        models[str(name)] = dict(settings)
        if "relay" in settings:
            models[str(name)]["relay"] = relay_setting(settings["relay"])
    return models


def _secrets_from_env() -> dict[str, str]:
    """Keys and the worker token given in the environment (for containers):
    ``INFERGATE_API_KEYS`` holds key-file lines separated by newlines or ``;``,
    ``INFERGATE_ADMIN_KEYS`` admin keys likewise, ``INFERGATE_WORKER_TOKEN`` the token."""
    return {
        "api_keys_env": os.environ.get("INFERGATE_API_KEYS", ""),
        "admin_keys_env": os.environ.get("INFERGATE_ADMIN_KEYS", ""),
        "worker_token": os.environ.get("INFERGATE_WORKER_TOKEN", "").strip(),
    }


def _dedupe(workers: list[WorkerSpec]) -> list[WorkerSpec]:
    seen: dict[str, WorkerSpec] = {}
    for w in workers:
        seen.setdefault(w.address, w)
    return list(seen.values())


def _validate(config: GatewayConfig) -> None:
    """What no group checks itself: the top-level keys and the models."""
    choices = {"worker_calls": WORKER_CALLS, "worker_streams": WORKER_STREAMS, "model_control_mode": MODEL_CONTROL_MODES,
               "relay": RELAY_MODES}
    for key, allowed in choices.items():
        if getattr(config, key) not in allowed:
            raise ConfigError(f"{key} must be one of {allowed}, got {getattr(config, key)!r}")
    if not isinstance(config.server_name, str) or not config.server_name.strip():
        raise ConfigError(f"server_name must be a non-empty string, got {config.server_name!r}")
    for key in ("max_request_bytes", "default_timeout_s"):
        if getattr(config, key) <= 0:
            raise ConfigError(f"{key} must be positive, got {getattr(config, key)}")
    if not config.worker_keepalive_s * 1000 >= MIN_KEEPALIVE_TIME_MS:
        raise ConfigError(f"worker_keepalive_s must be at least {MIN_KEEPALIVE_TIME_MS / 1000:g} "
                          f"(infergate workers accept two pings a second), got {config.worker_keepalive_s}")
    if not (isinstance(config.prefix_balance_abs_threshold, int) and config.prefix_balance_abs_threshold >= 0):
        raise ConfigError(f"prefix_balance_abs_threshold must be an integer >= 0, "
                          f"got {config.prefix_balance_abs_threshold!r}")
    if not config.prefix_balance_rel_threshold >= 1:
        raise ConfigError(f"prefix_balance_rel_threshold must be at least 1, got {config.prefix_balance_rel_threshold}")
    if not config.triton_keepalive_s > 0:
        raise ConfigError(f"triton_keepalive_s must be positive, got {config.triton_keepalive_s}")
    if config.local.enabled and not config.model_repository:
        raise ConfigError("local.enabled needs model_repository: the models the gateway runs itself")
    for key in ("http_port", "grpc_port"):
        if not 0 <= getattr(config, key) < 65536:
            raise ConfigError(f"{key} must be a port number (0 picks a free one)")
    for name, settings in config.models.items():
        mode = settings.get("mode")
        if mode is not None and mode not in BATCHING_MODES:
            raise ConfigError(f"models.{name}.mode must be one of {BATCHING_MODES}, got {mode!r}")
        relay = settings.get("relay")
        if relay is not None and relay not in RELAY_MODES:
            raise ConfigError(f"models.{name}.relay must be one of {RELAY_MODES}, got {relay!r}")
        _validate_logical(name, settings)
        _validate_placement(name, settings)
    for entry in config.worker_dns:
        check_address(entry.split("://", 1)[1] if entry.startswith(("triton://", "grpc://", "infergate://")) else entry)


def _validate_placement(name: str, settings: Mapping[str, Any]) -> None:
    if settings.get("from") or settings.get("path"):
        return  # a logical model: its replicas are its registry's (see _validate_logical)
    for key, low in (("replicas", 1), ("max_replicas", 1), ("memory_bytes", 0), *((k, 0) for k in PLACEMENT_KEYS[4:])):
        value = settings.get(key, low)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(f"models.{name}.{key} must be an integer >= {low}, got {value!r}")
    if settings.get("max_replicas", settings.get("replicas", 1)) < settings.get("replicas", 1):
        raise ConfigError(f"models.{name}.max_replicas must be at least its replicas")
    ttl = settings.get("idle_ttl_s", 0)
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or ttl < 0:
        raise ConfigError(f"models.{name}.idle_ttl_s must be a non-negative number of seconds, got {ttl!r}")


def _validate_logical(name: str, settings: Mapping[str, Any]) -> None:
    # `replicas` alone declares a placed model, not a logical one.
    declared = [k for k in PARALLEL_KEYS if k in settings and k not in PLACEMENT_KEYS]
    if not declared:
        return
    sources = [k for k in ("from", "path") if settings.get(k)]
    if len(sources) != 1:
        raise ConfigError(f"models.{name}: a logical model needs exactly one of 'from' (a repository model) "
                          f"or 'path' (an .onnx file); it sets {declared}")
    if settings.get("from") == name:
        raise ConfigError(f"models.{name}: a logical model needs a name of its own, not its source's")
    for key in ("tensor_parallel", "pipeline_parallel", "replicas"):
        value = settings.get(key, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"models.{name}.{key} must be a positive integer, got {value!r}")
    inflight = settings.get("max_inflight", 0)
    if isinstance(inflight, bool) or not isinstance(inflight, int) or inflight < 0:
        raise ConfigError(f"models.{name}.max_inflight must be a non-negative integer, got {inflight!r}")
