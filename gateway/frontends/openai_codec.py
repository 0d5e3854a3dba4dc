"""Body codec of the OpenAI-compatible API: request JSON -> what to generate, and
results -> OpenAI's response, chunk and list shapes.

A completion or chat request becomes a :class:`Generation`: its prompts (a
chat's messages rendered by ``gateway.frontends.openai_text.render_chat``,
or, to a model with a ``messages`` input, the messages themselves as JSON,
which its worker renders with the model's own chat template),
``n`` choices per prompt, streaming or not, and the :class:`Sampling` every
choice's request to the model carries. Each choice is one request to the
model (:func:`model_request`), on the generative contract: inputs
``text_input``, ``max_tokens``, ``temperature``, ``top_p``, ``seed``,
``stop`` where the model declares them (request parameters of the same
names where it does not); choice ``i`` of a seeded request gets ``seed + i``.
The model streams one token's bytes per response in ``text_output``; its
final response's parameters carry ``finish_reason``, ``prompt_tokens`` and
``completion_tokens``.

Log probabilities (``logprobs``; a chat's ``logprobs`` and ``top_logprobs``)
go to the model as the request parameter ``logprobs`` (how many
alternatives); each token's response carries its own as the parameter
``logprobs`` (JSON: ``token``, ``bytes``, ``logprob``, ``top_logprobs``),
which :func:`logprobs_json` puts in OpenAI's shape for completions or chat.

An embeddings request (:func:`embedding_request`) holds texts or token
ids. A model of the embedding contract (:func:`is_embedding_model`: input
``text_input`` BYTES and output ``embedding``; an encoder export) gets them
all in one request (:func:`embedding_model_request`): texts as the rows of
``text_input`` [n, 1], or token ids as the rows of ``input_ids`` with an
``attention_mask`` [n, longest]; it answers ``embedding`` FP32 [n, width]
and ``prompt_tokens`` INT32 [n, 1], and refuses what it cannot embed (too
long, out of its vocabulary) in its own words. ``truncate_prompt_tokens``
(vLLM's extension) goes to it as its input of that name, INT32 [n, 1].

Fields OpenAI defines that are not served here (tools, echo, suffix,
penalties, logit bias) are refused by name, never ignored.

May import: what ``gateway.frontends`` may import.
"""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import orjson

from gateway.frontends.openai_text import BadParameter, chat_messages, render_chat
from gateway.types import InferRequest, InferResponse, Tensor
from protos.codec import DATATYPES, deserialize_bytes_tensor, serialize_bytes_tensor
from protos.errors import Internal
from protos.triton_words import ENABLE_EMPTY_FINAL

Kind = Literal["completion", "chat"]
TEXT_OUTPUT = "text_output"
MAX_N = 16
MAX_STOPS = 4
DEFAULT_MAX_TOKENS = 16
MAX_LOGPROBS = 20
LOGPROBS = "logprobs"
MESSAGES = "messages"
# Fields of OpenAI's API that are refused when set to anything but their neutral value.
_UNSUPPORTED = {
    "echo": (None, False), "suffix": (None, ""),
    "best_of": (None, 1), "logit_bias": (None, {}), "tools": (None, []), "tool_choice": (None, "none"),
    "functions": (None, []), "function_call": (None, "none"), "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0), "response_format": (None, {"type": "text"}), "audio": (None,),
    "modalities": (None, ["text"]), "prediction": (None,),
}


@dataclass(frozen=True, slots=True)
class Sampling:
    """What every choice's model request carries; None: the model's default."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # an extension (vLLM's too): run to max_tokens, for measurements
    logprobs: int | None = None  # None: no log probabilities; else how many alternatives each token


@dataclass(frozen=True, slots=True)
class Generation:
    """A completion or chat request, decoded."""

    kind: Kind
    model: str
    prompts: tuple[str, ...]
    n: int
    stream: bool
    include_usage: bool
    sampling: Sampling
    messages: tuple[dict[str, Any], ...] | None = None  # a chat's messages, for a model that renders them

    def choices(self) -> list[tuple[int, str, int | None]]:
        """(index, prompt, seed) of every choice: prompt by prompt, ``n`` each; seeds ``seed + i``."""
        seed = self.sampling.seed
        out = []
        for p, prompt in enumerate(self.prompts):
            for i in range(self.n):
                out.append((p * self.n + i, prompt, None if seed is None else seed + i))
        return out


@dataclass(slots=True)
class Choice:
    """One choice's result as it is gathered."""

    index: int
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[dict[str, Any]] | None = None  # the tokens' entries, when asked for


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def json(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


# --- requests ----------------------------------------------------------------------------


def _model(doc: Mapping[str, Any]) -> str:
    model = doc.get("model")
    if not isinstance(model, str) or not model:
        raise BadParameter("'model' must be the name of a model (GET /v1/models lists them)", "model")
    return model


def _int(doc: Mapping[str, Any], key: str, low: int, high: int) -> int | None:
    value = doc.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise BadParameter(f"'{key}' must be an integer from {low} to {high}; got {value!r}", key)
    return value


def _number(doc: Mapping[str, Any], key: str, low: float, high: float, *, low_open: bool = False) -> float | None:
    value = doc.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high \
            or (low_open and value == low):
        shown = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise BadParameter(f"'{key}' must be a number in {shown}; got {value!r}", key)
    return float(value)


def _stop(doc: Mapping[str, Any]) -> tuple[str, ...]:
    value = doc.get("stop")
    if value is None:
        return ()
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values) or len(values) > MAX_STOPS:
        raise BadParameter(f"'stop' must be a string or a list of at most {MAX_STOPS} strings", "stop")
    return tuple(v for v in values if v)


def _refuse_unsupported(doc: Mapping[str, Any]) -> None:
    for key, neutral in _UNSUPPORTED.items():
        if key in doc and doc[key] not in neutral:
            raise BadParameter(f"'{key}' is not supported by this server", key)


def _stream(doc: Mapping[str, Any]) -> tuple[bool, bool]:
    stream = doc.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadParameter("'stream' must be true or false", "stream")
    options = doc.get("stream_options")
    if options is None:
        return bool(stream), False
    if not stream:
        raise BadParameter("'stream_options' is only allowed when 'stream' is true", "stream_options")
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise BadParameter("'stream_options' must be an object with a boolean 'include_usage'", "stream_options")
    return True, bool(options.get("include_usage", False))


def _logprobs(doc: Mapping[str, Any], kind: Kind) -> int | None:
    """How many alternatives each token's log probabilities name, or None when not asked for."""
    if kind == "completion":
        return _int(doc, "logprobs", 0, MAX_LOGPROBS)
    wanted = doc.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise BadParameter("'logprobs' must be true or false", "logprobs")
    top = _int(doc, "top_logprobs", 0, MAX_LOGPROBS)
    if top is not None and not wanted:
        raise BadParameter("'top_logprobs' needs 'logprobs' to be true", "top_logprobs")
    return (top or 0) if wanted else None


def _generation(doc: Mapping[str, Any], kind: Kind, prompts: tuple[str, ...], max_tokens: int | None,
                messages: tuple[dict[str, Any], ...] | None = None) -> Generation:
    _refuse_unsupported(doc)
    n = _int(doc, "n", 1, MAX_N)
    stream, include_usage = _stream(doc)
    seed = _int(doc, "seed", 0, 2**63 - 1)
    ignore_eos = doc.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise BadParameter("'ignore_eos' must be true or false", "ignore_eos")
    sampling = Sampling(max_tokens=max_tokens, temperature=_number(doc, "temperature", 0.0, 2.0),
                        top_p=_number(doc, "top_p", 0.0, 1.0, low_open=True), seed=seed, stop=_stop(doc),
                        ignore_eos=ignore_eos, logprobs=_logprobs(doc, kind))
    return Generation(kind, _model(doc), prompts, n or 1, stream, include_usage, sampling, messages)


def completion_request(doc: Mapping[str, Any]) -> Generation:
    """``POST /v1/completions``: ``prompt`` a string or a list of strings."""
    prompt = doc.get("prompt")
    prompts = (prompt,) if isinstance(prompt, str) else prompt
    if not isinstance(prompts, list | tuple) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise BadParameter("'prompt' must be a string or a non-empty list of strings (token ids are not "
                           "supported)", "prompt")
    max_tokens = _int(doc, "max_tokens", 1, 2**31 - 1)
    return _generation(doc, "completion", tuple(prompts), max_tokens)


def chat_request(doc: Mapping[str, Any]) -> Generation:
    """``POST /v1/chat/completions``: ``messages`` rendered into one prompt."""
    max_tokens = _int(doc, "max_completion_tokens", 1, 2**31 - 1)
    if max_tokens is None:
        max_tokens = _int(doc, "max_tokens", 1, 2**31 - 1)
    messages = chat_messages(doc.get("messages"))
    return _generation(doc, "chat", (render_chat(list(messages)),), max_tokens, messages)


def _tensor(name: str, datatype: str, values: np.ndarray, batched: bool) -> Tensor:
    shape = (1, values.size) if batched else (values.size,)
    data = serialize_bytes_tensor(values) if datatype == "BYTES" else values.tobytes()
    return Tensor(name=name, datatype=datatype, shape=shape, data=data)


def model_request(generation: Generation, prompt: str, seed: int | None, *, inputs: Mapping[str, str],
                  batched: bool, request_id: str) -> InferRequest:
    """One choice's request to the model, whose inputs are ``inputs`` (name -> datatype).

    ``batched``: the model has a batch dimension (``max_batch_size > 0``). A chat to a model with a
    ``messages`` input sends the messages (JSON), which the model renders with its own template.
    """
    if "text_input" not in inputs:
        raise BadParameter(f"model '{generation.model}' is not a text generation model (it has no input "
                           "'text_input')", "model")
    s = generation.sampling
    values: dict[str, Any] = {"max_tokens": s.max_tokens, "temperature": s.temperature, "top_p": s.top_p,
                              "seed": seed}
    if generation.messages is not None and inputs.get(MESSAGES) == "BYTES":
        text = orjson.dumps(list(generation.messages))
        tensors = [_tensor(MESSAGES, "BYTES", np.array([text], dtype=np.object_), batched)]
    else:
        tensors = [_tensor("text_input", "BYTES", np.array([prompt.encode("utf-8")], dtype=np.object_), batched)]
    parameters: dict[str, Any] = {ENABLE_EMPTY_FINAL: True}
    if s.logprobs is not None:
        parameters[LOGPROBS] = s.logprobs
    if s.ignore_eos:
        parameters["ignore_eos"] = True
    for name, value in values.items():
        if value is None:
            continue
        datatype = inputs.get(name)
        if datatype is None or datatype == "BYTES":
            parameters[name] = value
            continue
        tensors.append(_tensor(name, datatype, np.array([value], dtype=DATATYPES[datatype]), batched))
    if s.stop:
        if inputs.get("stop") == "BYTES":
            tensors.append(_tensor("stop", "BYTES", np.array([v.encode("utf-8") for v in s.stop], dtype=np.object_),
                                   batched))
        else:
            parameters["stop"] = s.stop[0]  # a parameter holds one string; the gateway matches them all
    return InferRequest(model=generation.model, version="", id=request_id, inputs=tensors, outputs=[],
                        parameters=parameters)


# --- a model's responses -------------------------------------------------------------------


def token_bytes(response: InferResponse) -> bytes:
    """The bytes a streamed response carries in ``text_output`` (b"" when none)."""
    for tensor in response.outputs:
        if tensor.name == TEXT_OUTPUT:
            if tensor.datatype != "BYTES":
                return bytes(tensor.data)
            return b"".join(bytes(v) for v in deserialize_bytes_tensor(bytes(tensor.data)).reshape(-1))
    return b""


def token_logprobs(response: InferResponse) -> dict[str, Any] | None:
    """The log probabilities a token's response carries (its parameter ``logprobs``), or None."""
    value = response.parameters.get(LOGPROBS)
    if not isinstance(value, str):
        return None
    try:
        entry = orjson.loads(value)
    except orjson.JSONDecodeError:
        return None
    return entry if isinstance(entry, dict) else None


def _top_dict(entry: Mapping[str, Any]) -> dict[str, float]:
    """A completion's alternatives, token text -> log probability; of tokens with the same text
    (parts of characters) the likeliest is kept."""
    top: dict[str, float] = {}
    for t in entry.get("top_logprobs", ()):
        top.setdefault(t.get("token", ""), t.get("logprob", 0.0))
    return top


def logprobs_json(g: Generation, entries: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """Tokens' log probabilities in OpenAI's shape: a chat's ``content`` list, a completion's
    parallel lists (``text_offset`` from each entry's ``offset`` in the choice's text)."""
    if g.sampling.logprobs is None:
        return None
    if g.kind == "chat":
        def item(e: Mapping[str, Any]) -> dict[str, Any]:
            return {"token": e.get("token", ""), "logprob": e.get("logprob", 0.0), "bytes": e.get("bytes")}

        return {"content": [{**item(e), "top_logprobs": [item(t) for t in e.get("top_logprobs", ())]}
                            for e in entries], "refusal": None}
    return {"tokens": [e.get("token", "") for e in entries],
            "token_logprobs": [e.get("logprob", 0.0) for e in entries],
            "top_logprobs": [_top_dict(e) for e in entries],
            "text_offset": [e.get("offset", 0) for e in entries]}


def final_counts(response: InferResponse) -> tuple[str | None, int | None, int | None]:
    """``finish_reason``, ``prompt_tokens``, ``completion_tokens`` of a final response (None: not sent)."""
    params = response.parameters
    reason = params.get("finish_reason")
    prompt = params.get("prompt_tokens")
    completion = params.get("completion_tokens")
    return (reason if isinstance(reason, str) else None, prompt if isinstance(prompt, int) else None,
            completion if isinstance(completion, int) else None)


# --- responses -------------------------------------------------------------------------------


def response_id(kind: Kind) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def now_s() -> int:
    return int(time.time())


def completion_json(g: Generation, rid: str, created: int, choices: Sequence[Choice], usage: Usage) -> dict[str, Any]:
    """The whole answer of a request that does not stream."""
    if g.kind == "chat":
        body = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                 "logprobs": logprobs_json(g, c.logprobs or ()), "finish_reason": c.finish_reason} for c in choices]
        return {"id": rid, "object": "chat.completion", "created": created, "model": g.model, "choices": body,
                "usage": usage.json()}
    body = [{"index": c.index, "text": c.text, "logprobs": logprobs_json(g, c.logprobs or ()),
             "finish_reason": c.finish_reason} for c in choices]
    return {"id": rid, "object": "text_completion", "created": created, "model": g.model, "choices": body,
            "usage": usage.json()}


def chunk_json(g: Generation, rid: str, created: int, index: int, text: str | None,
               finish_reason: str | None = None, *, first: bool = False,
               logprobs: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:  # fmt: skip
    """One streamed chunk of choice ``index``: new ``text``, or its end (``finish_reason``).

    A chat's first chunk of a choice carries the assistant's role; its last an
    empty delta. With ``include_usage`` every chunk has ``"usage": null``.
    """
    if g.kind == "chat":
        delta: dict[str, Any] = {"role": "assistant", "content": text or ""} if first else \
            ({"content": text} if text is not None else {})
        choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs_json(g, logprobs) if text or logprobs else None,
                                  "finish_reason": finish_reason}
        doc = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": g.model,
               "choices": [choice]}
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs_json(g, logprobs) if text or logprobs else None,
                  "finish_reason": finish_reason}
        doc = {"id": rid, "object": "text_completion", "created": created, "model": g.model, "choices": [choice]}
    if g.include_usage:
        doc["usage"] = None
    return doc


def usage_chunk_json(g: Generation, rid: str, created: int, usage: Usage) -> dict[str, Any]:
    """The chunk before ``[DONE]`` when ``stream_options.include_usage``: no choices, the usage."""
    obj = "chat.completion.chunk" if g.kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": g.model, "choices": [], "usage": usage.json()}


def models_json(names: Sequence[str], created: int = 0) -> dict[str, Any]:
    """``GET /v1/models``: OpenAI's list shape."""
    return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "infergate"}
                                       for name in names]}


# --- embeddings -------------------------------------------------------------------------------


# The embedding contract (an encoder export's, execution.backends.hf_encoder): texts or token ids a
# row in, one vector and its token count a row out.
EMBED_TEXT, EMBED_IDS, EMBED_MASK = "text_input", "input_ids", "attention_mask"
EMBEDDING, EMBED_TOKENS = "embedding", "prompt_tokens"
MAX_EMBEDDING_INPUTS = 2048  # OpenAI's bound on the inputs of one request
TRUNCATE = "truncate_prompt_tokens"  # an extension (vLLM's name): cut long inputs instead of refusing them


@dataclass(frozen=True, slots=True)
class EmbeddingRequest:
    model: str
    inputs: tuple[str, ...] | tuple[tuple[int, ...], ...]  # texts, or token ids of each input
    base64: bool
    dimensions: int | None = None  # None: the model's own
    truncate: int | None = None  # None: refuse a long input; -1: cut it to the model's limit; else to so many tokens

    @property
    def texts(self) -> bool:
        return bool(self.inputs) and isinstance(self.inputs[0], str)

    def byte_ids(self) -> tuple[tuple[int, ...], ...]:
        """Each input as token ids, a text as its UTF-8 bytes (the example encoder's vocabulary)."""
        return tuple(tuple(i.encode("utf-8")) if isinstance(i, str) else i for i in self.inputs)


def embedding_request(doc: Mapping[str, Any]) -> EmbeddingRequest:
    """``POST /v1/embeddings``: ``input`` a string, a list of strings, token ids or lists of them."""
    model = _model(doc)
    raw = doc.get("input")
    items: list[Any] = [raw] if isinstance(raw, str) else raw if isinstance(raw, list) else []
    if items and all(isinstance(v, int) and not isinstance(v, bool) for v in items):
        items = [items]
    inputs: tuple[Any, ...] = ()
    if items and all(isinstance(i, str) and i for i in items):
        inputs = tuple(items)
    elif items and all(isinstance(i, list) and i and all(isinstance(v, int) and not isinstance(v, bool) for v in i)
                       for i in items):
        if any(v < 0 for i in items for v in i):
            raise BadParameter("'input' holds a negative token id", "input")
        inputs = tuple(tuple(i) for i in items)
    if not inputs:
        raise BadParameter("'input' must be a non-empty string, a list of them, token ids or a list of lists of "
                           "them", "input")
    if len(inputs) > MAX_EMBEDDING_INPUTS:
        raise BadParameter(f"'input' holds {len(inputs)} inputs; at most {MAX_EMBEDDING_INPUTS} in one request",
                           "input")
    encoding = doc.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise BadParameter("'encoding_format' must be 'float' or 'base64'", "encoding_format")
    truncate = doc.get(TRUNCATE)
    if truncate is not None and (isinstance(truncate, bool) or not isinstance(truncate, int) or truncate == 0
                                 or truncate < -1):
        raise BadParameter(f"'{TRUNCATE}' must be -1 (the model's limit) or a positive number of tokens", TRUNCATE)
    return EmbeddingRequest(model, inputs, encoding == "base64", _int(doc, "dimensions", 1, 2**31 - 1), truncate)


def check_dimensions(request: EmbeddingRequest, width: int) -> None:
    """``dimensions`` as OpenAI treats it for a model not trained to be shortened: refused, unless it
    is the model's own width."""
    if request.dimensions is not None and request.dimensions != width:
        raise BadParameter(f"model '{request.model}' gives embeddings of {width} dimensions and does not support "
                           f"'dimensions' {request.dimensions} (it was not trained to be shortened)", "dimensions")


def is_embedding_model(inputs: Mapping[str, str], outputs: Sequence[str]) -> bool:
    """Whether a model (its inputs, name -> datatype, and outputs) speaks the embedding contract."""
    return inputs.get(EMBED_TEXT) == "BYTES" and EMBEDDING in outputs


def embedding_model_request(request: EmbeddingRequest, *, request_id: str) -> InferRequest:
    """Every input of ``request`` in one request to a model of the embedding contract: texts as the
    rows of ``text_input``, or token ids as the rows of ``input_ids`` (padded, ``attention_mask``
    marking each row's own)."""
    rows = len(request.inputs)
    if request.texts:
        texts = np.array([t.encode("utf-8") for t in request.inputs if isinstance(t, str)], dtype=np.object_)
        tensors = [Tensor(EMBED_TEXT, "BYTES", (rows, 1), serialize_bytes_tensor(texts))]
    else:
        longest = max(len(ids) for ids in request.inputs)
        ids = np.zeros((rows, longest), np.int64)
        mask = np.zeros((rows, longest), np.int64)
        for row, values in enumerate(request.inputs):
            ids[row, :len(values)] = values
            mask[row, :len(values)] = 1
        tensors = [Tensor(EMBED_IDS, "INT64", (rows, longest), ids.tobytes()),
                   Tensor(EMBED_MASK, "INT64", (rows, longest), mask.tobytes())]
    if request.truncate is not None:
        tensors.append(Tensor(TRUNCATE, "INT32", (rows, 1), np.full(rows, request.truncate, np.int32).tobytes()))
    return InferRequest(model=request.model, version="", id=request_id, inputs=tensors, outputs=[])


def embedding_vectors(request: EmbeddingRequest, response: InferResponse) -> tuple[list[np.ndarray], int]:
    """A model's answer on the embedding contract: one vector an input, and the tokens they took."""
    outputs = {t.name: t for t in response.outputs}
    vectors, tokens = outputs.get(EMBEDDING), outputs.get(EMBED_TOKENS)
    rows = len(request.inputs)
    if vectors is None or vectors.datatype != "FP32" or len(vectors.shape) != 2 or vectors.shape[0] != rows:
        raise Internal(f"model '{request.model}' answered no FP32 '{EMBEDDING}' [{rows}, width]")
    array = np.frombuffer(vectors.data, dtype=np.float32).reshape(vectors.shape)
    counted = 0
    if tokens is not None and tokens.datatype == "INT32":
        counted = int(np.frombuffer(tokens.data, dtype=np.int32).sum())
    return list(array), counted


def mean_pool(hidden: Tensor) -> np.ndarray:
    """HIDDEN [.., tokens, width] FP32 -> the mean over tokens, [width]."""
    array = np.frombuffer(hidden.data, dtype=np.float32).reshape(hidden.shape)
    return array.reshape(-1, array.shape[-1]).mean(axis=0, dtype=np.float32)


def embeddings_json(request: EmbeddingRequest, vectors: Sequence[np.ndarray], prompt_tokens: int) -> dict[str, Any]:
    data = []
    for index, vector in enumerate(vectors):
        values: Any = (base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii") if request.base64
                       else vector.astype(np.float32).tolist())
        data.append({"object": "embedding", "index": index, "embedding": values})
    return {"object": "list", "data": data, "model": request.model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}
