"""Prefix-aware replica choice for generative models: a prompt goes where its prefix went.

A generative model (its config says ``backend: "generate"``, or it is a
model of an OpenAI-protocol server, ``backend: "openai"``) keeps each
running sequence's cache on one worker; a prompt that shares its opening
with one served before is best sent to the same worker (its prefix may still
be cached there), and a new prompt to the worker with the most free
generation capacity. :class:`PrefixAffinity` is that policy, a
:class:`~gateway.routing.choice.ReplicaChooser` wrapping another one (the
default least loaded) for every other call:

- the key is a hash of the prompt's first ``prefix_bytes`` bytes (the
  ``text_input`` input of a streamed request, or a chat's ``messages``
  JSON, whose opening is its system prompt: :func:`prompt_key`), handed to
  the policy by :class:`PrefixStreamRouting` for the one call it routes
  (a context variable: the policy's signature carries no request);
- a bounded LRU maps (model, key) to the worker address that served it;
  that worker takes the prompt while it has a free generation slot and the
  load is balanced (below); while it is far busier than another candidate,
  the prompt goes to the least busy one and the route stays (SGLang's router
  turns to the shortest queue while its workers are imbalanced);
- otherwise (a new prefix, its worker full, gone or already tried by this
  call) the candidate with the most free slots takes it, and the LRU
  remembers it. While the load is balanced (:class:`Balance`: the
  candidates' loads, streams held and the server's queue, at most its
  ``abs_threshold`` apart or the most at most ``rel_threshold`` times the
  least), the one with
  the fewest prefixes routed to it takes it instead (SGLang's cache-aware
  router gives a new prefix to the worker with the smallest cache tree), so
  the prefixes, and the caches they fill, are split evenly rather than by
  the load of the moment; the wrapped policy chooses among equals.

Free generation slots: the model's ``max_sequences`` config parameter (the
worker's own bound, default :data:`DEFAULT_MAX_SEQUENCES` as the worker's)
less the calls this gateway has in flight on that worker, and less the
requests waiting in the server's own queue where it reports them (an
OpenAI-protocol server's metrics): the load that bounds affinity. Its own
workers the gateway does not ask: its count is exact for one gateway, and a worker
that is full after all refuses with a retryable error, which sends the
stream elsewhere before its first response.
"""

from __future__ import annotations

import contextvars
import hashlib
import logging
import struct
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Sequence, Set
from contextlib import aclosing
from dataclasses import dataclass

from tritonclient.grpc import service_pb2

from gateway.fleet.cluster import WorkerState
from gateway.replicas.openai_contract import BACKEND as OPENAI_BACKEND
from gateway.routing.capacity import InflightBounds
from gateway.routing.choice import ReplicaChooser
from gateway.routing.router import Router
from gateway.routing.streams import StreamRouting

log = logging.getLogger(__name__)

GENERATE_BACKEND = "generate"
PROMPT_INPUT = "text_input"
MESSAGES_INPUT = "messages"  # a chat: its messages' JSON opens with the system prompt
DEFAULT_PREFIX_BYTES = 64
DEFAULT_ROUTES = 4096  # prefixes remembered (LRU)
DEFAULT_MAX_SEQUENCES = 32  # the worker's default for a model without the parameter

# (model, prefix key) of the streamed call being routed now; None outside one.
_CURRENT: contextvars.ContextVar[tuple[str, bytes] | None] = contextvars.ContextVar("prefix_key", default=None)


def prompt_key(request: service_pb2.ModelInferRequest, prefix_bytes: int = DEFAULT_PREFIX_BYTES) -> bytes | None:
    """A hash of the first ``prefix_bytes`` bytes of the request's prompt, or None without one."""
    prompt = _prompt(request)
    if prompt is None:
        return None
    return hashlib.blake2b(prompt[:prefix_bytes], digest_size=16).digest()


def _prompt(request: service_pb2.ModelInferRequest, name: str = PROMPT_INPUT) -> bytes | None:
    """The prompt's bytes (``text_input``), else a chat's messages as sent (the JSON of ``messages``)."""
    for i, tensor in enumerate(request.inputs):
        if tensor.name != name:
            continue
        if request.raw_input_contents:
            if i >= len(request.raw_input_contents):
                return None
            raw = request.raw_input_contents[i]
            if len(raw) < 4:
                return None
            (n,) = struct.unpack_from("<I", raw)  # the first element: 4-byte length, then its bytes
            return raw[4:4 + n]
        values = tensor.contents.bytes_contents
        return bytes(values[0]) if values else None
    param = request.parameters.get(PROMPT_INPUT)
    if param is not None and param.WhichOneof("parameter_choice") == "string_param":
        return param.string_param.encode()
    return None if name == MESSAGES_INPUT else _prompt(request, MESSAGES_INPUT)


@dataclass(frozen=True, slots=True)
class Balance:
    """When the candidates' loads (streams held + the server's queue) count as balanced, as SGLang's and
    vllm-router's cache-aware policy tell it: at most ``abs_threshold`` apart, or the most at most
    ``rel_threshold`` times the least (their defaults are 64 and 1.5; 4 here, for workers whose steps
    slow with each stream they add, as CPU ones do). Imbalanced, a prompt leaves its route's worker."""

    abs_threshold: int = 4
    rel_threshold: float = 1.5

    def balanced(self, loads: Sequence[int]) -> bool:
        most, least = max(loads), min(loads)
        return most - least <= self.abs_threshold or most <= self.rel_threshold * least


def generation_slots(worker: WorkerState, model: str) -> int | None:
    """The sequences ``worker`` admits at once for ``model``, or None when it is no generative model there."""
    served = worker.models.get(model)
    if served is None or served.config.backend not in (GENERATE_BACKEND, OPENAI_BACKEND):
        return None
    stated = served.config.parameters.get("max_sequences")
    if stated is not None and stated.string_value.strip().isdigit() and int(stated.string_value) > 0:
        return int(stated.string_value)
    return DEFAULT_MAX_SEQUENCES


class PrefixAffinity:
    """Generative streams to the worker that served their prompt's prefix, else the one with most free slots."""

    def __init__(self, inner: ReplicaChooser, *, routes: int = DEFAULT_ROUTES, balance: Balance = Balance()) -> None:
        if routes < 1:
            raise ValueError("routes must be >= 1")
        self.inner = inner  # the rule for every other call, and among equals
        self.balance = balance
        self._routes: OrderedDict[tuple[str, bytes], str] = OrderedDict()
        self._routed: Counter[tuple[str, str]] = Counter()  # (model, address) -> prefixes routed there
        self._capacity = routes
        self.hits = 0  # prompts sent where their prefix went before
        self.misses = 0  # new prefixes, or their worker full or gone
        self.diverted = 0  # sent elsewhere while their worker was far busier (the route kept)

    @property
    def remembered(self) -> int:
        """Prefixes with a route now."""
        return len(self._routes)

    def choose(
        self, model: str, version: str, candidates: Sequence[WorkerState], avoid: Set[WorkerState],
        bounds: InflightBounds,
    ) -> WorkerState | None:
        current = _CURRENT.get()
        if current is None or current[0] != model:
            return self.inner.choose(model, version, candidates, avoid, bounds)
        free = {w: _free(w, model, bounds) for w in candidates}
        if any(n is None for n in free.values()):  # not a generative model (on some replica): the usual rule
            return self.inner.choose(model, version, candidates, avoid, bounds)
        address = self._routes.get(current)
        if address is not None:
            for w in candidates:
                if w.address == address and w not in avoid and (free[w] or 0) > 0:
                    mine = _load(w, model, bounds)
                    least = min(_load(o, model, bounds) for o in candidates if o not in avoid and (free[o] or 0) > 0)
                    if not self.balance.balanced([mine, least]):  # the route's worker far busier than the least busy
                        # Its worker is far busier than another: this prompt goes to the least busy (a cache
                        # miss there) and the route stays, as SGLang's router turns to the shortest queue.
                        self.diverted += 1
                        pool = [o for o in candidates if o not in avoid and (free[o] or 0) > 0]
                        return min(pool, key=lambda o: _load(o, model, bounds))
                    self._routes.move_to_end(current)
                    self.hits += 1
                    return w
        self.misses += 1
        pool = [w for w in candidates if w not in avoid] or candidates  # tried ones only when none else is left
        most = max(free[w] or 0 for w in pool)
        if most > 0 and self.balance.balanced([_load(w, model, bounds) for w in pool]):
            open_ = [w for w in pool if (free[w] or 0) > 0]
            fewest = min(self._routed[(model, w.address)] for w in open_)
            pool = [w for w in open_ if self._routed[(model, w.address)] == fewest]
            most = max(free[w] or 0 for w in pool)
        best = [w for w in pool if free[w] == most]
        chosen = best[0] if len(best) == 1 else self.inner.choose(model, version, best, avoid, bounds)
        if chosen is not None:
            self._remember(current, chosen.address)
        return chosen

    def _remember(self, key: tuple[str, bytes], address: str) -> None:
        before = self._routes.get(key)
        if before is not None:
            self._forget(key[0], before)
        self._routes[key] = address
        self._routed[(key[0], address)] += 1
        self._routes.move_to_end(key)
        while len(self._routes) > self._capacity:
            (model, _), gone = self._routes.popitem(last=False)
            self._forget(model, gone)

    def _forget(self, model: str, address: str) -> None:
        self._routed[(model, address)] -= 1
        if self._routed[(model, address)] <= 0:
            del self._routed[(model, address)]


def _load(worker: WorkerState, model: str, bounds: InflightBounds) -> int:
    """Streams of ``model`` on ``worker``: those it holds of this gateway and those its server queues."""
    waiting = int(worker.server_load.waiting) if worker.server_load is not None else 0
    return bounds.held(worker, model) + waiting


def _free(worker: WorkerState, model: str, bounds: InflightBounds) -> int | None:
    """Streams ``worker`` may still start for ``model``: its ``max_sequences`` less the streams of
    that model it holds (``InflightBounds.held``), not other models' calls, and less the requests
    queued on the server where it reports them (``WorkerState.server_load``); None when not generative."""
    slots = generation_slots(worker, model)
    if slots is None:
        return None
    waiting = int(worker.server_load.waiting) if worker.server_load is not None else 0
    return max(0, slots - bounds.held(worker, model) - waiting)


class PrefixStreamRouting(StreamRouting):
    """Stream routing that hands the prompt's prefix key to the replica choice (:class:`PrefixAffinity`)."""

    def __init__(self, router: Router, prefix_bytes: int = DEFAULT_PREFIX_BYTES,
                 in_process: InProcessStreams | None = None) -> None:
        super().__init__(router, in_process)
        self._prefix_bytes = prefix_bytes

    async def stream(
        self, model: str, version: str, request: service_pb2.ModelInferRequest, deadline: float | None,
    ) -> AsyncIterator[tuple[service_pb2.ModelInferResponse, float]]:
        key = prompt_key(request, self._prefix_bytes)
        # The replica is chosen before the first response (and again on a retry before
        # it); the key stays set until then, and is cleared for the rest of the stream.
        _CURRENT.set((model, key) if key is not None else None)
        try:
            async with aclosing(super().stream(model, version, request, deadline)) as responses:
                async for item in responses:
                    _CURRENT.set(None)
                    yield item
        finally:
            _CURRENT.set(None)
