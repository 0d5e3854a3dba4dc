"""The response cache on its own: what makes two requests the same, LRU order,
the byte bound, and Triton's hit/miss counters in the statistics shape."""

from __future__ import annotations

import itertools

from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2

from gateway.caching.response_cache import Lookup, ResponseCache, cache_enabled, fill_statistics, request_key
from gateway.types import InferRequest, InferResponse, RequestedOutput, Tensor


def _request(data: bytes = b"\x01\x00\x00\x00", *, rid: str = "a", outputs=(), **parameters) -> InferRequest:
    return InferRequest(model="m", version="1", id=rid, inputs=[Tensor("X", "INT32", (1, 1), data)],
                        outputs=list(outputs), parameters=dict(parameters))


def _response(payload: bytes, rid: str = "a") -> InferResponse:
    return InferResponse(model="m", version="1", id=rid, outputs=[Tensor("Y", "FP32", (1, len(payload) // 4), payload)])


def _fake_clock():
    ticks = itertools.count(0, 1000)
    return lambda: next(ticks)


def test_a_repeated_request_hits_and_gets_its_own_id() -> None:
    cache = ResponseCache(1 << 20, clock=_fake_clock())
    miss = cache.lookup(_request(rid="first"))
    assert isinstance(miss, Lookup)
    cache.insert(miss, _response(b"\x00" * 8, rid="first"))
    hit = cache.lookup(_request(rid="second"))
    assert isinstance(hit, InferResponse)
    assert hit.id == "second" and bytes(hit.outputs[0].data) == b"\x00" * 8
    c = cache.counters()[("m", "1")]
    assert (c.hits, c.misses) == (1, 1)
    assert c.hit_ns > 0 and c.miss_ns > 0


def test_what_changes_the_answer_changes_the_key() -> None:
    base = request_key(_request())
    assert request_key(_request(rid="other", timeout=5000, priority=1, binary_data_output=True)) == base
    assert request_key(_request(b"\x02\x00\x00\x00")) != base
    assert request_key(_request(outputs=[RequestedOutput("Y")])) != base
    classified = request_key(_request(outputs=[RequestedOutput("Y", parameters={"classification": 3})]))
    assert classified != request_key(_request(outputs=[RequestedOutput("Y")]))
    # The HTTP binary flag only encodes the output: same key.
    assert request_key(_request(outputs=[RequestedOutput("Y", binary_data=True)])) == request_key(
        _request(outputs=[RequestedOutput("Y")]))
    assert request_key(_request(custom="x")) != base
    other_version = _request()
    other_version.version = "2"
    assert request_key(other_version) != base


def test_memory_stays_within_the_bound_and_the_least_recently_used_goes_first() -> None:
    cache = ResponseCache(3000)
    for i in range(3):
        miss = cache.lookup(_request(bytes([i, 0, 0, 0])))
        cache.insert(miss, _response(b"\x00" * 400))
    assert len(cache) == 3
    assert isinstance(cache.lookup(_request(bytes([0, 0, 0, 0]))), InferResponse)  # 0 is now the most recent
    miss = cache.lookup(_request(bytes([3, 0, 0, 0])))
    cache.insert(miss, _response(b"\x00" * 400))
    assert cache.used_bytes <= 3000 and cache.evictions >= 1
    assert isinstance(cache.lookup(_request(bytes([1, 0, 0, 0]))), Lookup)  # the LRU entry went
    assert isinstance(cache.lookup(_request(bytes([0, 0, 0, 0]))), InferResponse)


def test_an_entry_larger_than_the_cache_is_not_kept() -> None:
    cache = ResponseCache(1000)
    cache.insert(cache.lookup(_request()), _response(b"\x00" * 4000))
    assert len(cache) == 0 and cache.used_bytes == 0
    assert cache.counters()[("m", "1")].misses == 1


def test_entries_copy_output_bytes_out_of_the_batch_buffer() -> None:
    batch = bytearray(b"\x01" * 64)
    cache = ResponseCache(1 << 20)
    cache.insert(cache.lookup(_request()), _response(memoryview(batch)[:8]))  # type: ignore[arg-type]
    batch[:8] = b"\x00" * 8
    hit = cache.lookup(_request())
    assert isinstance(hit, InferResponse) and bytes(hit.outputs[0].data) == b"\x01" * 8


def test_clear_forgets_one_model() -> None:
    cache = ResponseCache(1 << 20)
    cache.insert(cache.lookup(_request()), _response(b"\x00" * 8))
    other = _request()
    other.model = "n"
    cache.insert(cache.lookup(other), _response(b"\x00" * 8))
    cache.clear("m")
    assert isinstance(cache.lookup(_request()), Lookup)
    assert isinstance(cache.lookup(other), InferResponse)


def test_enabled_by_config_and_size() -> None:
    config = mc.ModelConfig(name="m")
    assert not cache_enabled(config)
    config.response_cache.enable = True
    assert cache_enabled(config)
    assert not ResponseCache(0).enabled and ResponseCache(1).enabled


def test_statistics_carry_cache_hit_and_miss() -> None:
    cache = ResponseCache(1 << 20, clock=_fake_clock())
    cache.insert(cache.lookup(_request()), _response(b"\x00" * 8))
    cache.lookup(_request())
    stats = service_pb2.ModelStatisticsResponse()
    stats.model_stats.add(name="m", version="1")
    stats.model_stats.add(name="other", version="1")
    fill_statistics(stats, cache.counters())
    st = stats.model_stats[0].inference_stats
    assert (st.cache_hit.count, st.cache_miss.count) == (1, 1)
    assert st.cache_hit.ns > 0 and st.cache_miss.ns > 0
    assert stats.model_stats[1].inference_stats.cache_hit.count == 0


def test_cache_size_config_key() -> None:
    import pytest

    from gateway.config import ConfigError, load_config

    assert load_config().cache.size_bytes == 0
    assert load_config(cache={"size_bytes": "1048576"}).cache.size_bytes == 1 << 20
    with pytest.raises(ConfigError, match="cache.size_bytes"):
        load_config(cache={"size_bytes": -1})
