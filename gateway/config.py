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

from gateway.limits import AdmissionSettings
from gateway.routing.hedging import HedgeSettings
from gateway.routing.outlier import OutlierSettings
from gateway.routing.retry_budget import RetrySettings

WORKER_KINDS = ("infergate", "triton")
BATCHING_MODES = ("adaptive", "fixed", "off")
MODEL_CONTROL_MODES = ("none", "explicit")
# Keys of a `models.<name>` entry that declare a logical (split) model rather
# than batching settings; see gateway/parallel/serving.py.
PARALLEL_KEYS = ("from", "path", "version", "tensor_parallel", "pipeline_parallel", "replicas", "max_inflight",
                 "input_shapes", "input_values", "collectives")
# `models.<name>` keys for placement (replicas, ceiling, idle TTL, memory: fleet/placement.py) and in-flight bounds.
PLACEMENT_KEYS = ("replicas", "max_replicas", "idle_ttl_s", "memory_bytes", "busy_inflight_per_replica",
                  "max_inflight_per_replica")


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
    # Batches in flight per replica (0 = derived): busy = the replica's execution slots for the
    # model (adaptive batching sends at once only below it), max = busy + 1; a batching model
    # under light_row_ms a row is busy at 1, one at or over it at max (gateway/routing/light.py).
    max_inflight_per_replica: int = 0
    busy_inflight_per_replica: int = 0
    light_row_ms: float = 2.0
    # "unary" or "stream": see gateway.fleet.worker_stream.
    worker_calls: str = "unary"
    probe_interval_s: float = 2.0
    probe_failures_to_down: int = 2
    # One probe's bound: a worker alive but unreachable (a cut link) is found only
    # by it, after probe_failures_to_down of them.
    probe_timeout_s: float = 5.0
    default_timeout_s: float = 60.0
    retry_limit: int = 3
    max_request_bytes: int = 256 * 2**20
    shutdown_grace_s: float = 10.0
    # Triton's --strict-readiness: ready only while every model the gateway is
    # asked to serve is servable (False: ready whenever it is up).
    strict_readiness: bool = True
    # Triton's --model-control-mode: "explicit" lets clients load and unload
    # models through the gateway; "none" refuses them (placement still loads).
    model_control_mode: str = "explicit"
    # The response cache's bound in bytes (0 = off): models whose config.pbtxt
    # says `response_cache { enable: true }` are answered from it (gateway/caching/).
    cache_size: int = 0
    # Reliability (gateway/routing/outlier.py, retry_budget.py, hedging.py, limits.py).
    # Outlier ejection: N consecutive failures or a latency outlier ejects a
    # worker for base * (its ejection count), at most max, and never more
    # than max_ejection_percent of the workers at once.
    outlier_consecutive_failures: int = 5
    outlier_base_ejection_s: float = 30.0
    outlier_max_ejection_s: float = 300.0
    outlier_max_ejection_percent: float = 50.0
    outlier_latency_factor: float = 3.0
    outlier_latency_min_excess_s: float = 0.05
    # Retries: extra attempts in flight <= max(min_concurrency, percent of calls
    # in flight); full-jitter exponential backoff from base to max.
    retry_budget_percent: float = 20.0
    retry_min_concurrency: int = 3
    retry_backoff_base_s: float = 0.025
    retry_backoff_max_s: float = 0.25
    # Hedging (off at 0): a second attempt once one runs past this percentile
    # of the model's latency. Hang detection: an attempt silent past
    # max(hang_min_s, hang_multiplier * p99) counts as failed and gets a second.
    hedge_percentile: float = 0.0
    hedge_min_delay_s: float = 0.005
    hang_multiplier: float = 8.0
    hang_min_s: float = 1.0
    # Gateway-wide bounds on admitted requests (0 = none); the last
    # priority_reserve_percent of the request bound is for priority 1.
    max_inflight_requests: int = 8192
    max_inflight_bytes: int = 2 * 2**30
    priority_reserve_percent: float = 10.0
    # The workers' repository, read only to split the logical models declared with `from:` (`up` fills it in).
    model_repository: str = ""
    # Fleet (gateway/fleet/manager.py). Membership beyond `workers`: DNS names whose
    # every address is a worker (`[triton://]NAME:PORT`, re-resolved every
    # dns_refresh_s) and workers that register (`infergate worker --gateway`),
    # down after heartbeat_misses_to_down missed heartbeats.
    worker_dns: tuple[str, ...] = ()
    dns_refresh_s: float = 10.0
    heartbeat_interval_s: float = 2.0
    heartbeat_misses_to_down: int = 3
    # Placement and model lifecycle (gateway/fleet/placement.py, gateway/fleet/demand.py):
    # models with `replicas` are placed at start; others, with load_on_demand,
    # on their first request. Idle past model_idle_ttl_s (0 = never): unloaded.
    # A worker holds models up to worker_memory_cap_bytes (0 = no cap) or
    # worker_memory_fraction of its reported device memory; the least recently
    # used go first. Autoscaling (off while autoscale_up_rate is 0): a replica
    # more above autoscale_up_rate inferences/s per replica, one fewer below
    # autoscale_down_rate (default half of it) per remaining replica.
    placement_interval_s: float = 2.0
    load_on_demand: bool = False
    model_idle_ttl_s: float = 0.0
    worker_memory_cap_bytes: int = 0
    worker_memory_fraction: float = 0.8
    default_model_memory_bytes: int = 0
    autoscale_up_rate: float = 0.0
    autoscale_down_rate: float = 0.0
    autoscale_max_replicas: int = 0
    autoscale_cooldown_s: float = 30.0
    drain_timeout_s: float = 120.0
    # Security (gateway/security/setup.py); empty = off. Files: API keys (lines
    # `KEY [MODELS] [rate=N/s] ...`, gateway/security/api_keys.py), admin keys, the
    # frontends' TLS certificate and key, the shared worker token, and the
    # CA / client certificate and key for TLS to the workers.
    api_key_file: str = ""
    admin_key_file: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    worker_token_file: str = ""
    worker_tls_ca: str = ""
    worker_tls_cert: str = ""
    worker_tls_key: str = ""
    # Secrets given in the environment (INFERGATE_API_KEYS, INFERGATE_ADMIN_KEYS,
    # INFERGATE_WORKER_TOKEN): never from the YAML file, never in a repr.
    api_keys_env: str = field(default="", repr=False)
    admin_keys_env: str = field(default="", repr=False)
    worker_token: str = field(default="", repr=False)
    # model name -> settings: batching overrides (BatchPolicy keys) and, for
    # logical models, parallel layouts (from, tensor_parallel, ...).
    models: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # Everything else in the file (e.g. trace_config: observability/trace_settings.py), for the parts that read it.
    extra: Mapping[str, Any] = field(default_factory=dict)

    def outlier_settings(self) -> OutlierSettings:
        return OutlierSettings(
            consecutive_failures=self.outlier_consecutive_failures,
            base_ejection_s=self.outlier_base_ejection_s,
            max_ejection_s=self.outlier_max_ejection_s,
            max_ejection_percent=self.outlier_max_ejection_percent,
            latency_factor=self.outlier_latency_factor,
            latency_min_excess_s=self.outlier_latency_min_excess_s,
        )

    def retry_settings(self) -> RetrySettings:
        return RetrySettings(self.retry_budget_percent, self.retry_min_concurrency,
                             self.retry_backoff_base_s, self.retry_backoff_max_s)

    def hedge_settings(self) -> HedgeSettings:
        return HedgeSettings(hedge_percentile=self.hedge_percentile, hedge_min_delay_s=self.hedge_min_delay_s,
                             hang_multiplier=self.hang_multiplier, hang_min_s=self.hang_min_s)

    def admission_settings(self) -> AdmissionSettings:
        return AdmissionSettings(self.max_inflight_requests, self.max_inflight_bytes, self.priority_reserve_percent)

    def model_settings(self, name: str) -> Mapping[str, Any]:
        return self.models.get(name, {})

    def batching_settings(self, name: str) -> Mapping[str, Any]:
        """The model's settings without the keys that declare a logical model."""
        return {k: v for k, v in self.models.get(name, {}).items() if k not in PARALLEL_KEYS and k not in PLACEMENT_KEYS}

    def logical_models(self) -> dict[str, Mapping[str, Any]]:
        """Logical models (split across workers): entries with a `from:` or `path:` key."""
        return {name: s for name, s in self.models.items() if "from" in s or "path" in s}


# Read only from the environment (see _secrets_from_env), never from the file or flags.
_SECRET_KEYS = ("api_keys_env", "admin_keys_env", "worker_token")
# File paths: relative ones in the YAML file are relative to the file.
_SECURITY_PATH_KEYS = ("api_key_file", "admin_key_file", "tls_cert", "tls_key", "worker_token_file",
                       "worker_tls_ca", "worker_tls_cert", "worker_tls_key")
_SCALARS = {f.name: f for f in fields(GatewayConfig)
            if f.name not in ("workers", "models", "extra", "worker_dns", *_SECRET_KEYS)}


def _coerce(key: str, value: Any) -> Any:
    default = getattr(GatewayConfig(), key)
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
        elif key not in ("workers", "models", "worker_dns"):
            extra[key] = value

    workers = [WorkerSpec.from_mapping(w) for w in (data.get("workers") or [])]
    dns_raw = data.get("worker_dns") or []
    worker_dns = [str(n) for n in ([dns_raw] if isinstance(dns_raw, str) else dns_raw)]
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
        elif key == "worker_dns":
            worker_dns.extend(str(n) for n in value)
        elif key in _SCALARS:
            values[key] = _coerce(key, value)
        elif key == "trace_config":  # Triton's --trace-config flags, after the file's entries
            extra["trace_config"] = [*(extra.get("trace_config") or []), *value]
        else:
            raise ConfigError(f"unknown config key {key!r}")

    # Paths in the file are relative to the file.
    base = Path(path).parent if path is not None else Path.cwd()
    for key in ("model_repository", *_SECURITY_PATH_KEYS):
        if values.get(key):
            values[key] = str((base / values[key]).resolve())
    for name, settings in models.items():
        if settings.get("path"):
            models[name] = settings = {**settings, "path": str((base / str(settings["path"])).resolve())}
        if isinstance(settings.get("input_values"), Mapping):
            resolved = {k: str((base / str(v)).resolve()) for k, v in settings["input_values"].items()}
            models[name] = {**settings, "input_values": resolved}
    config = GatewayConfig(**values, **_secrets_from_env(), workers=tuple(_dedupe(workers)), models=models, extra=extra,
                           worker_dns=tuple(dict.fromkeys(worker_dns)))
    _validate(config)
    return config


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
    choices = {"worker_calls": ("unary", "stream"), "batching_mode": BATCHING_MODES,
               "model_control_mode": MODEL_CONTROL_MODES}
    for key, allowed in choices.items():
        if getattr(config, key) not in allowed:
            raise ConfigError(f"{key} must be one of {allowed}, got {getattr(config, key)!r}")
    for key in ("max_queue_size", "probe_failures_to_down", "max_request_bytes"):
        if getattr(config, key) <= 0:
            raise ConfigError(f"{key} must be positive, got {getattr(config, key)}")
    for key in ("max_inflight_per_replica", "busy_inflight_per_replica"):
        if getattr(config, key) < 0:
            raise ConfigError(f"{key} must be >= 0 (0 = from the replica's execution slots), got {getattr(config, key)}")
    if config.cache_size < 0 or config.light_row_ms < 0:
        raise ConfigError("cache_size (bytes) and light_row_ms must be >= 0 (0 turns them off)")
    for key in ("http_port", "grpc_port"):
        if not 0 <= getattr(config, key) < 65536:
            raise ConfigError(f"{key} must be a port number (0 picks a free one)")
    if config.probe_interval_s <= 0 or config.default_timeout_s <= 0 or config.probe_timeout_s <= 0:
        raise ConfigError("probe_interval_s, probe_timeout_s and default_timeout_s must be positive")
    _validate_reliability(config)
    for cert, key in (("tls_cert", "tls_key"), ("worker_tls_cert", "worker_tls_key")):
        if bool(getattr(config, cert)) != bool(getattr(config, key)):
            raise ConfigError(f"{cert} and {key} go together: give both or neither")
    for name, settings in config.models.items():
        mode = settings.get("mode")
        if mode is not None and mode not in BATCHING_MODES:
            raise ConfigError(f"models.{name}.mode must be one of {BATCHING_MODES}, got {mode!r}")
        _validate_logical(name, settings)
        _validate_placement(name, settings)
    _validate_fleet(config)


def _validate_reliability(config: GatewayConfig) -> None:
    """Build the reliability settings once, so a bad key fails at load time and names itself."""
    for build in (config.outlier_settings, config.retry_settings, config.hedge_settings, config.admission_settings):
        try:
            build()
        except ValueError as e:
            raise ConfigError(str(e)) from None


def _validate_fleet(config: GatewayConfig) -> None:
    for key in ("dns_refresh_s", "heartbeat_interval_s", "placement_interval_s", "drain_timeout_s"):
        if getattr(config, key) <= 0:
            raise ConfigError(f"{key} must be positive, got {getattr(config, key)}")
    for key in ("model_idle_ttl_s", "worker_memory_cap_bytes", "default_model_memory_bytes", "autoscale_up_rate",
                "autoscale_down_rate", "autoscale_max_replicas", "autoscale_cooldown_s"):
        if getattr(config, key) < 0:
            raise ConfigError(f"{key} must not be negative, got {getattr(config, key)}")
    if config.heartbeat_misses_to_down < 1:
        raise ConfigError("heartbeat_misses_to_down must be at least 1")
    if not 0 < config.worker_memory_fraction <= 1:
        raise ConfigError(f"worker_memory_fraction must be in (0, 1], got {config.worker_memory_fraction}")
    if config.autoscale_up_rate and config.autoscale_down_rate >= config.autoscale_up_rate:
        raise ConfigError("autoscale_down_rate must be below autoscale_up_rate (the gap is the hysteresis)")
    for entry in config.worker_dns:
        text = entry.split("://", 1)[1] if entry.startswith(("triton://", "grpc://", "infergate://")) else entry
        _check_address(text)


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


def with_workers(config: GatewayConfig, workers: list[WorkerSpec]) -> GatewayConfig:
    return replace(config, workers=tuple(_dedupe(list(config.workers) + workers)))
