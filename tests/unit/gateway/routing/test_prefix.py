"""Tests for gateway/routing/prefix.py: a generative stream goes to the worker
that served its prompt's prefix while it has a free generation slot, else to
the one with the most free slots; other calls keep the wrapped policy; the
prefix key comes from the request's prompt; the routes are a bounded LRU."""

from __future__ import annotations

import random
import struct
from collections.abc import Sequence, Set

from tritonclient.grpc import model_config_pb2, service_pb2

from gateway.fleet.cluster import WorkerState
from gateway.fleet.view import WorkerModel
from gateway.routing.capacity import InflightBounds
from gateway.routing.choice import LeastLoaded
from gateway.routing.outlier import OutlierDetector
from gateway.routing.prefix import _CURRENT, Balance, PrefixAffinity, generation_slots, prompt_key

SLACK = Balance().abs_threshold  # the default: loads this far apart are balanced
from gateway.settings import OutlierSettings, WorkerSpec

MODEL = "lm"


def worker(address: str, *, backend: str = "generate", max_sequences: int | None = 4) -> WorkerState:
    w = WorkerState(WorkerSpec(address), client=None)  # type: ignore[arg-type]
    config = model_config_pb2.ModelConfig(name=MODEL, backend=backend)
    if max_sequences is not None:
        config.parameters["max_sequences"].string_value = str(max_sequences)
    w.models = {MODEL: WorkerModel(MODEL, ("1",), config, service_pb2.ModelMetadataResponse(name=MODEL))}
    return w


class StreamsHeld(InflightBounds):
    """Bounds whose streams held on a worker are the test's ``worker.inflight`` (what the router's
    per-model stream count would be, with only this model's streams open)."""

    def held(self, worker: WorkerState, model: str) -> int:
        return worker.inflight


def bounds() -> InflightBounds:
    return StreamsHeld(OutlierDetector(OutlierSettings()))


def pb(prompt: bytes, *, raw: bool = True) -> service_pb2.ModelInferRequest:
    req = service_pb2.ModelInferRequest(model_name=MODEL)
    t = req.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    if raw:
        req.raw_input_contents.append(struct.pack("<I", len(prompt)) + prompt)
    else:
        t.contents.bytes_contents.append(prompt)
    return req


def choose(chooser: PrefixAffinity, prompt: bytes, candidates: Sequence[WorkerState],
           avoid: Set[WorkerState] = frozenset(), model: str = MODEL) -> WorkerState | None:
    key = prompt_key(pb(prompt))
    assert key is not None
    token = _CURRENT.set((model, key))
    try:
        return chooser.choose(model, "", candidates, avoid, bounds())
    finally:
        _CURRENT.reset(token)


class First:
    """Picks the first candidate; records the candidates of each call."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def choose(self, model: str, version: str, candidates: Sequence[WorkerState], avoid: Set[WorkerState],
               bounds: InflightBounds) -> WorkerState | None:
        self.calls.append([w.address for w in candidates])
        return candidates[0]


def test_the_prompt_key_hashes_the_first_bytes_of_the_prompt_raw_or_typed() -> None:
    long_a = b"You are a helpful assistant. " * 4 + b"What is 2+2?"
    long_b = b"You are a helpful assistant. " * 4 + b"Name a colour."
    assert prompt_key(pb(long_a)) == prompt_key(pb(long_b)) == prompt_key(pb(long_a, raw=False))
    assert prompt_key(pb(b"short one")) != prompt_key(pb(b"short two"))
    assert prompt_key(pb(long_a), prefix_bytes=200) != prompt_key(pb(long_b), prefix_bytes=200)
    assert prompt_key(service_pb2.ModelInferRequest(model_name="simple")) is None
    by_parameter = service_pb2.ModelInferRequest(model_name=MODEL)
    by_parameter.parameters["text_input"].string_param = "hello"
    assert prompt_key(by_parameter) == prompt_key(pb(b"hello"))


def test_generation_slots_come_from_the_model_config() -> None:
    assert generation_slots(worker("a:1", max_sequences=8), MODEL) == 8
    assert generation_slots(worker("a:1", max_sequences=None), MODEL) == 32  # the worker's default
    assert generation_slots(worker("a:1", backend="onnxruntime"), MODEL) is None
    assert generation_slots(worker("a:1"), "other") is None


def test_a_shared_prefix_goes_back_to_the_worker_that_served_it() -> None:
    a, b = worker("a:1", max_sequences=16), worker("b:1", max_sequences=16)
    chooser = PrefixAffinity(First())
    first = choose(chooser, b"system prompt: tell me a story", [b, a])
    assert first is b
    for _ in range(SLACK):  # still b while the load stays balanced, even when a is idler
        b.inflight += 1
        assert choose(chooser, b"system prompt: tell me a story", [a, b]) is b
    assert chooser.hits == SLACK and chooser.misses == 1
    b.inflight += 1  # b far busier than a: this one goes to a, and the route stays on b
    assert choose(chooser, b"system prompt: tell me a story", [a, b]) is a
    assert chooser.diverted == 1
    b.inflight -= 1
    assert choose(chooser, b"system prompt: tell me a story", [a, b]) is b


def test_a_new_prefix_goes_to_the_worker_with_the_most_free_slots() -> None:
    a, b = worker("a:1", max_sequences=4), worker("b:1", max_sequences=8)
    a.inflight, b.inflight = 1, 2  # a has 3 free, b 6
    chooser = PrefixAffinity(First())
    assert choose(chooser, b"one", [a, b]) is b
    b.inflight = 6  # now a has more free
    assert choose(chooser, b"two", [a, b]) is a


def test_equals_are_left_to_the_wrapped_policy() -> None:
    a, b = worker("a:1"), worker("b:1")
    inner = First()
    chooser = PrefixAffinity(inner)
    assert choose(chooser, b"x", [b, a]) is b
    assert inner.calls == [["b:1", "a:1"]]


def test_a_full_gone_or_tried_worker_loses_its_prefix() -> None:
    a, b = worker("a:1", max_sequences=2), worker("b:1", max_sequences=2)
    chooser = PrefixAffinity(First())
    assert choose(chooser, b"p", [a, b]) is a
    a.inflight = 2  # full: the least loaded takes it, and the prefix moves there
    assert choose(chooser, b"p", [a, b]) is b
    a.inflight = 0
    assert choose(chooser, b"p", [a, b]) is b
    assert choose(chooser, b"p", [a]) is a  # b gone: a takes it
    assert choose(chooser, b"p", [a, b], avoid={a}) is b  # a failed this call
    assert choose(chooser, b"p", [a, b]) is b


def test_distinct_prefixes_spread_over_the_workers() -> None:
    a, b = worker("a:1"), worker("b:1")
    chooser = PrefixAffinity(LeastLoaded(random.Random(1)))
    for i in range(4):  # each stream stays open: the next new prefix goes to the freer worker
        chosen = choose(chooser, f"prompt number {i}".encode(), [a, b])
        assert chosen is not None
        chosen.inflight += 1
    assert a.inflight == b.inflight == 2


def test_other_calls_and_other_models_keep_the_wrapped_policy() -> None:
    a, b = worker("a:1"), worker("b:1")
    inner = First()
    chooser = PrefixAffinity(inner)
    b.inflight = 3
    assert chooser.choose(MODEL, "", [b, a], set(), bounds()) is b  # no key: not a prefix-routed call
    assert choose(chooser, b"p", [b, a], model="another") is b  # the key is for another model
    onnx = worker("c:1", backend="onnxruntime")
    assert choose(chooser, b"p", [onnx, a]) is onnx  # not a generative model there
    assert len(inner.calls) == 3 and chooser.remembered == 0


def test_the_routes_are_a_bounded_lru() -> None:
    a, b = worker("a:1", max_sequences=100), worker("b:1", max_sequences=100)
    chooser = PrefixAffinity(First(), routes=2)
    choose(chooser, b"one", [a, b])
    choose(chooser, b"two", [b, a])
    assert choose(chooser, b"one", [b, a]) is a  # touched: "two" is now the oldest
    choose(chooser, b"three", [b, a])
    assert chooser.remembered == 2
    assert choose(chooser, b"two", [a, b]) is a  # forgotten: a new prefix, the first equal
    assert choose(chooser, b"three", [a, b]) is b  # the newest stays


def test_other_models_calls_do_not_use_up_a_generative_models_streams() -> None:
    a, b = worker("a:1", max_sequences=2), worker("b:1", max_sequences=2)
    a.inflight = 5  # batches of other models on a; none of this model's streams
    real = InflightBounds(OutlierDetector(OutlierSettings()))
    real.stream_started(b, MODEL)
    chooser = PrefixAffinity(First())
    token = _CURRENT.set((MODEL, prompt_key(pb(b"fresh prompt"))))
    try:
        assert chooser.choose(MODEL, "", [b, a], set(), real) is a  # a: 2 free; b: 1
    finally:
        _CURRENT.reset(token)


def test_under_balanced_load_new_prefixes_go_to_the_worker_with_fewest() -> None:
    a, b = worker("a:1", max_sequences=16), worker("b:1", max_sequences=16)
    a.inflight = 1  # b is a little idler, within the slack: the prefixes' count decides
    chooser = PrefixAffinity(First())
    assert choose(chooser, b"opening zero", [a, b]) is b
    assert choose(chooser, b"opening one", [a, b]) is a  # the old rule (most free) would say b again
    assert choose(chooser, b"opening two", [a, b]) is b  # one each: the freer
    assert choose(chooser, b"opening one", [a, b]) is a  # and each keeps its own
    a.inflight, b.inflight = 6, 4  # loads SLACK apart: still balanced
    assert choose(chooser, b"opening three", [a, b]) is a
    a.inflight = 4 + SLACK + 1  # no longer: the freer takes it, however many prefixes it has
    assert choose(chooser, b"opening four", [a, b]) is b


def test_the_balance_thresholds_are_the_gateways_to_set() -> None:
    a, b = worker("a:1", max_sequences=64), worker("b:1", max_sequences=64)
    # SGLang's defaults: a route holds until its worker has 64 more streams than the least busy...
    patient = PrefixAffinity(First(), balance=Balance(64, 1.5))
    assert choose(patient, b"the opening", [b, a]) is b
    b.inflight = 40
    assert choose(patient, b"the opening", [a, b]) is b and patient.diverted == 0
    # ...and more than 1.5 times as many: 3 against 2 is balanced by the ratio, whatever the gap allows.
    strict = PrefixAffinity(First(), balance=Balance(0, 1.5))
    a.inflight, b.inflight = 2, 0
    assert choose(strict, b"the opening", [a, b]) is b  # new: the idler (b) takes it
    a.inflight, b.inflight = 2, 3
    assert choose(strict, b"the opening", [a, b]) is b and strict.diverted == 0
    b.inflight = 4  # 4 against 2: over both
    assert choose(strict, b"the opening", [a, b]) is a and strict.diverted == 1
