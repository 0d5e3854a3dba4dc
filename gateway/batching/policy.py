"""The batching policy of one model: what the batcher is told to do.

Owns :class:`BatchPolicy`: Triton's ``dynamic_batching`` settings (preferred
sizes, queue delay, priority levels, queue policies, ordering) plus the
gateway's batching mode, read from a model's ``ModelConfig`` and overridden by
the gateway config, and :class:`QueuePolicy`, one priority level's own queue
policy (Triton's ``priority_queue_policy``). It is validated once, when built;
the batcher trusts it.

Which ``max_queue_size`` wins, first to last: the gateway config's
``models.<name>.max_queue_size``, the model's
``default_queue_policy.max_queue_size`` (when above 0; Triton's 0 means
unlimited, and the gateway keeps every queue bounded), the gateway-wide
``max_queue_size``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

from tritonclient.grpc import model_config_pb2

BatchingMode = Literal["adaptive", "fixed", "off"]
TimeoutAction = Literal["REJECT", "DELAY"]
DEFAULT_MAX_QUEUE_SIZE = 1024


@dataclass(frozen=True, slots=True)
class QueuePolicy:
    """One priority level's queue policy (Triton's ``ModelQueuePolicy``); ``max_queue_size`` 0 = no bound of its own."""

    default_timeout_us: int = 0
    timeout_action: TimeoutAction = "REJECT"
    allow_timeout_override: bool = True
    max_queue_size: int = 0

    @classmethod
    def from_proto(cls, qp: model_config_pb2.ModelQueuePolicy) -> QueuePolicy:
        return cls(
            default_timeout_us=qp.default_timeout_microseconds,
            timeout_action=model_config_pb2.ModelQueuePolicy.TimeoutAction.Name(qp.timeout_action),  # type: ignore[arg-type]
            allow_timeout_override=qp.allow_timeout_override,
            max_queue_size=qp.max_queue_size,
        )


@dataclass(frozen=True, slots=True)
class BatchPolicy:
    """How one model's requests are queued and batched.

    ``max_queue_size`` bounds all priority levels together; priority level 1
    is the highest (Triton's convention) and a request's priority 0 (or one out
    of range) means ``default_priority_level``. A queue timeout (Triton's
    ``default_queue_policy``) either rejects a request still queued after it or
    (``DELAY``) moves it behind the not-yet-timed-out requests of its level.
    """

    max_batch_size: int  # 0 = the model does not batch: each request is its own batch
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_delay_us: int = 0
    mode: BatchingMode = "adaptive"
    max_queue_size: int = DEFAULT_MAX_QUEUE_SIZE
    priority_levels: int = 0  # 0 = one level
    default_priority_level: int = 0
    default_timeout_us: int = 0  # 0 = no queue timeout
    timeout_action: TimeoutAction = "REJECT"
    allow_timeout_override: bool = True
    preserve_ordering: bool = False
    # Levels with a queue policy of their own (Triton's priority_queue_policy): (level, policy).
    priority_queue_policies: tuple[tuple[int, QueuePolicy], ...] = ()
    # Adaptive mode under a burst: a batch whose requests found every slot busy waits up to
    # this long for max_batch_size rows even once a slot frees (0 = it goes at once).
    burst_hold_us: int = 0

    def queue_policy(self, level: int) -> QueuePolicy:
        """The queue policy of priority ``level`` (1-based): its own, else the default one
        (whose ``max_queue_size`` bounds the whole queue, not one level)."""
        for own_level, policy in self.priority_queue_policies:
            if own_level == level:
                return policy
        return QueuePolicy(self.default_timeout_us, self.timeout_action, self.allow_timeout_override)

    @property
    def has_queue_timeouts(self) -> bool:
        """Whether a queue timeout can act on a request before its deadline: the batcher then
        hands a batch only to a replica that runs it at once (see ``Batcher``)."""
        return self.default_timeout_us > 0 or any(p.default_timeout_us > 0 for _, p in self.priority_queue_policies)

    def __post_init__(self) -> None:
        object.__setattr__(self, "preferred_batch_sizes", tuple(sorted(set(self.preferred_batch_sizes))))
        problems = []
        if self.max_batch_size < 0:
            problems.append("max_batch_size must be >= 0")
        if any(not 0 < s <= max(self.max_batch_size, 0) for s in self.preferred_batch_sizes):
            problems.append("preferred batch sizes must be in 1..max_batch_size")
        if self.mode not in ("adaptive", "fixed", "off"):
            problems.append(f"mode must be adaptive, fixed or off, not {self.mode!r}")
        if self.timeout_action not in ("REJECT", "DELAY"):
            problems.append(f"timeout_action must be REJECT or DELAY, not {self.timeout_action!r}")
        if self.max_queue_size < 1:
            problems.append("max_queue_size must be >= 1 (the gateway keeps every queue bounded)")
        if self.max_queue_delay_us < 0 or self.default_timeout_us < 0 or self.priority_levels < 0 \
                or self.burst_hold_us < 0:
            problems.append("delays, timeouts and priority_levels must be >= 0")
        if self.priority_levels > 0 and not 1 <= self.default_priority_level <= self.priority_levels:
            problems.append("default_priority_level must be in 1..priority_levels")
        for level, policy in self.priority_queue_policies:
            if not 1 <= level <= max(self.priority_levels, 1):
                problems.append(f"priority_queue_policy level {level} is outside 1..priority_levels")
            if policy.timeout_action not in ("REJECT", "DELAY") or policy.default_timeout_us < 0 \
                    or policy.max_queue_size < 0:
                problems.append(f"priority_queue_policy level {level} is invalid")
        if problems:
            raise ValueError("invalid batch policy: " + "; ".join(problems))

    @classmethod
    def from_model_config(
        cls,
        cfg: model_config_pb2.ModelConfig,
        overrides: Mapping[str, Any] | None = None,
        *,
        default_mode: BatchingMode = "adaptive",
        backend_batches: bool = False,
        default_max_queue_size: int = DEFAULT_MAX_QUEUE_SIZE,
        default_burst_hold_us: int = 0,
    ) -> BatchPolicy:
        """Read a model's Triton config; ``overrides`` (BatchPolicy field names) win.

        A model with ``dynamic_batching`` gets ``default_mode`` and Triton's
        settings, its queue policies included (a ``max_queue_size`` of 0,
        unlimited in Triton, keeps the gateway's bound,
        ``default_max_queue_size``). A model with ``max_batch_size > 0`` but no
        ``dynamic_batching`` is still batched by the gateway, in adaptive mode:
        the worker accepts batches, and adaptive batching adds no delay at low
        load, so there is nothing to lose (set ``mode: off`` in the overrides,
        or a gateway-wide default mode of ``off``, to send requests singly). A
        model with ``sequence_batching`` is stateful and never batched here.

        ``backend_batches``: the replicas run the config's dynamic batcher
        themselves (Triton servers). The gateway then forwards promptly --
        adaptive mode, even where the default mode is ``fixed``, and no queue
        delay of its own -- so a request waits out Triton's delay once, not
        twice; what queues here while every replica is busy still goes as one
        batch, which Triton may merge further. The burst hold stays where the
        config sets no ``max_queue_delay_microseconds`` (Triton then runs what
        reaches a free instance at once) and goes where it sets one (no second
        wait). ``off`` stays off.
        """
        # A Triton server that waits out a queue delay of its own gets no hold here: one wait, not two.
        theirs_wait = backend_batches and cfg.dynamic_batching.max_queue_delay_microseconds > 0
        values: dict[str, Any] = {"max_batch_size": max(cfg.max_batch_size, 0), "max_queue_size": default_max_queue_size,
                                  "burst_hold_us": 0 if theirs_wait else default_burst_hold_us}
        if cfg.HasField("dynamic_batching"):
            db = cfg.dynamic_batching
            qp = db.default_queue_policy
            values.update(
                preferred_batch_sizes=tuple(db.preferred_batch_size),
                max_queue_delay_us=db.max_queue_delay_microseconds,
                mode=default_mode,
                priority_levels=db.priority_levels,
                default_priority_level=db.default_priority_level,
                default_timeout_us=qp.default_timeout_microseconds,
                timeout_action=model_config_pb2.ModelQueuePolicy.TimeoutAction.Name(qp.timeout_action),
                allow_timeout_override=qp.allow_timeout_override,
                preserve_ordering=db.preserve_ordering,
                priority_queue_policies=tuple(
                    (int(level), QueuePolicy.from_proto(qp)) for level, qp in sorted(db.priority_queue_policy.items())
                ),
            )
            if qp.max_queue_size > 0:
                values["max_queue_size"] = qp.max_queue_size
            if backend_batches and default_mode != "off":
                values.update(mode="adaptive", max_queue_delay_us=0)
        elif cfg.HasField("sequence_batching"):
            values["mode"] = "off"
        else:
            values["mode"] = "off" if default_mode == "off" else "adaptive"
        known = {f.name for f in fields(cls)}
        for key, value in (overrides or {}).items():
            if key not in known:
                raise ValueError(f"unknown batching setting {key!r} for model {cfg.name!r}")
            values[key] = tuple(value) if key == "preferred_batch_sizes" else value
        return cls(**values)
