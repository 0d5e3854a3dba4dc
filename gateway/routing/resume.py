"""A generation that survives its replica: a generation's stream whose replica
is lost after its first response goes on, on another replica, from where it
was.

The generation backend names, in each streamed response, the tokens whose
text it completes (when asked: the router asks, and keeps the ids from the
client unless it asked too), and continues a generation from such ids
(``protos.generation_tokens``: ``token_ids`` out, ``resume_token_ids`` in;
the ids are prefilled after the prompt, count toward ``max_tokens`` and
the usage, and their text is not sent again). So when the replica serving a
generation is lost (:class:`~gateway.routing.tries.StreamLost`: its
connection broke, it answered UNAVAILABLE, or it dropped the model, after
the first response), the router sends the prompt again with the ids
received so far to a replica this stream has not tried (a re-prefill)
through the same race of attempts as the stream's first try, and the
client's stream goes on with the next response: no gap, no repeat, greedy
text equal to an uninterrupted run's, and the final response's usage that
of the whole generation (the original prompt's tokens, every completion
token).

Which streams: those of a model whose config names the generation backend
(``backend: "generate"``: ``tiny_lm``, Hugging Face exports), read once as
the stream starts (:meth:`Resumes.generation`), and the generations of an
OpenAI-protocol server's model (``backend: "openai"``), which go on as a
continuation of the text sent. Any other
decoupled model's stream ends with ``StreamLost`` as before: nothing says
its request can be continued. Only a lost replica resumes: a request fault, the deadline, an
in-stream model error or a busy refusal ends the stream as it did.

Bounds: a resume is an extra attempt of the call. A stream resumes at most
``retry_limit`` times, within its deadline, after the retry backoff, with a
retry-budget token held until the continuation's first response. The token
is granted as a failover's is when the loss took the replica out of the
model's rotation (it was marked DOWN, or dropped the model): each such loss
moves the streams of one replica that is gone rather than adding load, and
is bounded by the replicas. When a bound is reached, no replica not tried
is left, or the continuation fails, the stream ends with ``StreamLost``
naming the loss and why it did not resume.

An OpenAI-protocol server takes no token ids, so the continuation names
the text sent too (``resume_text``); the server goes on from the prompt with
that text appended, or for a chat that text as a
final assistant message to continue (``gateway.replicas.openai_contract``),
with ``max_tokens`` less one token per response sent (vLLM and SGLang send a
token a chunk); greedy text equals an uninterrupted run's where the
server's tokenizer reads the joined text back as the tokens it wrote. In
one pool of both kinds a stream may go from one kind to the other: the
generation backend goes on after the ids where every token named them,
else after the text, which it tokenizes.

Not carried over: a seeded sampling's continuation skips the draws the
resumed tokens took, so it continues the same random sequence, but the
re-prefill's logits may differ from the decode steps' in the last bits, so
a draw at a boundary may go the other way; only greedy output is promised
equal. Log probabilities already sent are not sent again.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

from tritonclient.grpc import model_config_pb2, service_pb2

from gateway.fleet.view import WorkerState
from gateway.replicas.openai_contract import BACKEND as OPENAI_BACKEND
from gateway.replicas.openai_contract import EMBEDDING_REQUEST, TEXT_OUTPUT
from gateway.replicas.replica import StreamItem
from gateway.routing.hedging import AttemptPolicy
from gateway.routing.tries import OpenStream, StreamLost
from protos.codec import deserialize_bytes_tensor
from protos.errors import DeadlineExceeded, InferGateError
from protos.generation_tokens import RESUME_TEXT, RESUME_TOKEN_IDS, RESUME_TOKENS, TOKEN_IDS, join_texts, parse_ids

log = logging.getLogger(__name__)

GENERATE_BACKEND = "generate"

# Opens a stream of ``request`` on a replica outside ``avoid`` (the router's race), up to its first response.
Reopen = Callable[[service_pb2.ModelInferRequest, set[WorkerState]], Awaitable[OpenStream]]


class Generation:
    """One generation's stream as it went out: its request, and the token ids and text its responses carried.

    The continuation names both: the ids (``resume_token_ids``) for the
    generation backend, while every token's response named its ids, and the
    text (``resume_text``, ``resume_tokens``) for an OpenAI-protocol server,
    which names none; in one pool of both, a stream may go from either kind
    to the other (the generation backend tokenizes the text where no ids
    came)."""

    __slots__ = ("request", "responses", "_named", "_texts", "_unnamed", "_keep_ids")

    def __init__(self, request: service_pb2.ModelInferRequest) -> None:
        """Follows ``request``, which it changes to ask its replica to name each response's tokens."""
        self.request = request
        self.responses = 0
        # Each response's ``token_ids`` as sent (JSON list texts), joined only if the stream resumes.
        self._named: list[str] = []
        self._texts: list[bytes] = []  # each text response's raw ``text_output``, read only if it resumes
        parameters = request.parameters
        # Text responses that named no ids (an OpenAI server's), counted on from an earlier continuation's.
        self._unnamed = parameters[RESUME_TOKENS].int64_param if _continued_without_ids(parameters) else 0
        if RESUME_TOKEN_IDS in parameters:  # the client's own continuation, or an earlier one: its ids come first
            self._named.append(parameters[RESUME_TOKEN_IDS].string_param)
        # The ids go on to the client only if it asked for them itself: a parameter on every
        # token costs the frontends their plain path for it.
        self._keep_ids = TOKEN_IDS in parameters and parameters[TOKEN_IDS].bool_param
        parameters[TOKEN_IDS].bool_param = True

    def sent(self, response: service_pb2.ModelInferResponse) -> None:
        """``response`` goes to the client (once per token: a few lookups, an append or two)."""
        self.responses += 1
        parameters = response.parameters
        named = TOKEN_IDS in parameters
        if named:
            self._named.append(parameters[TOKEN_IDS].string_param)
            if not self._keep_ids:
                del parameters[TOKEN_IDS]
        raws = response.raw_output_contents
        if raws and response.outputs[0].name == TEXT_OUTPUT:
            self._texts.append(raws[0])
            if not named:
                self._unnamed += 1

    def token_ids(self) -> str:
        """Every id named so far, as one JSON list."""
        return join_texts(self._named)

    def text(self) -> str:
        """Every piece of text sent so far (an earlier continuation's first)."""
        before = self.request.parameters.get(RESUME_TEXT)
        pieces = [item for raw in self._texts for item in deserialize_bytes_tensor(raw).tolist()]
        return (before.string_param if before is not None else "") + b"".join(pieces).decode("utf-8", "replace")

    def continuation(self) -> service_pb2.ModelInferRequest:
        """The request that goes on from here: the same one, after the ids and the text sent."""
        request = service_pb2.ModelInferRequest()
        request.CopyFrom(self.request)
        parameters = request.parameters
        ids = self.token_ids()
        parameters[RESUME_TEXT].string_param = self.text()
        if self._unnamed:  # some tokens came with no ids: the text is the one whole account
            if RESUME_TOKEN_IDS in parameters:
                del parameters[RESUME_TOKEN_IDS]
            parameters[RESUME_TOKENS].int64_param = self._unnamed + len(parse_ids(ids))
        else:
            parameters[RESUME_TOKEN_IDS].string_param = ids
            parameters[RESUME_TOKENS].int64_param = len(parse_ids(ids))
        return request


def _continued_without_ids(parameters: Mapping[str, service_pb2.InferParameter]) -> bool:
    """A continuation whose tokens the text alone accounts for (no ids came for some of them)."""
    return RESUME_TEXT in parameters and RESUME_TOKEN_IDS not in parameters


class Resumes:
    """The router's resumes of generations: which streams may resume, and each one's loop."""

    def __init__(self, policy: AttemptPolicy) -> None:
        self._policy = policy
        # model -> generations continued on another replica / lost with no continuation (for /metrics).
        self.resumed: dict[str, int] = {}
        self.not_resumed: dict[str, int] = {}

    @staticmethod
    def generation(config: model_config_pb2.ModelConfig | None,
                   request: service_pb2.ModelInferRequest) -> Generation | None:  # fmt: skip
        """What to follow ``request``'s stream by, when its model's backend can resume it."""
        if config is None:
            return None
        if config.backend == GENERATE_BACKEND or (config.backend == OPENAI_BACKEND
                                                   and EMBEDDING_REQUEST not in request.parameters):
            return Generation(request)
        return None

    async def responses(self, model: str, generation: Generation, opened: OpenStream, reopen: Reopen,
                        deadline: float | None) -> AsyncIterator[StreamItem]:  # fmt: skip
        """Every response of the generation: ``opened``'s, then, after each lost replica, its continuation's."""
        tried: set[WorkerState] = set()
        resumes = 0
        try:
            while True:
                try:
                    generation.sent(opened.first[0])
                    yield opened.first
                    async for item in opened.rest():
                        generation.sent(item[0])
                        yield item
                    return
                except StreamLost as lost:
                    tried.add(opened.worker)
                    await opened.close()  # the lost replica's slot is free before the next is taken
                    resumes += 1
                    try:
                        opened = await self._resume(model, generation, lost, reopen, tried, resumes, deadline)
                    except InferGateError:
                        self.not_resumed[model] = self.not_resumed.get(model, 0) + 1
                        raise
                    self.resumed[model] = self.resumed.get(model, 0) + 1
        finally:
            await opened.close()

    async def _resume(self, model: str, generation: Generation, lost: StreamLost, reopen: Reopen,
                      tried: set[WorkerState], resumes: int, deadline: float | None) -> OpenStream:  # fmt: skip
        """The continuation, open on a replica not tried, or the loss (``StreamLost``) saying why not."""
        policy = self._policy
        clock = policy.clock
        request_id = generation.request.id
        if resumes > policy.retry_limit:
            raise StreamLost(f"{lost} (not resumed: it was resumed {resumes - 1} time(s) already)") from None
        if not policy.budget.try_acquire(failover=lost.left_rotation):
            log.warning("model %s: request %s not resumed after its replica was lost: retry budget spent",
                        model, request_id)
            raise StreamLost(f"{lost} (not resumed: retries are limited while many requests fail)") from None
        try:
            delay_s = policy.backoff.delay_s(resumes)
            if deadline is not None and deadline - clock.now() <= delay_s:
                raise StreamLost(f"{lost} (not resumed: its deadline leaves no time)") from None
            await clock.sleep(delay_s)
            opened = await reopen(generation.continuation(), tried)
        except (DeadlineExceeded, StreamLost):
            raise
        except InferGateError as e:
            raise StreamLost(f"{lost} (resuming it failed: {e})") from None
        finally:
            policy.budget.release()
        log.info("model %s: request %s resumed on %s after %d response(s), its replica %s lost",
                 model, request_id, opened.worker.address, generation.responses,
                 getattr(lost.worker, "address", "?"))
        return opened
