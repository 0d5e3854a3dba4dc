"""Which models take the relay lane (gateway/core/relay.py:RelayLanes), from their config, their
replicas and the gateway's settings; the router's bounds learn the verdict."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from tritonclient.grpc import model_config_pb2 as mc

from gateway.batching.registry import Batchers
from gateway.caching.response_cache import ResponseCache
from gateway.composition import batch_policy_for
from gateway.core.relay import RelayLanes
from gateway.settings import BatchingSettings, GatewayConfig


class RelayingClient:
    async def relay(self, data: bytes, timeout_s: float | None = None) -> bytes:
        return data


class ReadingClient:  # the local replica's or an OpenAI server's: no relay method
    pass


def info(config: mc.ModelConfig, *kinds: str, relays: bool = True) -> Any:
    client = RelayingClient() if relays else ReadingClient()
    return SimpleNamespace(config=config, replicas=tuple(SimpleNamespace(kind=k, client=client) for k in kinds))


def config(**fields: Any) -> mc.ModelConfig:
    cfg = mc.ModelConfig(name="m", max_batch_size=fields.pop("max_batch_size", 8))
    for name in fields.pop("has", ()):
        getattr(cfg, name).SetInParent()
    return cfg


def lanes(gateway: GatewayConfig | None = None, *, cache_bytes: int = 0) -> tuple[RelayLanes, Any]:
    gateway = gateway or GatewayConfig(relay="auto")
    router = SimpleNamespace(bounds=SimpleNamespace(relayed=set()))
    parallel = SimpleNamespace(serves=lambda name: False)
    made = RelayLanes(gateway.relay_mode, router=router, batchers=Batchers(batch_policy_for(gateway)),  # type: ignore[arg-type]
                      cache=ResponseCache(cache_bytes), parallel=parallel,  # type: ignore[arg-type]
                      gateway_batching=lambda name: bool(gateway.batching_settings(name)))
    return made, router


def test_tritons_that_batch_a_model_themselves_relay_it_while_idle_as_batches_of_one() -> None:
    made, router = lanes()
    verdict = made.verdict("m", info(config(has=["dynamic_batching"]), "triton", "triton"))
    assert verdict.on and verdict.while_idle and "dynamic_batching" in verdict.why
    # Its relayed calls take execution slots as batches of one: not counted apart.
    assert router.bounds.relayed == set()


def test_models_always_on_the_lane_have_their_calls_counted_apart() -> None:
    made, router = lanes()
    for name, cfg in (("seq", config(has=["sequence_batching"])), ("flat", config(max_batch_size=0))):
        verdict = made.verdict(name, info(cfg, "triton"))
        assert verdict.on and not verdict.while_idle
    assert router.bounds.relayed == {"seq", "flat"}


def test_a_model_the_gateway_batches_is_read() -> None:
    made, router = lanes()
    # Our workers do not batch: the gateway does, so it reads the calls.
    assert not made.verdict("m", info(config(has=["dynamic_batching"]), "infergate")).on
    # A Triton config without dynamic_batching is batched by the gateway (adaptive) too.
    assert not made.verdict("m", info(config(), "triton")).on
    # One replica that is not Triton: the gateway batches for all.
    assert not made.verdict("m", info(config(has=["dynamic_batching"]), "triton", "infergate")).on
    assert router.bounds.relayed == set()


def test_a_model_not_batched_here_relays_on_any_grpc_server() -> None:
    assert lanes()[0].verdict("m", info(config(max_batch_size=0), "infergate")).on
    assert lanes()[0].verdict("m", info(config(has=["sequence_batching"]), "infergate")).on
    off = GatewayConfig(relay="auto", batching=BatchingSettings(mode="off"))
    assert lanes(off)[0].verdict("m", info(config(), "infergate")).on


def test_gateway_batching_keys_for_the_model_keep_it_read() -> None:
    gateway = GatewayConfig(relay="auto", models={"m": {"max_queue_delay_us": 500}})
    assert not lanes(gateway)[0].verdict("m", info(config(has=["dynamic_batching"]), "triton")).on


def test_a_replica_that_cannot_relay_keeps_the_model_read() -> None:
    verdict = lanes()[0].verdict("m", info(config(max_batch_size=0), "local", relays=False))
    assert not verdict.on and "cannot relay" in verdict.why


def test_features_that_read_the_model_keep_it_read() -> None:
    cached = config(has=["dynamic_batching"])
    cached.response_cache.enable = True
    assert not lanes(cache_bytes=2**20)[0].verdict("m", info(cached, "triton")).on
    assert lanes(cache_bytes=0)[0].verdict("m", info(cached, "triton")).on  # the cache is off here
    labelled = config(max_batch_size=0)
    labelled.output.add(name="OUT", label_filename="labels.txt")
    assert not lanes()[0].verdict("m", info(labelled, "triton")).on
    decoupled = config(max_batch_size=0)
    decoupled.model_transaction_policy.decoupled = True
    assert not lanes()[0].verdict("m", info(decoupled, "triton")).on
    ensemble = config(max_batch_size=0)
    ensemble.platform = "ensemble"
    assert not lanes()[0].verdict("m", info(ensemble, "triton")).on


def test_relay_is_off_by_default_and_on_for_one_model() -> None:
    cfg = config(has=["dynamic_batching"])
    assert not lanes(GatewayConfig())[0].verdict("m", info(cfg, "triton")).on
    assert lanes(GatewayConfig(models={"m": {"relay": "auto"}}))[0].verdict("m", info(cfg, "triton")).on


def test_relay_off_gateway_wide_or_for_one_model() -> None:
    cfg = config(has=["dynamic_batching"])
    assert lanes(GatewayConfig(relay="off"))[0].verdict("m", info(cfg, "triton")).why == "relay is off"
    one = GatewayConfig(relay="auto", models={"m": {"relay": "off"}})
    assert not lanes(one)[0].verdict("m", info(cfg, "triton")).on
    assert lanes(one)[0].verdict("other", info(cfg, "triton")).on


def test_the_verdict_is_decided_again_when_the_models_view_changes() -> None:
    made, router = lanes()
    cfg = config(has=["dynamic_batching"])
    assert made.verdict("m", info(cfg, "triton")).on
    # A new view of the model (a worker that cannot relay joined): decided again, the bounds follow.
    assert not made.verdict("m", info(cfg, "triton", relays=False)).on
    assert router.bounds.relayed == set()
