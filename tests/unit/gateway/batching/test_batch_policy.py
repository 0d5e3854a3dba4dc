"""gateway.batching.policy.BatchPolicy: reading Triton's model config, gateway overrides, validation."""

from __future__ import annotations

import pytest
from tritonclient.grpc import model_config_pb2

from gateway.batching.policy import DEFAULT_MAX_QUEUE_SIZE, BatchPolicy


def _config(max_batch_size: int = 8, **dynamic: object) -> model_config_pb2.ModelConfig:
    cfg = model_config_pb2.ModelConfig(name="m", max_batch_size=max_batch_size)
    if dynamic:
        cfg.dynamic_batching.CopyFrom(model_config_pb2.ModelDynamicBatching(**dynamic))
    return cfg


def test_reads_every_dynamic_batching_setting() -> None:
    cfg = _config(
        8,
        preferred_batch_size=[4, 2],
        max_queue_delay_microseconds=500,
        priority_levels=3,
        default_priority_level=2,
        preserve_ordering=True,
        default_queue_policy=model_config_pb2.ModelQueuePolicy(
            timeout_action=model_config_pb2.ModelQueuePolicy.DELAY,
            default_timeout_microseconds=1000,
            allow_timeout_override=True,
            max_queue_size=16,
        ),
    )
    policy = BatchPolicy.from_model_config(cfg, default_mode="fixed")
    assert policy == BatchPolicy(
        max_batch_size=8,
        preferred_batch_sizes=(2, 4),
        max_queue_delay_us=500,
        mode="fixed",
        max_queue_size=16,
        priority_levels=3,
        default_priority_level=2,
        default_timeout_us=1000,
        timeout_action="DELAY",
        allow_timeout_override=True,
        preserve_ordering=True,
    )


def test_empty_dynamic_batching_keeps_triton_defaults_and_the_gateway_bound() -> None:
    cfg = model_config_pb2.ModelConfig(name="m", max_batch_size=4)
    cfg.dynamic_batching.SetInParent()
    policy = BatchPolicy.from_model_config(cfg)
    assert policy.mode == "adaptive"
    assert policy.max_queue_size == DEFAULT_MAX_QUEUE_SIZE  # Triton's 0 = unlimited is not taken
    assert policy.timeout_action == "REJECT"
    assert policy.allow_timeout_override is False  # the proto's default, as in Triton
    assert policy.preferred_batch_sizes == ()


@pytest.mark.parametrize(
    ("default_mode", "expected"), [("adaptive", "adaptive"), ("fixed", "adaptive"), ("off", "off")]
)
def test_batchable_model_without_dynamic_batching_is_batched_adaptively(default_mode: str, expected: str) -> None:
    policy = BatchPolicy.from_model_config(_config(4), default_mode=default_mode)  # type: ignore[arg-type]
    assert policy.max_batch_size == 4
    assert policy.mode == expected


def test_sequence_model_is_never_batched() -> None:
    cfg = _config(4)
    cfg.sequence_batching.SetInParent()
    assert BatchPolicy.from_model_config(cfg).mode == "off"


def test_non_batching_model() -> None:
    policy = BatchPolicy.from_model_config(_config(0))
    assert policy.max_batch_size == 0


def test_overrides_win() -> None:
    cfg = _config(8, max_queue_delay_microseconds=100, preferred_batch_size=[8])
    policy = BatchPolicy.from_model_config(
        cfg, {"mode": "fixed", "max_queue_delay_us": 2000, "preferred_batch_sizes": [2, 4], "max_queue_size": 7}
    )
    assert (policy.mode, policy.max_queue_delay_us, policy.preferred_batch_sizes, policy.max_queue_size) == (
        "fixed",
        2000,
        (2, 4),
        7,
    )


def test_unknown_override_is_an_error() -> None:
    with pytest.raises(ValueError, match="max_delay"):
        BatchPolicy.from_model_config(_config(8), {"max_delay": 5})


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_batch_size": -1},
        {"max_batch_size": 4, "preferred_batch_sizes": (8,)},
        {"max_batch_size": 0, "preferred_batch_sizes": (1,)},
        {"max_batch_size": 4, "mode": "eager"},
        {"max_batch_size": 4, "timeout_action": "DROP"},
        {"max_batch_size": 4, "max_queue_size": 0},
        {"max_batch_size": 4, "priority_levels": 2, "default_priority_level": 0},
        {"max_batch_size": 4, "priority_levels": 2, "default_priority_level": 3},
        {"max_batch_size": 4, "max_queue_delay_us": -1},
    ],
)
def test_invalid_policies_are_rejected(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="invalid batch policy"):
        BatchPolicy(**kwargs)  # type: ignore[arg-type]
