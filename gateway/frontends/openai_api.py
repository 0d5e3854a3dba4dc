"""The OpenAI-compatible API on the REST frontend: ``GET /v1/models[/{m}]``,
``POST /v1/completions``, ``/v1/chat/completions`` and ``/v1/embeddings``.

A completion runs each of its choices as one stream of the model
(``InferenceCore.stream``) at the same time: the token bytes of each
response are joined into text (``openai_text.TextJoiner``), cut at the
first stop string (``openai_text.StopMatcher``; leaving the stream there
cancels the model's request), and either gathered into one answer or
written at once as OpenAI's chunks (Server-Sent Events ending with
``data: [DONE]``), the choices' chunks interleaved as they come. An error
before the first chunk is an ordinary error answer; after it, one
``data: {"error": ...}`` event ends the stream (the ``openai`` client raises
it). A client that goes away cancels every stream of its request. The body
shapes are ``openai_codec``'s; errors answer in OpenAI's shape
(``openai_errors``).

Embeddings: to a model of the embedding contract (``openai_codec``: an
encoder export, which tokenizes and pools itself) all the inputs go in one
request, texts or token ids its rows; to another encoder of token ids (the
example ``encoder``) each input goes alone (its bytes, or token ids as given)
and the answer is the mean of its ``HIDDEN`` states over the tokens.

API keys: the access check (``gateway.security.frontend_auth``) refuses a
request without a valid key before its body is read and leaves a
:class:`ModelAccess` on the request under :data:`MODEL_ACCESS`, which the
handlers ask once the body names the model (403, then the key's quota, 429).

May import: what ``gateway.frontends`` may import.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import orjson
from aiohttp import hdrs, web

from gateway.frontends.openai_codec import (
    DEFAULT_MAX_TOKENS,
    TEXT_OUTPUT,
    Choice,
    Generation,
    Usage,
    chat_request,
    chunk_json,
    completion_json,
    completion_request,
    TRUNCATE,
    EmbeddingRequest,
    check_dimensions,
    embedding_model_request,
    embedding_request,
    embedding_vectors,
    embeddings_json,
    is_embedding_model,
    final_counts,
    mean_pool,
    model_request,
    token_logprobs,
    models_json,
    now_s,
    response_id,
    token_bytes,
    usage_chunk_json,
)
from gateway.frontends.openai_errors import body_of
from gateway.frontends.openai_text import BadParameter, StopMatcher, TextJoiner
from gateway.limits import TIMEOUT_HEADER, apply_timeout_header
from gateway.replicas.openai_contract import BACKEND as OPENAI_BACKEND
from gateway.replicas.openai_contract import EMBEDDING_ANSWER, EMBEDDING_REQUEST
from gateway.types import InferenceCore, InferRequest, InferResponse, Tensor
from protos.codec import deserialize_bytes_tensor
from protos.errors import InferGateError, Internal, ModelNotFound

log = logging.getLogger(__name__)

MODEL_ACCESS = "infergate.openai_model_access"
DONE = b"data: [DONE]\n\n"
# Chunks waiting to be written, all choices together: a slow reader holds the models back.
_QUEUE_CHUNKS = 64

ReadBody = Callable[[web.Request], Awaitable[bytes]]


class ModelAccess(Protocol):
    """What the request's API key may do (absent when keys are off)."""

    def check(self, model: str) -> None:
        """Allow a call of ``model`` (charging the key's quota) or raise PermissionDenied / QuotaExceeded."""

    def may_see(self, model: str) -> bool:
        """Whether ``model`` belongs in the key's model list."""


@dataclass(frozen=True, slots=True)
class _Event:
    """Text of one choice, or its end (``done``) with the counts."""

    index: int
    text: str
    done: bool = False
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # The model's response that completed ``text``: the core hears when its chunk is written.
    response: InferResponse | None = None
    logprobs: tuple[dict[str, Any], ...] = ()  # the log probabilities of the tokens since the last event


Emit = Callable[[_Event], Awaitable[None]]


def add_openai_routes(app: web.Application, core: InferenceCore, read_body: ReadBody) -> None:
    api = OpenAIApi(core, read_body)
    app.router.add_get("/v1/models", api.models)
    app.router.add_get("/v1/models/{model}", api.model)
    app.router.add_post("/v1/completions", api.completions)
    app.router.add_post("/v1/chat/completions", api.chat_completions)
    app.router.add_post("/v1/embeddings", api.embeddings)


def _doc(body: bytes) -> dict[str, Any]:
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadParameter(f"the body is not JSON: {exc.msg}") from None
    if not isinstance(doc, dict):
        raise BadParameter("the body must be a JSON object")
    return doc


def _first_error(group: BaseExceptionGroup) -> BaseException:
    """The error that ended a request's tasks: the project's own first, else the first."""
    leaves: list[BaseException] = []

    def walk(exc: BaseException) -> None:
        if isinstance(exc, BaseExceptionGroup):
            for inner in exc.exceptions:
                walk(inner)
        else:
            leaves.append(exc)

    walk(group)
    return next((e for e in leaves if isinstance(e, InferGateError)), leaves[0])


def _token(response: InferResponse) -> bytes:
    """``token_bytes``, read at once in the common case (every token of a generation): one
    ``text_output`` element, its 4-byte length then its bytes."""
    outputs = response.outputs
    if len(outputs) == 1:
        tensor = outputs[0]
        data = tensor.data
        if (tensor.name == TEXT_OUTPUT and tensor.datatype == "BYTES" and tensor.shape == (1,)
                and isinstance(data, bytes) and len(data) >= 4
                and int.from_bytes(data[:4], "little") == len(data) - 4):
            return data[4:]
    return token_bytes(response)


def _sse(doc: Any) -> bytes:
    return b"data: " + orjson.dumps(doc) + b"\n\n"


class OpenAIApi:
    """The endpoints, bound to one core; ``read_body`` bounds and inflates bodies as the app does."""

    def __init__(self, core: InferenceCore, read_body: ReadBody) -> None:
        self._core = core
        self._read_body = read_body

    # --- models ------------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        return web.Response(body=orjson.dumps(models_json(await self._names(request))),
                            content_type="application/json")

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name not in await self._names(request):
            raise ModelNotFound(f"Request for unknown model: '{name}' is not found")
        (doc,) = models_json([name])["data"]
        return web.Response(body=orjson.dumps(doc), content_type="application/json")

    async def _names(self, request: web.Request) -> list[str]:
        """The ready models the request's key may use, sorted."""
        access: ModelAccess | None = request.get(MODEL_ACCESS)
        index = await self._core.repository_index(True)
        names = sorted({m.name for m in index.models})
        return names if access is None else [n for n in names if access.may_see(n)]

    # --- completions -------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, completion_request)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat_request)

    async def _generate(self, request: web.Request, decode: Callable[[dict[str, Any]], Generation],
                        ) -> web.StreamResponse:
        now = asyncio.get_running_loop().time()
        g = decode(_doc(await self._read_body(request)))
        self._allow(request, g.model)
        config = self._core.model_config(g.model)
        inputs = {t.name: t.datatype for t in self._core.model_metadata(g.model).inputs}
        rid, created = response_id(g.kind), now_s()
        infers = []
        for index, prompt, seed in g.choices():
            infer = model_request(g, prompt, seed, inputs=inputs, batched=config.max_batch_size > 0,
                                  request_id=f"{rid}-{index}")
            infer.arrival = now
            apply_timeout_header(infer, request.headers.get(TIMEOUT_HEADER), now)
            infers.append((index, infer))
        if g.stream:
            return await self._stream(request, g, rid, created, infers)
        choices = {index: Choice(index) for index, _ in infers}
        counts: dict[int, _Event] = {}

        async def gather(event: _Event) -> None:
            choice = choices[event.index]
            if event.logprobs:
                choice.logprobs = (choice.logprobs or []) + list(event.logprobs)
            if event.done:
                choice.finish_reason = event.finish_reason
                counts[event.index] = event
            else:
                choice.text += event.text

        try:
            async with asyncio.TaskGroup() as tasks:
                for index, infer in infers:
                    tasks.create_task(self._run_choice(infer, index, g, gather))
        except BaseExceptionGroup as group:
            raise _first_error(group) from None
        body = completion_json(g, rid, created, [choices[i] for i in sorted(choices)], _usage(g, counts))
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    def _allow(self, request: web.Request, model: str) -> None:
        access: ModelAccess | None = request.get(MODEL_ACCESS)
        if access is not None:
            access.check(model)

    async def _run_choice(self, infer: InferRequest, index: int, g: Generation, emit: Emit) -> None:
        """One choice: the model's stream of token bytes -> text events, then its end."""
        joiner, matcher = TextJoiner(), StopMatcher(g.sampling.stop)
        tokens, reason, prompt_tokens, completion_tokens = 0, None, None, None
        logprobs: list[dict[str, Any]] = []  # entries not yet sent with a text
        chars = 0  # the choice's text so far, in characters: where the next token's text starts
        async with aclosing(self._core.stream(infer)) as responses:
            async for response in responses:
                data = _token(response)
                tokens += bool(data)
                piece = joiner.feed(data)
                if g.sampling.logprobs is not None and (entry := token_logprobs(response)) is not None:
                    entry["offset"] = chars
                    logprobs.append(entry)
                chars += len(piece)
                text = matcher.feed(piece)
                if text:
                    await emit(_Event(index, text, response=response, logprobs=tuple(logprobs)))
                    logprobs.clear()
                if response.final:
                    reason, prompt_tokens, completion_tokens = final_counts(response)
                if matcher.stopped:
                    break  # leaving the loop closes the stream: the model's request is cancelled
        text = "" if matcher.stopped else matcher.feed(joiner.flush())
        text += matcher.flush()
        if text or logprobs:
            await emit(_Event(index, text, logprobs=tuple(logprobs)))
        if matcher.stopped:
            reason, completion_tokens = "stop", None
        if reason is None:
            # A model that does not say why it ended: its length limit, or it chose to stop.
            limit = g.sampling.max_tokens or DEFAULT_MAX_TOKENS
            reason = "length" if tokens >= limit else "stop"
        await emit(_Event(index, "", True, reason, prompt_tokens or 0,
                          tokens if completion_tokens is None else completion_tokens))

    async def _stream(self, request: web.Request, g: Generation, rid: str, created: int,
                      infers: Sequence[tuple[int, InferRequest]]) -> web.StreamResponse:
        queue: asyncio.Queue[_Event] = asyncio.Queue(_QUEUE_CHUNKS)
        stream: web.StreamResponse | None = None
        started: set[int] = set()
        counts: dict[int, _Event] = {}
        try:
            async with asyncio.TaskGroup() as tasks:
                for index, infer in infers:
                    tasks.create_task(self._run_choice(infer, index, g, queue.put))
                while len(counts) < len(infers):
                    event = await queue.get()
                    if stream is None:
                        # Only now: an error before the first chunk is an ordinary error answer.
                        stream = await _open_events(request)
                    first = event.index not in started
                    started.add(event.index)
                    if event.text or event.logprobs or (first and g.kind == "chat"):
                        await stream.write(_sse(chunk_json(g, rid, created, event.index, event.text, first=first,
                                                           logprobs=event.logprobs)))
                        if event.response is not None:
                            self._core.stream_written(event.response)
                    if event.done:
                        counts[event.index] = event
                        await stream.write(_sse(chunk_json(g, rid, created, event.index, None, event.finish_reason)))
        except BaseExceptionGroup as group:
            error = _first_error(group)
            if isinstance(error, ConnectionResetError) and stream is not None:
                log.debug("client left the stream %s of model '%s'", rid, g.model)
                return stream
            if stream is None:
                raise error from None
            if not isinstance(error, InferGateError):
                log.error("unexpected error streaming %s of model '%s'", rid, g.model, exc_info=error)
                error = Internal.caused_by(f"streaming {request.path}", error, rid)
            log.debug("stream %s of model '%s' ended with: %s", rid, g.model, error)
            await _write_last(stream, _sse(body_of(error)))
            return stream
        if stream is None:  # no choices at all cannot happen; keep the type checker honest
            stream = await _open_events(request)
        try:
            if g.include_usage:
                await stream.write(_sse(usage_chunk_json(g, rid, created, _usage(g, counts))))
            await stream.write(DONE)
            await stream.write_eof()
        except ConnectionResetError:
            pass
        return stream

    # --- embeddings --------------------------------------------------------------------

    async def embeddings(self, request: web.Request) -> web.Response:
        now = asyncio.get_running_loop().time()
        doc = _doc(await self._read_body(request))
        e = embedding_request(doc)
        self._allow(request, e.model)
        config = self._core.model_config(e.model)
        if config.backend == OPENAI_BACKEND:
            return await self._server_embeddings(request, doc, e, now)
        metadata = self._core.model_metadata(e.model)
        contract = is_embedding_model({t.name: t.datatype for t in metadata.inputs}, [t.name for t in metadata.outputs])
        if contract:
            if config.max_batch_size > 0 and len(e.inputs) > config.max_batch_size:
                raise BadParameter(f"'input' holds {len(e.inputs)} inputs; model '{e.model}' takes at most "
                                   f"{config.max_batch_size} in one request", "input")
            infers = [embedding_model_request(e, request_id=f"emb-{uuid.uuid4().hex}")]
        else:
            check_encoder_limits(e, config)
            infers = _encoder_requests(e, config.max_batch_size > 0, metadata.inputs,
                                       _limit(config, "max_position_embeddings"))
        for infer in infers:
            infer.arrival = now
            apply_timeout_header(infer, request.headers.get(TIMEOUT_HEADER), now)
        try:
            async with asyncio.TaskGroup() as tasks:
                jobs = [tasks.create_task(self._core.infer(infer)) for infer in infers]
        except BaseExceptionGroup as group:
            raise _first_error(group) from None
        responses = [j.result() for j in jobs]
        if contract:
            vectors, tokens = embedding_vectors(e, responses[0])
        else:
            names = [o.name for o in metadata.outputs]
            output = "HIDDEN" if "HIDDEN" in names else (names[0] if names else "")
            vectors = [_hidden_mean(e.model, r, output) for r in responses]
            tokens = sum(len(ids) for ids in _encoder_ids(e, _limit(config, "max_position_embeddings")))
        check_dimensions(e, int(vectors[0].shape[-1]))
        return web.Response(body=orjson.dumps(embeddings_json(e, vectors, tokens)), content_type="application/json")


    async def _server_embeddings(self, request: web.Request, doc: Mapping[str, Any], e: EmbeddingRequest,
                                 now: float) -> web.Response:  # fmt: skip
        """A model of an OpenAI-protocol server: the request goes on to the server's ``/v1/embeddings``
        (routed, retried and timed as its generations are), its answer comes back as it gave it."""
        fields = {k: v for k, v in doc.items() if k != "model"}
        infer = InferRequest(model=e.model, version="", id=f"emb-{uuid.uuid4().hex}", inputs=[], outputs=[],
                             parameters={EMBEDDING_REQUEST: orjson.dumps(fields).decode()})
        infer.arrival = now
        apply_timeout_header(infer, request.headers.get(TIMEOUT_HEADER), now)
        answer: bytes | None = None
        async with aclosing(self._core.stream(infer)) as responses:
            async for response in responses:
                for tensor in response.outputs:
                    if tensor.name == EMBEDDING_ANSWER:
                        answer = bytes(deserialize_bytes_tensor(tensor.data, 1)[0])
        if answer is None:
            raise Internal(f"model '{e.model}': its server gave no embeddings answer")
        body = orjson.loads(answer)
        body["model"] = e.model  # the name the client asked for (the server may spell its own)
        return web.Response(body=orjson.dumps(body), content_type="application/json")


def _limit(config: Any, name: str) -> int | None:
    param = config.parameters.get(name)
    try:
        return int(param.string_value) if param is not None and param.string_value else None
    except ValueError:
        return None


def check_encoder_limits(e: EmbeddingRequest, config: Any) -> None:
    """An encoder of token ids refuses, in its own terms, what its config says it cannot take: inputs past
    ``max_position_embeddings`` tokens, ids past ``vocab_size`` (the names Hugging Face gives them)."""
    positions, vocab = _limit(config, "max_position_embeddings"), _limit(config, "vocab_size")
    for index, ids in enumerate(_encoder_ids(e, positions)):
        if positions is not None and len(ids) > positions:
            raise BadParameter(f"input {index} has {len(ids)} tokens; model '{e.model}' takes at most {positions} "
                               "(its max_position_embeddings)", "input")
        if vocab is not None and ids and max(ids) >= vocab:
            raise BadParameter(f"input {index} holds token id {max(ids)}; model '{e.model}' has a vocabulary of "
                               f"{vocab} tokens (ids 0 to {vocab - 1})", "input")


def _encoder_requests(e: EmbeddingRequest, batched: bool, inputs: Sequence[Any],
                      positions: int | None = None) -> list[InferRequest]:
    """One request an input to an encoder of token ids (the example ``encoder``): its first input."""
    if not inputs or inputs[0].datatype not in ("INT64", "INT32"):
        raise BadParameter(f"model '{e.model}' is neither an embedding model nor an encoder of token ids", "model")
    token = inputs[0]
    dtype = np.int64 if token.datatype == "INT64" else np.int32
    infers = []
    for index, ids in enumerate(_encoder_ids(e, positions)):
        shape = (1, len(ids)) if batched else (len(ids),)
        infers.append(InferRequest(model=e.model, version="", id=f"emb-{index}", outputs=[], inputs=[
            Tensor(token.name, token.datatype, shape, np.array(ids, dtype).tobytes())]))
    return infers


def _encoder_ids(e: EmbeddingRequest, positions: int | None = None) -> tuple[tuple[int, ...], ...]:
    """An encoder's token ids of each input, cut where the request asks (-1: to ``positions``, the model's
    limit, where its config states one)."""
    ids = e.byte_ids()
    if e.truncate is None:
        return ids
    if e.truncate == -1:
        if positions is None:
            raise BadParameter(f"model '{e.model}' states no limit to cut inputs to: give '{TRUNCATE}' a number of "
                               "tokens", TRUNCATE)
        return tuple(i[:positions] for i in ids)
    return tuple(i[:e.truncate] for i in ids)


def _hidden_mean(model: str, response: InferResponse, output: str) -> np.ndarray:
    """An encoder's ``output`` states averaged over the tokens."""
    hidden = next((t for t in response.outputs if t.name == output), None)
    if hidden is None or hidden.datatype != "FP32" or len(hidden.shape) < 2:
        raise Internal(f"model '{model}' answered no FP32 hidden states [.., tokens, width]")
    return mean_pool(hidden)


def _usage(g: Generation, counts: dict[int, _Event]) -> Usage:
    """Completion tokens of every choice; the prompt's tokens once per prompt."""
    usage = Usage()
    for p in range(len(g.prompts)):
        ends = [counts[i] for i in range(p * g.n, (p + 1) * g.n) if i in counts]
        usage.prompt_tokens += max((e.prompt_tokens for e in ends), default=0)
        usage.completion_tokens += sum(e.completion_tokens for e in ends)
    return usage


async def _open_events(request: web.Request) -> web.StreamResponse:
    stream = web.StreamResponse(status=200, headers={hdrs.CACHE_CONTROL: "no-cache"})
    stream.content_type = "text/event-stream"
    stream.charset = "utf-8"
    await stream.prepare(request)
    return stream


async def _write_last(stream: web.StreamResponse, event: bytes) -> None:
    try:
        await stream.write(event)
        await stream.write(DONE)
        await stream.write_eof()
    except ConnectionResetError:
        pass  # nobody left to tell
