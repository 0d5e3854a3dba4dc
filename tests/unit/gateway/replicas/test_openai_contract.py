"""The generative contract spoken to an OpenAI-protocol server, without sockets:
requests as OpenAI calls, chunks as responses, errors by status, metrics as
load, and the ``workers`` entries that name such a server."""

from __future__ import annotations

import numpy as np
import orjson
import pytest
from tritonclient.grpc import service_pb2

from gateway.replicas.errors import WorkerBusy
from gateway.replicas.openai_contract import (CHAT_PATH, COMPLETIONS_PATH, EMBEDDING_ANSWER, EMBEDDING_REQUEST,
                                              EMBEDDINGS_PATH, ChunkReader, embedding_response, model_config,
                                              model_metadata, openai_call)
from gateway.replicas.openai_server import OpenAIServer
from gateway.replicas.server_metrics import server_load
from gateway.settings import ConfigError, WorkerSpec
from protos.codec import deserialize_bytes_tensor, serialize_bytes_tensor
from protos.errors import Internal, InvalidArgument, ModelNotFound, NotFound, Unavailable
from protos.generation_tokens import RESUME_TEXT, RESUME_TOKENS
from protos.triton_words import is_final


def _request(**inputs: object) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="m", id="r1")
    for name, value in inputs.items():
        if isinstance(value, (str, list)):
            values = value if isinstance(value, list) else [value]
            request.inputs.add(name=name, datatype="BYTES", shape=[len(values)])
            request.raw_input_contents.append(serialize_bytes_tensor(np.array([v.encode() for v in values],
                                                                              dtype=np.object_)))
        else:
            datatype, dtype = ("FP32", np.float32) if isinstance(value, float) else ("INT32", np.int32)
            request.inputs.add(name=name, datatype=datatype, shape=[1])
            request.raw_input_contents.append(np.array([value], dtype=dtype).tobytes())
    return request


def test_a_chat_goes_as_its_messages_with_the_sampling_fields() -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    request = _request(messages=orjson.dumps(messages).decode(), max_tokens=5, temperature=0.5,
                       stop=["a", "b"])
    request.parameters["seed"].int64_param = 7
    request.parameters["logprobs"].int64_param = 2
    path, body = openai_call(request, "served-name")
    assert path == CHAT_PATH
    assert body == {"model": "served-name", "stream": True, "stream_options": {"include_usage": True},
                    "messages": messages, "max_tokens": 5, "temperature": 0.5, "seed": 7, "stop": ["a", "b"],
                    "logprobs": True, "top_logprobs": 2}


def test_a_continuation_goes_on_after_the_text_sent_and_counts_the_whole_generation() -> None:
    request = _request(text_input="once upon", max_tokens=6)
    request.parameters[RESUME_TEXT].string_param = " a time"
    request.parameters[RESUME_TOKENS].int64_param = 2
    path, body = openai_call(request, "m")
    assert (path, body["prompt"], body["max_tokens"]) == (COMPLETIONS_PATH, "once upon a time", 4)
    messages = [{"role": "user", "content": "hi"}]
    chat = _request(messages=orjson.dumps(messages).decode())  # no max_tokens: none is sent
    chat.parameters[RESUME_TEXT].string_param = "Hel"
    chat.parameters[RESUME_TOKENS].int64_param = 1
    path, body = openai_call(chat, "m")
    assert path == CHAT_PATH and "max_tokens" not in body
    assert body["messages"] == [*messages, {"role": "assistant", "content": "Hel"}]
    assert (body["continue_final_message"], body["add_generation_prompt"]) == (True, False)
    # The server counted the text sent in its prompt; the final response moves it to the completion.
    reader = ChunkReader(request, OpenAIServer("h:1").error)
    reader.chunk({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4}})
    final = reader.final()
    assert (final.parameters["prompt_tokens"].int64_param, final.parameters["completion_tokens"].int64_param) == (3, 6)


def test_a_prompt_goes_as_a_completion() -> None:
    request = _request(text_input="once upon")
    request.parameters["stop"].string_param = "."
    request.parameters["ignore_eos"].bool_param = True
    path, body = openai_call(request, "m")
    assert path == COMPLETIONS_PATH
    assert (body["prompt"], body["stop"], body["ignore_eos"]) == ("once upon", ["."], True)
    with pytest.raises(InvalidArgument, match="text_input"):
        openai_call(_request(max_tokens=3), "m")


def _text(response: service_pb2.ModelInferResponse) -> bytes:
    (value,) = deserialize_bytes_tensor(response.raw_output_contents[0])
    return bytes(value)


def test_chunks_become_responses_and_usage_the_final_one() -> None:
    server = OpenAIServer("h:1")
    reader = ChunkReader(_request(text_input="x"), server.error)
    assert reader.event(b'{"choices":[{"index":0,"delta":{"role":"assistant"}}]}') == []
    (one,) = reader.event(b'{"choices":[{"index":0,"delta":{"content":"Hel"}}]}')
    assert _text(one) == b"Hel" and not is_final(one)
    (two,) = reader.event(b'{"choices":[{"index":0,"text":"lo","finish_reason":"length"}]}')
    assert _text(two) == b"lo"
    assert reader.event(b'{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}') == []
    assert reader.event(b"[DONE]") == [] and reader.done
    final = reader.final()
    assert is_final(final) and not final.outputs
    assert final.parameters["finish_reason"].string_param == "length"
    assert (final.parameters["prompt_tokens"].int64_param, final.parameters["completion_tokens"].int64_param) == (3, 2)


def test_a_chunk_with_log_probabilities_is_split_token_by_token() -> None:
    reader = ChunkReader(_request(text_input="x"), OpenAIServer("h:1").error)
    chunk = {"choices": [{"index": 0, "delta": {"content": "ab"}, "logprobs": {"content": [
        {"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": [{"token": "a", "logprob": -0.5, "bytes": [97]}]},
        {"token": "b", "logprob": -1.0, "bytes": [98], "top_logprobs": []}]}}]}
    first, second = reader.chunk(chunk)
    assert (_text(first), _text(second)) == (b"a", b"b")
    assert orjson.loads(first.parameters["logprobs"].string_param)["logprob"] == -0.5


def test_an_in_stream_error_and_a_chunk_that_is_no_json() -> None:
    reader = ChunkReader(_request(text_input="x"), OpenAIServer("h:1").error)
    with pytest.raises(InvalidArgument, match="too long"):
        reader.event(b'{"error":{"message":"too long","code":400}}')
    with pytest.raises(Unavailable, match="not JSON"):
        reader.event(b"<html>")


@pytest.mark.parametrize(("status", "message", "kind"), [
    (400, "max_tokens is too large", InvalidArgument), (422, "bad field", InvalidArgument),
    (404, "The model `x` does not exist.", ModelNotFound), (404, "Not Found", NotFound),
    (500, "boom", Internal), (502, "bad gateway", Unavailable), (503, "down", Unavailable),
    (429, "slow down", WorkerBusy),
])
def test_statuses_as_error_classes(status: int, message: str, kind: type) -> None:
    error = OpenAIServer("h:1").error(status, message, "3", "POST /v1/completions")
    assert type(error) is kind
    assert message in error.message
    if status < 500 and status != 429:
        assert error.http_status < 500  # the request's fault: a 4xx class, charged to no one
    if kind is WorkerBusy:
        assert error.retry_after_s == 3.0


def test_config_and_metadata_match_an_exports_contract() -> None:
    config = model_config("llama", 8)
    assert config.model_transaction_policy.decoupled and config.max_batch_size == 0
    assert [t.name for t in config.input] == ["text_input", "messages", "max_tokens", "temperature", "top_p",
                                              "seed", "stop"]
    assert config.parameters["max_sequences"].string_value == "8"
    metadata = model_metadata(config, ["1"])
    assert {t.name: t.datatype for t in metadata.inputs}["max_tokens"] == "INT32"
    assert [t.name for t in metadata.outputs] == ["text_output"]


def test_metrics_of_vllm_and_sglang() -> None:
    vllm = ('# HELP vllm:num_requests_waiting x\nvllm:num_requests_waiting{model_name="a"} 3.0\n'
            'vllm:num_requests_waiting{model_name="b"} 2.0\nvllm:num_requests_running{model_name="a"} 4.0\n'
            'vllm:kv_cache_usage_perc{model_name="a"} 0.5\nother_metric 9\n')
    load = server_load(vllm)
    assert load is not None and (load.waiting, load.running, load.cache_usage) == (5.0, 4.0, 0.5)
    sglang = "sglang:num_queue_reqs{name=\"x\"} 7\nsglang:token_usage{name=\"x\"} 0.9 1700000000\n"
    load = server_load(sglang)
    assert load is not None and (load.waiting, load.cache_usage) == (7.0, 0.9)
    assert server_load("process_cpu_seconds_total 3.0\n") is None


def test_workers_entries_for_openai_servers() -> None:
    assert WorkerSpec.parse("openai://127.0.0.1:8000") == WorkerSpec("127.0.0.1:8000", "openai")
    spec = WorkerSpec.from_mapping({"address": "openai://h:9", "api_key": "k", "headers": {"X-A": "1"},
                                    "models": ["llama", "llama-lora"], "max_streams": 4})
    assert (spec.kind, spec.api_key, spec.headers, spec.models, spec.max_streams) == \
        ("openai", "k", (("x-a", "1"),), ("llama", "llama-lora"), 4)
    with pytest.raises(ConfigError, match="only apply to kind 'openai'"):
        WorkerSpec.from_mapping({"address": "h:9", "api_key": "k"})
    with pytest.raises(ConfigError, match="models must be a list"):
        WorkerSpec.from_mapping({"address": "openai://h:9", "models": "llama"})


def test_an_embeddings_request_is_one_call_and_its_answer_goes_back_as_it_is() -> None:
    request = _request()
    request.parameters[EMBEDDING_REQUEST].string_param = orjson.dumps({"input": ["a", "b"], "dimensions": 8}).decode()
    path, body = openai_call(request, "served-name")
    assert (path, body) == (EMBEDDINGS_PATH, {"input": ["a", "b"], "dimensions": 8, "model": "served-name"})
    request.parameters[EMBEDDING_REQUEST].string_param = '{"dimensions": 8}'
    with pytest.raises(InvalidArgument, match="with 'input'"):
        openai_call(request, "m")
    answer = orjson.dumps({"object": "list", "data": [{"index": 0, "embedding": [0.5]}], "usage": {"prompt_tokens": 2}})
    response, tokens = embedding_response(request, answer, lambda status, message: Unavailable(f"{status} {message}"))
    assert tokens == 2 and response.outputs[0].name == EMBEDDING_ANSWER
    assert deserialize_bytes_tensor(response.raw_output_contents[0], 1)[0] == answer
    with pytest.raises(Unavailable, match="502 the server's embeddings answer has no 'data' list"):
        embedding_response(request, b'{"object": "list"}', lambda status, message: Unavailable(f"{status} {message}"))
