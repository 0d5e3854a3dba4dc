"""The gateway's settings as typed records: ``GatewayConfig`` and its groups.

One frozen record per concern (batching, cache, probe, retry, outlier, hedge,
admission, membership, placement, autoscale, security, local execution), nested in
``GatewayConfig`` under the names the YAML file uses (``retry.budget_percent``
is ``config.retry.budget_percent``). Each group checks its own values when
built, so a bad key fails at load and names itself as ``group.key``.

This module imports nothing of the project: every package may import its
settings from here without importing the loader (``gateway/config.py``,
which reads the file, the flags and the environment and builds these).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Mapping

WORKER_KINDS = ("infergate", "triton", "openai")
BATCHING_MODES = ("adaptive", "fixed", "off")
MODEL_CONTROL_MODES = ("none", "explicit")
WORKER_CALLS = ("unary", "stream")
WORKER_STREAMS = ("packed", "per_request")
# Which calls take the relay lane (gateway/core/relay.py): "auto", those no gateway feature needs to read; "off", none.
RELAY_MODES = ("auto", "off")
# `models.<name>` keys of the request path beside batching: the model's relay lane (RELAY_MODES).
LANE_KEYS = ("relay",)
LOCAL_DEVICES = ("auto", "cpu", "cuda")
# How a local replica's ONNX Runtime sessions use the CPU (execution.backends.onnx).
CPU_SESSIONS = ("adaptive", "shared", "per_instance")
# Keys of a `models.<name>` entry that declare a logical (split) model rather
# than batching settings; see gateway/parallel/serving.py.
PARALLEL_KEYS = ("from", "path", "version", "tensor_parallel", "pipeline_parallel", "replicas", "max_inflight",
                 "input_shapes", "input_values", "collectives")
# `models.<name>` keys for placement (replicas, ceiling, idle TTL, memory: fleet/placement.py) and in-flight bounds.
PLACEMENT_KEYS = ("replicas", "max_replicas", "idle_ttl_s", "memory_bytes", "busy_inflight_per_replica",
                  "max_inflight_per_replica")
# Field metadata of a setting the code tunes but the config file does not set.
INTERNAL = {"config": False}


class ConfigError(ValueError):
    """The configuration is invalid; the message names the key."""


def config_keys(group: type) -> tuple[str, ...]:
    """The keys the config file may set in a group (its fields, less the internal ones)."""
    return tuple(f.name for f in fields(group) if f.metadata.get("config", True))


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """One worker server: ``HOST:PORT`` (infergate), ``triton://HOST:PORT`` or ``openai://HOST:PORT``
    (an OpenAI-protocol server: vLLM, SGLang, llama.cpp, ``transformers serve``)."""

    address: str
    kind: str = "infergate"
    # Sent as gRPC metadata on statistics and repository calls (Triton's
    # restricted-protocol tokens, e.g. triton-grpc-protocol-triton-access-token);
    # as HTTP headers on every call to an OpenAI-protocol server.
    headers: tuple[tuple[str, str], ...] = ()
    # An OpenAI-protocol server's API key, sent as ``Authorization: Bearer KEY``.
    api_key: str = ""
    # The models an OpenAI-protocol server serves under these names, in place of
    # its ``GET /v1/models`` list (a server that lists names it does not serve).
    models: tuple[str, ...] = ()
    # Streams the gateway opens at once on an OpenAI-protocol server (0: the default).
    max_streams: int = 0

    @classmethod
    def parse(cls, text: str) -> "WorkerSpec":
        text = text.strip()
        kind = "infergate"
        for prefix, named in (("triton://", "triton"), ("grpc://", "infergate"), ("infergate://", "infergate"),
                              ("openai://", "openai")):
            if text.startswith(prefix):
                kind = named
                text = text[len(prefix):]
        check_address(text)
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
        extra = {key: data[key] for key in ("api_key", "models", "max_streams") if data.get(key) not in (None, "")}
        if extra and kind != "openai":
            raise ConfigError(f"workers entry {spec.address}: {', '.join(extra)} only apply to kind 'openai'")
        models = extra.get("models", ())
        if isinstance(models, str) or not all(isinstance(m, str) and m for m in models):
            raise ConfigError(f"workers entry {spec.address}: models must be a list of model names")
        max_streams = extra.get("max_streams", 0)
        if not isinstance(max_streams, int) or isinstance(max_streams, bool) or max_streams < 0:
            raise ConfigError(f"workers entry {spec.address}: max_streams must be a positive integer")
        return cls(address=spec.address, kind=kind, headers=tuple((str(k).lower(), str(v)) for k, v in headers.items()),
                   api_key=str(extra.get("api_key", "")), models=tuple(models), max_streams=max_streams)


def check_address(address: str) -> None:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"worker address must be HOST:PORT, got {address!r}")


def _positive(group: str, record: Any, *keys: str) -> None:
    for key in keys:
        if getattr(record, key) <= 0:
            raise ConfigError(f"{group}.{key} must be positive, got {getattr(record, key)}")


def _not_negative(group: str, record: Any, *keys: str) -> None:
    for key in keys:
        if getattr(record, key) < 0:
            raise ConfigError(f"{group}.{key} must not be negative, got {getattr(record, key)}")


@dataclass(frozen=True, slots=True)
class BatchingSettings:
    """Batching defaults for every model (per-model keys in ``models`` win).

    Batches in flight per replica (0 = derived): busy = the replica's execution
    slots for the model (adaptive batching sends at once only below it), max =
    busy + 1; a batching model under ``light_row_ms`` a row is busy at 1, one at
    or over it at max (gateway/routing/light.py). ``burst_hold_us``: under a
    burst, how long a batch short of ``max_batch_size`` waits for more rows once
    a slot frees (gateway/batching/batcher.py; 0 = it goes at once).
    """

    mode: str = "adaptive"
    max_queue_size: int = 1024
    max_inflight_per_replica: int = 0
    busy_inflight_per_replica: int = 0
    light_row_ms: float = 2.0
    burst_hold_us: int = 5000

    def __post_init__(self) -> None:
        if self.mode not in BATCHING_MODES:
            raise ConfigError(f"batching.mode must be one of {BATCHING_MODES}, got {self.mode!r}")
        _positive("batching", self, "max_queue_size")
        _not_negative("batching", self, "max_inflight_per_replica", "busy_inflight_per_replica", "light_row_ms",
                      "burst_hold_us")


@dataclass(frozen=True, slots=True)
class CacheSettings:
    """The response cache (gateway/caching/): its bound in bytes, 0 = off. Models whose
    config.pbtxt says ``response_cache { enable: true }`` are answered from it."""

    size_bytes: int = 0

    def __post_init__(self) -> None:
        _not_negative("cache", self, "size_bytes")


@dataclass(frozen=True, slots=True)
class ProbeSettings:
    """The cluster's health probes (gateway/fleet/cluster.py). ``timeout_s`` bounds one
    probe: a worker alive but unreachable (a cut link) is found only by it, after
    ``failures_to_down`` of them."""

    interval_s: float = 2.0
    failures_to_down: int = 2
    timeout_s: float = 5.0

    def __post_init__(self) -> None:
        _positive("probe", self, "interval_s", "failures_to_down", "timeout_s")


@dataclass(frozen=True, slots=True)
class RetrySettings:
    """The router's retry policy: extra attempts in flight <= max(min_concurrency,
    budget_percent of the calls in flight), full-jitter exponential backoff from
    base to max, at most ``limit`` retries of one call."""

    budget_percent: float = 20.0  # extra attempts in flight, as a share of routed calls in flight
    min_concurrency: int = 3  # extra attempts always allowed, however few calls run
    backoff_base_s: float = 0.025
    backoff_max_s: float = 0.25
    limit: int = 3

    def __post_init__(self) -> None:
        if not 0 <= self.budget_percent <= 100:
            raise ConfigError(f"retry.budget_percent must be within 0..100, got {self.budget_percent}")
        _not_negative("retry", self, "min_concurrency", "limit")
        if self.backoff_base_s < 0 or self.backoff_max_s < self.backoff_base_s:
            raise ConfigError("retry backoff needs 0 <= retry.backoff_base_s <= retry.backoff_max_s")


@dataclass(frozen=True, slots=True)
class OutlierSettings:
    """Outlier ejection (gateway/routing/outlier.py): ``consecutive_failures`` in a
    row or a latency outlier ejects a worker for base * (its ejection count), at
    most max, and never more than ``max_ejection_percent`` of the workers at once."""

    consecutive_failures: int = 5  # 0 turns failure ejection off
    base_ejection_s: float = 30.0
    max_ejection_s: float = 300.0
    max_ejection_percent: float = 50.0
    latency_factor: float = 3.0  # 0 turns latency ejection off
    latency_min_excess_s: float = 0.05
    latency_min_samples: int = field(default=10, metadata=INTERNAL)
    half_open_trials: int = field(default=1, metadata=INTERNAL)  # attempts in flight while HALF_OPEN

    def __post_init__(self) -> None:
        _not_negative("outlier", self, "consecutive_failures", "latency_min_excess_s")
        if self.latency_min_samples < 1 or self.half_open_trials < 1:
            raise ConfigError("outlier: latency_min_samples and half_open_trials must be >= 1")
        if self.base_ejection_s <= 0 or self.max_ejection_s < self.base_ejection_s:
            raise ConfigError("outlier ejection needs 0 < outlier.base_ejection_s <= outlier.max_ejection_s")
        if not 0 <= self.max_ejection_percent <= 100:
            raise ConfigError(f"outlier.max_ejection_percent must be within 0..100, got {self.max_ejection_percent}")
        if self.latency_factor != 0 and self.latency_factor <= 1:
            raise ConfigError(f"outlier.latency_factor must be 0 (off) or above 1, got {self.latency_factor}")


@dataclass(frozen=True, slots=True)
class HedgeSettings:
    """Hedging (off at 0): a second attempt once one runs past ``percentile`` of the
    model's latency. Hang detection: an attempt silent past max(hang_min_s,
    hang_multiplier * p99) counts as failed and gets a second (gateway/routing/hedging.py)."""

    percentile: float = 0.0  # 0 = no hedging; e.g. 95 hedges the slowest 5%
    min_delay_s: float = 0.005
    hang_multiplier: float = 8.0  # 0 = no hang detection
    hang_min_s: float = 1.0
    max_extra_attempts: int = field(default=1, metadata=INTERNAL)  # attempts in flight beside the first
    min_samples: int = field(default=20, metadata=INTERNAL)  # latencies a model needs before its thresholds apply

    def __post_init__(self) -> None:
        if not (self.percentile == 0 or 50 <= self.percentile < 100):
            raise ConfigError(f"hedge.percentile must be 0 (off) or within 50..100, got {self.percentile}")
        if self.min_delay_s < 0 or self.hang_min_s <= 0 or self.hang_multiplier < 0:
            raise ConfigError("hedge.min_delay_s must be >= 0, hedge.hang_min_s > 0 and "
                              "hedge.hang_multiplier >= 0 (0 = off)")
        if self.max_extra_attempts < 0 or self.min_samples < 1:
            raise ConfigError("hedge: max_extra_attempts >= 0 and min_samples >= 1 are required")


@dataclass(frozen=True, slots=True)
class AdmissionSettings:
    """Gateway-wide bounds on admitted requests (gateway/limits.py; 0 = none); the
    last ``priority_reserve_percent`` of the request bound is for priority 1."""

    max_inflight_requests: int = 8192  # 0 = no bound
    max_inflight_bytes: int = 2 * 2**30  # 0 = no bound
    priority_reserve_percent: float = 10.0
    retry_after_s: float = field(default=1.0, metadata=INTERNAL)

    def __post_init__(self) -> None:
        _not_negative("admission", self, "max_inflight_requests", "max_inflight_bytes")
        if not 0 <= self.priority_reserve_percent < 100:
            raise ConfigError(f"admission.priority_reserve_percent must be within 0..100, "
                              f"got {self.priority_reserve_percent}")
        _positive("admission", self, "retry_after_s")


@dataclass(frozen=True, slots=True)
class MembershipSettings:
    """Membership beyond ``workers`` (gateway/fleet/manager.py): ``worker_dns`` names
    re-resolved every ``dns_refresh_s``, and workers that register, down after
    ``heartbeat_misses_to_down`` missed heartbeats."""

    dns_refresh_s: float = 10.0
    heartbeat_interval_s: float = 2.0
    heartbeat_misses_to_down: int = 3

    def __post_init__(self) -> None:
        _positive("membership", self, "dns_refresh_s", "heartbeat_interval_s", "heartbeat_misses_to_down")


@dataclass(frozen=True, slots=True)
class PlacementSettings:
    """Placement and model lifecycle (gateway/fleet/placement.py, demand.py): models
    with ``replicas`` are placed at start; others, with ``load_on_demand``, on their
    first request. Idle past ``idle_ttl_s`` (0 = never): unloaded. A worker holds
    models up to ``worker_memory_cap_bytes`` (0 = no cap) or ``worker_memory_fraction``
    of its reported device memory; the least recently used go first."""

    interval_s: float = 2.0
    load_on_demand: bool = False
    idle_ttl_s: float = 0.0
    worker_memory_cap_bytes: int = 0
    worker_memory_fraction: float = 0.8
    default_model_memory_bytes: int = 0
    drain_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        _positive("placement", self, "interval_s", "drain_timeout_s")
        _not_negative("placement", self, "idle_ttl_s", "worker_memory_cap_bytes", "default_model_memory_bytes")
        if not 0 < self.worker_memory_fraction <= 1:
            raise ConfigError(f"placement.worker_memory_fraction must be in (0, 1], got {self.worker_memory_fraction}")


@dataclass(frozen=True, slots=True)
class AutoscaleSettings:
    """Autoscaling (off while ``up_rate`` is 0): a replica more above ``up_rate``
    inferences/s per replica, one fewer below ``down_rate`` (default half of it)
    per remaining replica."""

    up_rate: float = 0.0
    down_rate: float = 0.0
    max_replicas: int = 0
    cooldown_s: float = 30.0

    def __post_init__(self) -> None:
        _not_negative("autoscale", self, "up_rate", "down_rate", "max_replicas", "cooldown_s")
        if self.up_rate and self.down_rate >= self.up_rate:
            raise ConfigError("autoscale.down_rate must be below autoscale.up_rate (the gap is the hysteresis)")


@dataclass(frozen=True, slots=True)
class SecuritySettings:
    """Security (gateway/security/setup.py); empty = off. Files: API keys (lines
    ``KEY [MODELS] [rate=N/s] ...``, gateway/security/api_keys.py), admin keys, the
    frontends' TLS certificate and key, the shared worker token, and the CA /
    client certificate and key for TLS to the workers."""

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
    api_keys_env: str = field(default="", repr=False, metadata=INTERNAL)
    admin_keys_env: str = field(default="", repr=False, metadata=INTERNAL)
    worker_token: str = field(default="", repr=False, metadata=INTERNAL)

    def __post_init__(self) -> None:
        for cert, key in (("tls_cert", "tls_key"), ("worker_tls_cert", "worker_tls_key")):
            if bool(getattr(self, cert)) != bool(getattr(self, key)):
                raise ConfigError(f"security.{cert} and security.{key} go together: give both or neither")


@dataclass(frozen=True, slots=True)
class LocalSettings:
    """Local execution (gateway/replicas/local.py, ``infergate serve``): with
    ``enabled``, the models of ``model_repository`` run in the gateway process, one
    more replica beside any workers. The rest as the worker's flags of the same
    names (0 / "" = the worker's defaults)."""

    enabled: bool = False
    device: str = "auto"
    intra_op_threads: int = 0
    execution_threads: int = 0
    cpu_sessions: str = ""
    max_queue_size: int = 1024

    def __post_init__(self) -> None:
        if self.device not in LOCAL_DEVICES:
            raise ConfigError(f"local.device must be one of {LOCAL_DEVICES}, got {self.device!r}")
        if self.cpu_sessions not in ("", *CPU_SESSIONS):
            raise ConfigError(f"local.cpu_sessions must be one of {CPU_SESSIONS}, got {self.cpu_sessions!r}")
        _not_negative("local", self, "intra_op_threads", "execution_threads")
        _positive("local", self, "max_queue_size")


def logical_models(models: Mapping[str, Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    """The logical models (split across workers) among the `models` entries: those with a `from:` or `path:` key."""
    return {name: s for name, s in models.items() if "from" in s or "path" in s}


# The groups, by the name each has in the config file and on GatewayConfig.
GROUPS: dict[str, type] = {
    "batching": BatchingSettings, "cache": CacheSettings, "probe": ProbeSettings, "retry": RetrySettings,
    "outlier": OutlierSettings, "hedge": HedgeSettings, "admission": AdmissionSettings,
    "membership": MembershipSettings, "placement": PlacementSettings, "autoscale": AutoscaleSettings,
    "security": SecuritySettings, "local": LocalSettings,
}


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """Everything the gateway is configured with, built once by gateway/config.py."""

    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    workers: tuple[WorkerSpec, ...] = ()
    # DNS names whose every address is a worker (`[triton://]NAME:PORT`), re-resolved.
    worker_dns: tuple[str, ...] = ()
    # "unary" or "stream": see gateway.replicas.unary_stream.
    worker_calls: str = "unary"
    # "packed" or "per_request": how streamed requests reach infergate workers
    # (gateway.replicas.packed_streams).
    worker_streams: str = "packed"
    # Seconds a worker's connection may be silent, with calls open, before the gateway pings it
    # (serverkit.grpc_server's defaults, a test checks): an infergate worker's, and a Triton
    # server's (which by default refuses pings less than 300 s apart).
    worker_keepalive_s: float = 10.0
    triton_keepalive_s: float = 310.0
    default_timeout_s: float = 60.0
    # "auto": a ModelInfer call that no gateway feature needs to read is relayed as its bytes
    # (gateway/core/relay.py); "off": every call is read. `models.<name>.relay` sets one model's.
    # Off until the lane is faster than the full path under load (bench/results.md).
    relay: str = "off"
    # Streams of generative models go where their prompt's prefix went, to meet the worker's
    # prefix cache (gateway.routing.prefix); False: least loaded, as every other call.
    prefix_routing: bool = True
    # Routing by prefix turns to the least busy worker while the route's is far busier: its load
    # (streams held + the server's queue) more than this many above the least busy's...
    prefix_balance_abs_threshold: int = 4
    # ...and more than this many times it (SGLang's and vllm-router's balance_*_threshold).
    prefix_balance_rel_threshold: float = 1.5
    max_request_bytes: int = 256 * 2**20
    shutdown_grace_s: float = 10.0
    # Triton's --strict-readiness: ready only while every model the gateway is
    # asked to serve is servable (False: ready whenever it is up).
    strict_readiness: bool = True
    # Triton's --model-control-mode: "explicit" lets clients load and unload
    # models through the gateway; "none" refuses them (placement still loads).
    model_control_mode: str = "explicit"
    # The `name` server metadata gives (HTTP `GET /v2`, gRPC ServerMetadata): "triton"
    # lets a fleet keep clients that check it while they move to the gateway.
    server_name: str = "infergate"
    # The workers' repository, read to split the logical models declared with `from:` (`up` fills it in),
    # and the models the gateway runs itself with `local.enabled`.
    model_repository: str = ""
    batching: BatchingSettings = field(default_factory=BatchingSettings)
    cache: CacheSettings = field(default_factory=CacheSettings)
    probe: ProbeSettings = field(default_factory=ProbeSettings)
    retry: RetrySettings = field(default_factory=RetrySettings)
    outlier: OutlierSettings = field(default_factory=OutlierSettings)
    hedge: HedgeSettings = field(default_factory=HedgeSettings)
    admission: AdmissionSettings = field(default_factory=AdmissionSettings)
    membership: MembershipSettings = field(default_factory=MembershipSettings)
    placement: PlacementSettings = field(default_factory=PlacementSettings)
    autoscale: AutoscaleSettings = field(default_factory=AutoscaleSettings)
    security: SecuritySettings = field(default_factory=SecuritySettings)
    local: LocalSettings = field(default_factory=LocalSettings)
    # model name -> settings: batching overrides (BatchPolicy keys) and, for
    # logical models, parallel layouts (from, tensor_parallel, ...).
    models: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # Everything else in the file (e.g. trace_config: observability/trace_settings.py), for the parts that read it.
    extra: Mapping[str, Any] = field(default_factory=dict)

    def model_settings(self, name: str) -> Mapping[str, Any]:
        return self.models.get(name, {})

    def batching_settings(self, name: str) -> Mapping[str, Any]:
        """The model's settings without the keys that declare a logical model."""
        return {k: v for k, v in self.models.get(name, {}).items()
                if k not in PARALLEL_KEYS and k not in PLACEMENT_KEYS and k not in LANE_KEYS}

    def relay_mode(self, name: str) -> str:
        """The model's relay setting (``models.<name>.relay``), else the gateway's (``relay``)."""
        return str(self.models.get(name, {}).get("relay", self.relay))

    def logical_models(self) -> dict[str, Mapping[str, Any]]:
        """Logical models (split across workers): entries with a `from:` or `path:` key."""
        return logical_models(self.models)
