"""The generative contract, spoken to an OpenAI-protocol server: a request of it
as an OpenAI call, and the server's streamed chunks as its responses.

A model of such a server is presented as infergate's generation backend
presents a Hugging Face export (``execution.backends.hf_export``): inputs
``text_input`` or ``messages`` (a chat, JSON), ``max_tokens``,
``temperature``, ``top_p``, ``seed``, ``stop``; output ``text_output``, one
piece of text per response; decoupled; the last response's parameters
``finish_reason``, ``prompt_tokens``, ``completion_tokens``
(:func:`model_config`). So an infergate worker and an OpenAI server serve one
model name in one pool, and every frontend reaches both (the OpenAI API,
KServe's generate extension, a gRPC stream).

- :func:`openai_call`: a request -> the path and JSON body: a chat (input
  ``messages``) to ``/v1/chat/completions``, a prompt to ``/v1/completions``;
  always streamed, with usage. Sampling fields are read from the inputs of
  those names, else from the request's parameters (the frontends send a
  field one way or the other); ``logprobs`` and ``ignore_eos`` are
  parameters.
- embeddings: a request whose parameter ``embedding_request`` holds an
  OpenAI embeddings request's JSON (``input`` and the fields beside it, but
  ``model``), with no inputs, is a ``/v1/embeddings`` call, not streamed;
  its one response carries the server's answer, as it is, in the output
  ``embedding_answer`` (:func:`embedding_response`), then the final one
  with its token count. Neither is part of the config (whose signature an
  infergate worker's export shares in one pool). A model that does not
  embed says so in the server's words (a 4xx).
- a continuation (``gateway.routing.resume``): parameters ``resume_text``
  (the text already sent) and ``resume_tokens`` (its tokens, one per
  response sent) make the call go on from there: a prompt gets the text
  appended, a chat gets it as a final assistant message to continue
  (``continue_final_message``, ``add_generation_prompt: false``: vLLM's and
  SGLang's extension of the chat API; a server without it refuses or
  ignores the fields); ``max_tokens`` less the tokens sent; the final
  usage counts the whole generation (the text's tokens move from the
  prompt's count to the completion's).
- :class:`ChunkReader`: each of the server's chunks (one SSE ``data:``
  event, or a whole JSON answer) -> the responses it makes: its text in
  ``text_output`` (split token by token when it carries the tokens' log
  probabilities), and at the end one final response with the finish reason
  and the usage the server counted.

Pure functions and a small state machine, tested without sockets.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import orjson
from tritonclient.grpc import model_config_pb2 as mc
from tritonclient.grpc import service_pb2

from protos.codec import decode, serialize_bytes_tensor
from protos.errors import InferGateError, InvalidArgument
from protos.generation_tokens import RESUME_TEXT, RESUME_TOKENS
from protos.triton_words import set_final

BACKEND = "openai"
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
EMBEDDINGS_PATH = "/v1/embeddings"
TEXT_OUTPUT = "text_output"
EMBEDDING_REQUEST = "embedding_request"  # parameter: an embeddings request's JSON, but its model
EMBEDDING_ANSWER = "embedding_answer"  # the server's answer to it, as it is
MAX_SEQUENCES = "max_sequences"
# The generation backend's inputs of a Hugging Face export, in its order (execution.backends.hf_export).
_INPUTS = (("text_input", mc.TYPE_STRING, [1]), ("messages", mc.TYPE_STRING, [1]), ("max_tokens", mc.TYPE_INT32, [1]),
           ("temperature", mc.TYPE_FP32, [1]), ("top_p", mc.TYPE_FP32, [1]), ("seed", mc.TYPE_UINT64, [1]),
           ("stop", mc.TYPE_STRING, [-1]))
_DATATYPES = {mc.TYPE_STRING: "BYTES", mc.TYPE_INT32: "INT32", mc.TYPE_FP32: "FP32", mc.TYPE_UINT64: "UINT64"}


def model_config(name: str, max_streams: int) -> mc.ModelConfig:
    """The config a model of an OpenAI server is served with (``max_streams``: its streams at once)."""
    config = mc.ModelConfig(name=name, backend=BACKEND, max_batch_size=0)
    config.model_transaction_policy.decoupled = True
    for input_name, data_type, dims in _INPUTS:
        tensor = config.input.add(name=input_name, data_type=data_type, optional=True)
        tensor.dims.extend(dims)
    config.output.add(name=TEXT_OUTPUT, data_type=mc.TYPE_STRING, dims=[1])
    config.parameters[MAX_SEQUENCES].string_value = str(max_streams)
    return config


def model_metadata(config: mc.ModelConfig, versions: list[str]) -> service_pb2.ModelMetadataResponse:
    response = service_pb2.ModelMetadataResponse(name=config.name, versions=versions, platform=BACKEND)
    for tensor in config.input:
        response.inputs.add(name=tensor.name, datatype=_DATATYPES[tensor.data_type], shape=list(tensor.dims))
    for tensor in config.output:
        response.outputs.add(name=tensor.name, datatype=_DATATYPES[tensor.data_type], shape=list(tensor.dims))
    return response


# --- a request as an OpenAI call ---------------------------------------------------------


def _inputs(request: service_pb2.ModelInferRequest) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    raws = request.raw_input_contents
    for i, tensor in enumerate(request.inputs):
        if raws:
            if i >= len(raws):
                raise InvalidArgument(f"input '{tensor.name}' has no raw contents")
            out[tensor.name] = decode(tensor.datatype, list(tensor.shape), raws[i], name=tensor.name)
            continue
        contents = tensor.contents
        values: list[Any] = list(contents.bytes_contents or contents.int_contents or contents.int64_contents
                                 or contents.uint64_contents or contents.fp32_contents or contents.fp64_contents)
        out[tensor.name] = np.array(values, dtype=np.object_ if tensor.datatype == "BYTES" else None)
    return out


def _parameters(request: service_pb2.ModelInferRequest) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, param in request.parameters.items():
        which = param.WhichOneof("parameter_choice")
        if which is not None:
            out[key] = getattr(param, which)
    return out


def _text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _scalar(inputs: Mapping[str, np.ndarray], parameters: Mapping[str, Any], name: str) -> Any:
    if name in inputs:
        values = inputs[name].reshape(-1)
        if values.size:
            value = values[0]
            return value.item() if isinstance(value, np.generic) else value
    return parameters.get(name)


def openai_call(request: service_pb2.ModelInferRequest, model: str) -> tuple[str, dict[str, Any]]:
    """The path and body of the OpenAI call that serves ``request`` as ``model`` (the server's name)."""
    inputs, parameters = _inputs(request), _parameters(request)
    if EMBEDDING_REQUEST in parameters:
        try:
            fields = orjson.loads(_text(parameters[EMBEDDING_REQUEST]))
        except orjson.JSONDecodeError as exc:
            raise InvalidArgument(f"parameter '{EMBEDDING_REQUEST}' is not JSON: {exc}") from None
        if not isinstance(fields, dict) or "input" not in fields:
            raise InvalidArgument(f"parameter '{EMBEDDING_REQUEST}' must be a JSON object with 'input'")
        return EMBEDDINGS_PATH, {**fields, "model": model}
    body: dict[str, Any] = {"model": model, "stream": True, "stream_options": {"include_usage": True}}
    if "messages" in inputs:
        if "text_input" in inputs:
            raise InvalidArgument("send either 'text_input' (a prompt) or 'messages' (a chat), not both")
        try:
            messages = orjson.loads(_text(inputs["messages"].reshape(-1)[0]))
        except (orjson.JSONDecodeError, IndexError) as exc:
            raise InvalidArgument(f"input 'messages' is not JSON: {exc}") from None
        if not isinstance(messages, list) or not messages:
            raise InvalidArgument("input 'messages' must be a JSON list of message objects")
        path, body["messages"] = CHAT_PATH, messages
    else:
        prompt = _scalar(inputs, parameters, "text_input")
        if prompt is None:
            raise InvalidArgument("the request needs 'text_input' (a prompt) or 'messages' (a chat)")
        path, body["prompt"] = COMPLETIONS_PATH, _text(prompt)
    for name in ("max_tokens", "temperature", "top_p", "seed"):
        value = _scalar(inputs, parameters, name)
        if value is not None:
            body[name] = value
    if RESUME_TEXT in parameters:
        _continue(body, _text(parameters[RESUME_TEXT]), resumed_tokens(request))
    if "stop" in inputs:
        stops = [_text(v) for v in inputs["stop"].reshape(-1) if _text(v)]
    else:
        stop = parameters.get("stop")
        stops = [stop] if isinstance(stop, str) and stop else []
    if stops:
        body["stop"] = stops
    logprobs = parameters.get("logprobs")
    if isinstance(logprobs, int) and not isinstance(logprobs, bool) and logprobs >= 0:
        if path == CHAT_PATH:
            body["logprobs"], body["top_logprobs"] = True, logprobs
        else:
            body["logprobs"] = logprobs
    if parameters.get("ignore_eos") is True:
        body["ignore_eos"] = True  # vLLM's and SGLang's extension; others may refuse it by name
    return path, body


def resumed_tokens(request: service_pb2.ModelInferRequest) -> int:
    """The tokens a continuation's text already counts (0 for a first call)."""
    param = request.parameters.get(RESUME_TOKENS)
    return max(0, param.int64_param) if param is not None else 0


def _continue(body: dict[str, Any], text: str, tokens: int) -> None:
    """``body`` made to go on after ``text`` (``tokens`` of it), as the same generation."""
    if "messages" in body:
        body["messages"] = [*body["messages"], {"role": "assistant", "content": text}]
        body["continue_final_message"], body["add_generation_prompt"] = True, False
    else:
        body["prompt"] += text
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, int) and not isinstance(max_tokens, bool):
        body["max_tokens"] = max(1, max_tokens - tokens)


# --- the server's chunks as responses ----------------------------------------------------


def text_response(request: service_pb2.ModelInferRequest, text: bytes,
                  logprobs: Mapping[str, Any] | None = None) -> service_pb2.ModelInferResponse:
    """One piece of generated text, as the generation backend streams a token."""
    response = service_pb2.ModelInferResponse(model_name=request.model_name, model_version=request.model_version,
                                              id=request.id)
    response.outputs.add(name=TEXT_OUTPUT, datatype="BYTES", shape=[1])
    response.raw_output_contents.append(serialize_bytes_tensor(np.array([text], dtype=np.object_)))
    if logprobs is not None:
        response.parameters["logprobs"].string_param = orjson.dumps(logprobs).decode()
    return response


def embedding_response(request: service_pb2.ModelInferRequest, answer: bytes,
                       error: Any) -> tuple[service_pb2.ModelInferResponse, int | None]:  # fmt: skip
    """The server's embeddings answer as it is, and the prompt tokens its usage counts; ``error``
    ((status, message) -> the error it means) for an answer that is no embeddings answer."""
    try:
        doc = orjson.loads(answer)
    except orjson.JSONDecodeError:
        raise error(502, f"the server's embeddings answer is not JSON: {answer[:200]!r}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), list):
        raise error(502, f"the server's embeddings answer has no 'data' list: {answer[:200]!r}")
    usage = doc.get("usage")
    response = service_pb2.ModelInferResponse(model_name=request.model_name, model_version=request.model_version,
                                              id=request.id)
    response.outputs.add(name=EMBEDDING_ANSWER, datatype="BYTES", shape=[1])
    response.raw_output_contents.append(serialize_bytes_tensor(np.array([answer], dtype=np.object_)))
    return response, _count(usage, "prompt_tokens") if isinstance(usage, dict) else None


def final_response(request: service_pb2.ModelInferRequest, finish_reason: str | None, prompt_tokens: int | None,
                   completion_tokens: int | None) -> service_pb2.ModelInferResponse:
    """The end of a generation: no outputs; why it ended and what it counted, where the server said."""
    response = service_pb2.ModelInferResponse(model_name=request.model_name, model_version=request.model_version,
                                              id=request.id)
    if finish_reason is not None:
        response.parameters["finish_reason"].string_param = finish_reason
    if prompt_tokens is not None:
        response.parameters["prompt_tokens"].int64_param = prompt_tokens
    if completion_tokens is not None:
        response.parameters["completion_tokens"].int64_param = completion_tokens
    set_final(response, True)
    return response


def _count(usage: Mapping[str, Any], key: str) -> int | None:
    value = usage.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _token_entries(choice: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A chunk's log probabilities as the generation backend's entries (token, bytes, logprob, top_logprobs)."""
    logprobs = choice.get("logprobs")
    if not isinstance(logprobs, dict):
        return []
    content = logprobs.get("content")
    if isinstance(content, list):  # a chat's
        return [{"token": e.get("token", ""), "bytes": e.get("bytes"), "logprob": e.get("logprob", 0.0),
                 "top_logprobs": [{"token": t.get("token", ""), "bytes": t.get("bytes"),
                                   "logprob": t.get("logprob", 0.0)} for t in e.get("top_logprobs") or ()]}
                for e in content if isinstance(e, dict)]
    tokens, values = logprobs.get("tokens"), logprobs.get("token_logprobs")
    if isinstance(tokens, list) and isinstance(values, list):  # a completion's
        tops = logprobs.get("top_logprobs") or [None] * len(tokens)
        return [{"token": t, "bytes": list(str(t).encode()), "logprob": v if v is not None else 0.0,
                 "top_logprobs": [{"token": k, "bytes": list(str(k).encode()), "logprob": p}
                                  for k, p in (top or {}).items()]}
                for t, v, top in zip(tokens, values, tops)]
    return []


class ChunkReader:
    """Turns one call's chunks into responses; :meth:`final` once the call has ended."""

    def __init__(self, request: service_pb2.ModelInferRequest, error: Any) -> None:
        self._request = request
        self._error = error  # (status, message) -> the InferGateError it means
        self.finish_reason: str | None = None
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.done = False  # the server's "[DONE]" came

    def event(self, data: bytes) -> list[service_pb2.ModelInferResponse]:
        """The responses one SSE event's data makes (none for a role-only or usage-only chunk)."""
        data = data.strip()
        if data == b"[DONE]":
            self.done = True
            return []
        try:
            doc = orjson.loads(data)
        except orjson.JSONDecodeError:
            raise self._error(502, f"the server sent a chunk that is not JSON: {data[:200]!r}") from None
        if not isinstance(doc, dict):
            raise self._error(502, f"the server sent a chunk that is no JSON object: {data[:200]!r}")
        return self.chunk(doc)

    def chunk(self, doc: Mapping[str, Any]) -> list[service_pb2.ModelInferResponse]:
        """The responses of one chunk (or of a whole answer: a ``message`` in place of a ``delta``)."""
        error = doc.get("error")
        if error is not None:
            raise self._in_stream_error(error)
        usage = doc.get("usage")
        if isinstance(usage, dict):
            self.prompt_tokens = _count(usage, "prompt_tokens")
            self.completion_tokens = _count(usage, "completion_tokens")
        out: list[service_pb2.ModelInferResponse] = []
        for choice in doc.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            part = choice.get("delta") or choice.get("message")
            text = part.get("content") if isinstance(part, dict) else choice.get("text")
            text = text if isinstance(text, str) else ""
            entries = _token_entries(choice)
            if entries and "".join(str(e["token"]) for e in entries) == text:
                out.extend(text_response(self._request, str(e["token"]).encode(), e) for e in entries)
            elif text:
                out.append(text_response(self._request, text.encode()))
            reason = choice.get("finish_reason")
            if isinstance(reason, str) and reason:
                self.finish_reason = reason
        return out

    def _in_stream_error(self, error: Any) -> InferGateError:
        if isinstance(error, dict):
            code = error.get("code")
            status = code if isinstance(code, int) and 400 <= code < 600 else 500
            return self._error(status, str(error.get("message") or error))
        return self._error(500, str(error))

    def final(self) -> service_pb2.ModelInferResponse:
        prompt, completion = self.prompt_tokens, self.completion_tokens
        resumed = resumed_tokens(self._request)
        if resumed:  # a continuation: the text sent before was counted in its prompt
            prompt = None if prompt is None else max(0, prompt - resumed)
            completion = None if completion is None else completion + resumed
        return final_response(self._request, self.finish_reason, prompt, completion)
