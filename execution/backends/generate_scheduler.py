"""Continuous batching for one generation instance: which sequences run in
each decoder step, and what each step's tokens mean for them.

A request becomes a :class:`GenSequence` when :meth:`Scheduler.admit` takes
it (or refuses it: the instance is at capacity). Its path: waiting -> one
prefill step (its whole prompt; joiners of the same iteration are prefilled
together, padded) -> running, one token per decode step shared by every
running sequence -> finished (EOS: "stop"; a stop string: "stop"; its
``max_tokens`` or the context: "length") or dropped (the client went away,
seen at the next step). Sequences join and leave between steps only.

Seams: :class:`StepFunction` runs one padded step over rows and returns each
row's last logits and new cache (ONNX Runtime in ``generate``; a fake in the
tests); ``offload`` runs it off the event loop (an executor; a direct call in
the tests, so no real time passes). Everything else runs on the event loop
thread, emit callbacks included.

Each sequence keeps its own cache between steps, an opaque value from the
step function (the ONNX step's is its row of the last step's arrays, fed
back as they are while the same rows keep decoding together); the step pads
the rows' caches to the longest one with the attention mask. A sequence
joins or leaves without the others' caches changing, and a row's numbers do
not depend on its neighbours, so a greedy sequence decodes the same tokens
batched or alone.

Sampling (``choose_token``): temperature 0 is greedy; otherwise softmax at
the temperature, cut to the ``top_k`` most likely and then to the ``top_p``
nucleus (transformers' order), drawn with the sequence's own ``numpy``
Generator seeded from the request, so a seeded request gives the same tokens
alone or batched. With ``logprobs`` (0 or more) each token goes out with its
log probability and the ``logprobs`` most likely ones, from the model's
logits before any sampling setting.

A sequence's text comes from its :class:`TokenText`: the bytes each token
adds (a byte vocabulary's one byte; a tokenizer's incremental decode, which
may hold a partial character) and, at the end, what it still held. Each
response names the tokens whose text it completes (``TokenOut.token_ids``):
a token whose text is held (part of a character, or maybe the start of a
stop string) is named with the response that sends it, so the ids a client
has received are exactly those of the text it has.

With a prefix cache (``execution.backends.prefix_cache``; the step is then
a :class:`CachingStep`), a joiner's prefill starts after the cached blocks its
prompt opens with (the row's past is their entries), and after it ran the
sequence holds its prompt's full blocks: its cache is where their entries
are while it runs (a prompt opening with them reads them out of it), and
they are copied out into the prefix cache's own when the last sequence
holding them ends. The cache's own copies share ``max_cache_bytes`` with
the sequences' reservations: admitting a sequence evicts unused blocks
before refusing it.

A generation continues where another left off (its worker was lost) when it
is admitted with ``resume``: the ids already sent. They are prefilled after
the prompt, count toward ``max_tokens`` and ``completion_tokens``, and go
through the sequence's :class:`TokenText` first without being sent (its
state, a partial character included, is then the uninterrupted run's), so
the next responses are the ones the uninterrupted run would have sent; stop
strings are searched across the boundary. A seeded sequence's generator
skips the draws the resumed tokens took (one each, at a temperature above
0).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import numpy as np

from execution.backends.prefix_cache import NO_MATCH, PrefixCache, PrefixMatch, PrefixStats
from protos.errors import InferGateError, Internal, InvalidArgument, Overloaded, Unavailable

logger = logging.getLogger(__name__)

T = TypeVar("T")
Offload = Callable[[Callable[[], T]], Awaitable[T]]


@dataclass(frozen=True, slots=True)
class SchedulerLimits:
    max_sequences: int  # admitted at once (running + waiting); one more is refused
    max_cache_bytes: int  # KV cache the admitted sequences may reserve
    cache_bytes_per_token: int  # what one position of one sequence's cache takes
    max_positions: int  # the model's context: prompt + completion
    max_batch_sequences: int = 0  # sequences in one step; 0 = max_sequences (1 = one at a time)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[bytes, ...] = ()
    ignore_eos: bool = False  # generate max_tokens whatever the model says (benchmarks, capacity tests)
    top_k: int = 0  # 0: no cut
    logprobs: int = -1  # -1: none; else each token's log probability and this many most likely ones


class TokenText(Protocol):
    """One sequence's tokens -> the bytes of its text."""

    def feed(self, token: int) -> bytes:
        """The bytes ``token`` adds (b"" while a character is incomplete)."""
        ...

    def flush(self) -> bytes:
        """At the end: the bytes still held."""
        ...


@dataclass(frozen=True, slots=True)
class _BytesOf:
    """A stateless vocabulary (``token -> bytes``) as a :class:`TokenText`."""

    of: Callable[[int], bytes]

    def feed(self, token: int) -> bytes:
        return self.of(token)

    def flush(self) -> bytes:
        return b""


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """A chosen token's log probability and the most likely tokens' (best first)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True, slots=True)
class StepRow:
    """One sequence's part of a step: its new tokens after ``position`` cached ones."""

    tokens: Sequence[int]
    position: int
    cache: object | None


class StepFunction(Protocol):
    def __call__(self, rows: Sequence[StepRow]) -> list[tuple[np.ndarray, object]]:
        """Each row's logits after its last new token ([V]) and its cache grown by its new tokens.
        A row's ``cache`` is the cache a step returned for it, None (no past), or a
        :class:`~execution.backends.prefix_cache.PrefixMatch` (its past: the entries of cached blocks)."""
        ...


class CachingStep(StepFunction, Protocol):
    """A step whose caches a prefix cache can keep blocks of."""

    def extract(self, cache: object, start: int, stop: int) -> object:
        """A copy of positions ``start``..``stop`` of a row's cache (one block's entries)."""
        ...


@dataclass(frozen=True, slots=True)
class TokenOut:
    """What a sequence tells its client: new bytes (one token's), or the end."""

    data: bytes | None = None
    finish_reason: str | None = None
    logprobs: TokenLogprobs | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: InferGateError | None = None
    token_ids: tuple[int, ...] = ()  # the tokens whose text this response completes


@dataclass(frozen=True, slots=True)
class GenerationStats:
    running: int
    waiting: int
    cache_bytes: int  # positions held in the running sequences' caches, in bytes
    reserved_cache_bytes: int
    tokens_generated: int
    steps: int
    prefix: PrefixStats | None = None  # the prefix cache's figures; None without one


@dataclass(eq=False, slots=True)
class GenSequence:
    prompt: list[int]
    params: SamplingParams
    emit: Callable[[TokenOut], None]
    cancelled: threading.Event
    token_text: TokenText
    reserved_bytes: int
    capacity: int  # positions: prompt + max_tokens, within the context
    rng: np.random.Generator = field(init=False)
    cache: object | None = None
    length: int = 0  # positions in the cache
    completion: int = 0  # tokens chosen
    last_token: int = -1
    resumed: tuple[int, ...] = ()  # tokens generated before (elsewhere), prefilled after the prompt
    text: bytearray = field(default_factory=bytearray)  # the completion's bytes, sent or held
    # Chunks that may start a stop string, each with its token's log probabilities and the ids it completes.
    held: collections.deque[tuple[bytes, TokenLogprobs | None, tuple[int, ...]]] = field(
        default_factory=collections.deque)
    sent_bytes: int = 0
    unnamed: list[int] = field(default_factory=list)  # tokens whose text went out with no response yet
    prefix: PrefixMatch = NO_MATCH  # the cached blocks its prefill starts after (kept until it ran)

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.params.seed)


def choose_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """Greedy at temperature 0; else a draw from the top-p nucleus of softmax(logits / temperature)."""
    if params.temperature <= 0.0:
        return int(logits.argmax())
    scaled = logits.astype(np.float64) / params.temperature
    if 0 < params.top_k < scaled.shape[0]:
        kth = np.partition(scaled, -params.top_k)[-params.top_k]
        scaled = np.where(scaled >= kth, scaled, -np.inf)
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    if params.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        keep = order[: int(np.searchsorted(np.cumsum(probs[order]), params.top_p)) + 1]
        nucleus = np.zeros_like(probs)
        nucleus[keep] = probs[keep]
        probs = nucleus / nucleus.sum()
    return int(rng.choice(probs.shape[0], p=probs))


def token_logprobs(logits: np.ndarray, token: int, top: int) -> TokenLogprobs:
    """``token``'s log probability under softmax(logits), and the ``top`` most likely tokens' (best first)."""
    values = logits.astype(np.float64)
    shifted = values - values.max()
    logp = shifted - np.log(np.exp(shifted).sum())
    best: tuple[tuple[int, float], ...] = ()
    if top > 0:
        count = min(top, logp.shape[0])
        part = np.argpartition(-logp, count - 1)[:count]
        order = part[np.lexsort((part, -logp[part]))]  # most likely first; ties by id
        best = tuple((int(t), float(logp[t])) for t in order)
    return TokenLogprobs(token, float(logp[token]), best)


def _stop_prefix(text: bytes, stops: Sequence[bytes]) -> int:
    """How many trailing bytes of ``text`` could be the start of a stop string (held back until known)."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


class Scheduler:
    """One instance's running batch: admission, the step loop, token choice and finishing."""

    def __init__(self, model: str, limits: SchedulerLimits, step: StepFunction, offload: Offload[list[tuple[np.ndarray, object]]],
                 *, eos_id: int | Sequence[int], banned: Sequence[int] = (),
                 prefix: PrefixCache | None = None) -> None:  # fmt: skip
        """``prefix``: the instance's prefix cache (``step`` must then be a :class:`CachingStep`); None: off."""
        self.model = model
        self._prefix = prefix
        self.limits = limits
        self._step = step
        self._offload = offload
        self._eos = [eos_id] if isinstance(eos_id, int) else list(eos_id)
        self._eos = [e for e in self._eos if e >= 0]
        self.eos_ids: tuple[int, ...] = tuple(self._eos)
        self._banned = list(banned)
        self._batch = limits.max_batch_sequences or limits.max_sequences
        self._waiting: collections.deque[GenSequence] = collections.deque()
        self._running: list[GenSequence] = []
        self._reserved = 0
        self._tokens = 0
        self._steps = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    # --- admission (event loop thread) -------------------------------------------

    def admit(self, prompt: list[int], params: SamplingParams, emit: Callable[[TokenOut], None],
              cancelled: threading.Event, text: TokenText | Callable[[int], bytes],
              resume: Sequence[int] = ()) -> GenSequence | None:  # fmt: skip
        """Queue one request, or refuse it: capacity (Overloaded, retryable) or a request that can never fit.

        ``text`` gives each token's bytes (a :class:`TokenText`, or a plain ``token -> bytes``).
        ``resume``: the tokens a lost run already sent, to continue after.
        ``max_tokens`` 0, or a resumed run already complete, is answered at once (no step, nothing held): None."""
        limits = self.limits
        if self._closed:
            raise Unavailable(f"model '{self.model}' is unloading")
        if len(prompt) >= limits.max_positions:
            raise InvalidArgument(f"prompt of {len(prompt)} tokens exceeds the context of model '{self.model}' "
                                  f"({limits.max_positions} tokens)")
        if params.max_tokens == 0:
            emit(TokenOut(finish_reason="length", prompt_tokens=len(prompt), completion_tokens=0))
            return None
        token_text = text if hasattr(text, "flush") else _BytesOf(text)  # type: ignore[arg-type]
        sent = bytearray()
        for token in resume:
            sent += token_text.feed(token)  # type: ignore[union-attr]
        if resume and self._resumed_complete(prompt, params, resume, bytes(sent), emit):
            return None
        capacity = min(len(prompt) + params.max_tokens, limits.max_positions)
        reserved = capacity * limits.cache_bytes_per_token
        if reserved > limits.max_cache_bytes:
            raise InvalidArgument(f"prompt and max_tokens need more cache than model '{self.model}' has")
        admitted = len(self._waiting) + len(self._running)
        if self._prefix is not None and admitted < limits.max_sequences:
            # Cached blocks give way to a sequence: evicted (unused ones, oldest first) before it is refused.
            self._prefix.free_bytes(self._reserved + reserved + self._prefix.bytes - limits.max_cache_bytes)
        if admitted >= limits.max_sequences or self._reserved + reserved + self._cached_bytes() > limits.max_cache_bytes:
            raise Overloaded(f"model '{self.model}' is at capacity ({admitted} sequences); retry later")
        sequence = GenSequence(prompt, params, emit, cancelled, token_text, reserved, capacity)  # type: ignore[arg-type]
        if resume:
            sequence.resumed = tuple(resume)
            sequence.completion = len(resume)
            sequence.text, sequence.sent_bytes = sent, len(sent)
            if params.temperature > 0.0:
                sequence.rng.random(len(resume))  # each resumed token took one draw (choose_token)
        self._reserved += reserved
        self._waiting.append(sequence)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name=f"generate-{self.model}")
            self._task.add_done_callback(self._loop_ended)
        self._wake.set()
        return sequence

    def _resumed_complete(self, prompt: list[int], params: SamplingParams, resume: Sequence[int], sent: bytes,
                          emit: Callable[[TokenOut], None]) -> bool:
        """A resumed run that had ended when its run was lost (only its final response was missing):
        answered at once, True; False when it goes on. Its last response sent all its text (the
        held tail goes with the last token, or named by the end token)."""
        if any(t in self._eos for t in resume[:-1]):
            raise InvalidArgument("resume_token_ids holds an end token before its last id")
        # Ended by the model, or at a stop string (its last response was cut there).
        stopped = resume[-1] in self._eos or any(s in sent for s in params.stop)
        if not stopped and len(resume) < params.max_tokens and len(prompt) + len(resume) < self.limits.max_positions:
            return False
        emit(TokenOut(finish_reason="stop" if stopped else "length", prompt_tokens=len(prompt),
                      completion_tokens=len(resume)))
        return True

    def _cached_bytes(self) -> int:
        return self._prefix.bytes if self._prefix is not None else 0

    def stats(self) -> GenerationStats:
        held = sum(s.length for s in self._running) * self.limits.cache_bytes_per_token
        return GenerationStats(len(self._running), len(self._waiting), held, self._reserved, self._tokens, self._steps,
                               self._prefix.stats() if self._prefix is not None else None)

    # --- the loop --------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            if not self._waiting and not self._running:
                self._wake.clear()
                await self._wake.wait()
            await self.run_once()

    async def run_once(self) -> None:
        """One iteration: drop cancelled sequences, prefill joiners, then one decode step for all running."""
        self._drop_cancelled()
        joining: list[GenSequence] = []
        while self._waiting and len(self._running) + len(joining) < self._batch:
            joining.append(self._waiting.popleft())
        if joining:
            # Counted as running (and held) from their prefill on: should preparing it fail, the
            # loop's end tells them so (a joiner in neither list would never be told).
            self._running.extend(joining)
            try:
                rows = [self._prefill_row(s) for s in joining]
                await self._run_step(joining, rows, prefill=True)
            finally:
                for sequence in joining:
                    if self._prefix is not None:
                        self._prefix.release(sequence.prefix)
                    sequence.prefix = NO_MATCH
        decoding = [s for s in self._running if s not in joining]
        if decoding:
            await self._run_step(decoding, [StepRow([s.last_token], s.length, s.cache) for s in decoding])

    @staticmethod
    def _prefill_tokens(sequence: GenSequence) -> list[int]:
        return [*sequence.prompt, *sequence.resumed] if sequence.resumed else sequence.prompt

    def _prefill_row(self, sequence: GenSequence) -> StepRow:
        """A joiner's prefill: its prompt (and resumed tokens) after the blocks of it already cached."""
        tokens = self._prefill_tokens(sequence)
        if self._prefix is None:
            return StepRow(tokens, 0, None)
        try:
            sequence.prefix = match = self._prefix.match(tokens, self._read_held)
        except Exception:  # a held block could not be read out: prefilled whole, the cache started over
            self._drop_prefix_cache("read a cached block for a prefill")
            return StepRow(tokens, 0, None)
        return StepRow(tokens[match.tokens:], match.tokens, match if match.blocks else None)

    def _drop_prefix_cache(self, doing: str) -> None:
        """A copy of a block failed (memory): the prefix cache starts empty, the sequences go on."""
        logger.exception("model %s: could not %s; the prefix cache starts over empty", self.model, doing)
        if self._prefix is not None:
            self._prefix.clear()

    def _read_held(self, holder: object, start: int, stop: int) -> object:
        """Positions ``start``..``stop`` of a running sequence's cache, copied out (a block it holds)."""
        return self._step.extract(holder.cache, start, stop)  # type: ignore[attr-defined]

    async def _run_step(self, sequences: list[GenSequence], rows: list[StepRow], *, prefill: bool = False) -> None:
        step = self._step
        try:
            results = await self._offload(lambda: step(rows))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the step failed: its sequences end with an error, the others go on
            logger.exception("model %s: a decoder step of %d sequences failed", self.model, len(sequences))
            error = exc if isinstance(exc, InferGateError) else Internal(f"model '{self.model}' failed a decoder step")
            for sequence in sequences:
                self._finish(sequence, None, error)
            return
        self._steps += 1
        for sequence, row, (logits, cache) in zip(sequences, rows, results):
            if sequence.cancelled.is_set():
                self._finish(sequence, None)
                continue
            sequence.cache, sequence.length = cache, row.position + len(row.tokens)
            if prefill and self._prefix is not None:  # its cache holds its prompt's blocks from now on
                self._prefix.hold(self._prefill_tokens(sequence), sequence.prefix, sequence)
            self._advance(sequence, logits)

    def _advance(self, sequence: GenSequence, logits: np.ndarray) -> None:
        """Choose the sequence's next token, send what may be sent, and end it when it is done."""
        params = sequence.params
        raw = logits.copy() if params.logprobs >= 0 and (self._banned or params.ignore_eos) else logits
        if self._banned:
            logits[self._banned] = -np.inf  # the step's output, the scheduler's to change
        if params.ignore_eos and self._eos:
            logits[self._eos] = -np.inf
        token = choose_token(logits, params, sequence.rng)
        sequence.completion += 1
        sequence.last_token = token
        self._tokens += 1
        if token in self._eos:
            self._end(sequence, token)
            return
        logprobs = token_logprobs(raw, token, params.logprobs) if params.logprobs >= 0 else None
        chunk = sequence.token_text.feed(token)
        last = sequence.completion >= params.max_tokens or sequence.length + 1 >= self.limits.max_positions
        if last:
            # What the text still held goes out with the last token, named by it: a run resumed
            # after that response has nothing left to send.
            chunk += sequence.token_text.flush()
        if self._take(sequence, chunk, logprobs, (token,)):
            return
        if last:
            self._flush(sequence, len(sequence.text))
            self._finish(sequence, "length")

    def _end(self, sequence: GenSequence, eos: int) -> None:
        """The model ended the sequence with ``eos``: what its text still held goes out (named by the end
        token, so a run resumed after it knows it ended), then its end."""
        tail = sequence.token_text.flush()
        if tail and self._take(sequence, tail, None, (eos,)):
            return
        self._flush(sequence, len(sequence.text))
        self._finish(sequence, "stop")

    def _take(self, sequence: GenSequence, chunk: bytes, logprobs: TokenLogprobs | None,
              tokens: tuple[int, ...]) -> bool:  # fmt: skip
        """Add one token's bytes to the text and send what may go; True when a stop string ended it."""
        sequence.text += chunk
        stops = sequence.params.stop
        if not stops and not sequence.held:  # nothing to hold back: the token goes out as it is
            self._send(sequence, chunk, logprobs, tokens)
            return False
        sequence.held.append((chunk, logprobs, tokens))
        if stops:
            # Search only where a stop string could newly end: from just before what was sent.
            start = max(0, sequence.sent_bytes - max(len(s) for s in stops) + 1)
            found = [i for i in (sequence.text.find(s, start) for s in stops if s) if i >= 0]
            if found:
                self._flush(sequence, min(found), cut=True)
                self._finish(sequence, "stop")
                return True
        tail = bytes(sequence.text[-max(len(s) for s in stops):]) if stops else b""  # where a stop may start
        self._flush(sequence, len(sequence.text) - _stop_prefix(tail, stops))
        return False

    @staticmethod
    def _flush(sequence: GenSequence, upto: int, *, cut: bool = False) -> None:
        """Send held chunks (one token's bytes each) up to byte ``upto`` of the completion; with ``cut``
        the chunk that crosses ``upto`` goes out cut there (the sequence ends at a stop string)."""
        while sequence.held:
            chunk, logprobs, tokens = sequence.held[0]
            room = upto - sequence.sent_bytes
            if len(chunk) > room:
                if not cut or room <= 0:
                    break
                chunk = chunk[:room]
            sequence.held.popleft()
            Scheduler._send(sequence, chunk, logprobs, tokens)

    @staticmethod
    def _send(sequence: GenSequence, chunk: bytes, logprobs: TokenLogprobs | None, tokens: tuple[int, ...]) -> None:
        """One token's chunk goes out, naming the tokens it completes (with those that sent nothing before it)."""
        sequence.sent_bytes += len(chunk)
        if chunk or logprobs is not None:
            if sequence.unnamed:
                tokens, sequence.unnamed = (*sequence.unnamed, *tokens), []
            sequence.emit(TokenOut(data=chunk, logprobs=logprobs, token_ids=tokens))
        else:
            sequence.unnamed.extend(tokens)

    def _finish(self, sequence: GenSequence, reason: str | None, error: InferGateError | None = None) -> None:
        """Take the sequence out and tell its client how it ended (a cancelled one is told nothing)."""
        if sequence in self._running:
            self._running.remove(sequence)
        elif sequence in self._waiting:
            self._waiting.remove(sequence)
        else:
            return
        self._reserved -= sequence.reserved_bytes
        if self._prefix is not None and sequence.cache is not None:
            try:
                self._prefix.hand_back(sequence, self._read_held)  # into the room its reservation leaves
            except Exception:
                self._drop_prefix_cache("keep the blocks of a sequence that ended")
        sequence.cache = None
        if error is not None:
            sequence.emit(TokenOut(error=error))
        elif reason is not None:
            sequence.emit(TokenOut(finish_reason=reason, prompt_tokens=len(sequence.prompt),
                                   completion_tokens=sequence.completion))

    def _drop_cancelled(self) -> None:
        for sequence in [s for s in (*self._waiting, *self._running) if s.cancelled.is_set()]:
            logger.debug("model %s: a sequence was cancelled after %d tokens", self.model, sequence.completion)
            self._finish(sequence, None)

    def _loop_ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            logger.error("model %s: the generation loop died", self.model, exc_info=task.exception())
        error = Unavailable(f"model '{self.model}' stopped generating")
        for sequence in [*self._waiting, *self._running]:
            self._finish(sequence, None, error)
        self._task = None

    def close(self) -> None:
        """Stop the loop; every sequence still admitted ends with an error."""
        self._closed = True
        task = self._task
        if task is not None:  # a model's close may come from a load thread: cancel on the loop's own thread
            task.get_loop().call_soon_threadsafe(task.cancel)
