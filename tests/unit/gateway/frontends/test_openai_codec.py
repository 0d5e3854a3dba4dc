"""The OpenAI API's body codec without sockets: requests mapped onto the
generative contract's inputs and parameters, the refusals naming their field,
seeds per choice, and the response, chunk, usage, model-list and embedding
shapes."""

from __future__ import annotations

import base64

import numpy as np
import orjson
import pytest

from protos.triton_words import ENABLE_EMPTY_FINAL as EMPTY_FINAL
from gateway.frontends.openai_codec import (
    LOGPROBS,
    Choice,
    Usage,
    chat_request,
    check_dimensions,
    chunk_json,
    completion_json,
    completion_request,
    embedding_model_request,
    embedding_request,
    embedding_vectors,
    embeddings_json,
    is_embedding_model,
    final_counts,
    logprobs_json,
    mean_pool,
    model_request,
    models_json,
    token_bytes,
    token_logprobs,
    usage_chunk_json,
)
from gateway.frontends.openai_text import BadParameter
from gateway.types import InferResponse, Tensor
from protos.codec import deserialize_bytes_tensor, serialize_bytes_tensor

LM = {"text_input": "BYTES", "max_tokens": "INT32", "temperature": "FP32", "top_p": "FP32", "seed": "UINT64",
      "stop": "BYTES"}


def _inputs(request) -> dict[str, Tensor]:
    return {t.name: t for t in request.inputs}


def test_completion_maps_onto_the_models_inputs_with_the_empty_final_response_asked_for() -> None:
    g = completion_request({"model": "lm", "prompt": "héllo", "max_tokens": 5, "temperature": 0.5, "top_p": 0.9,
                            "seed": 7, "stop": ["a", "", "bc"]})
    assert g.sampling.stop == ("a", "bc") and g.n == 1 and not g.stream
    [(index, prompt, seed)] = g.choices()
    request = model_request(g, prompt, seed, inputs=LM, batched=False, request_id="r-0")
    tensors = _inputs(request)
    assert request.model == "lm" and request.id == "r-0" and request.parameters == {EMPTY_FINAL: True}
    assert deserialize_bytes_tensor(tensors["text_input"].data).tolist() == ["héllo".encode()]
    assert tensors["text_input"].shape == (1,)
    assert np.frombuffer(tensors["max_tokens"].data, np.int32).tolist() == [5]
    assert np.frombuffer(tensors["temperature"].data, np.float32).tolist() == [0.5]
    assert np.frombuffer(tensors["seed"].data, np.uint64).tolist() == [7]
    assert deserialize_bytes_tensor(tensors["stop"].data).tolist() == [b"a", b"bc"]
    assert tensors["stop"].shape == (2,)


def test_unset_fields_are_left_to_the_model_and_missing_inputs_go_as_parameters() -> None:
    g = completion_request({"model": "lm", "prompt": "x", "max_tokens": 3, "stop": "z"})
    request = model_request(g, "x", None, inputs={"text_input": "BYTES"}, batched=True, request_id="r")
    assert list(_inputs(request)) == ["text_input"] and request.inputs[0].shape == (1, 1)
    assert request.parameters == {EMPTY_FINAL: True, "max_tokens": 3, "stop": "z"}


def test_ignore_eos_goes_to_the_model_as_a_request_parameter() -> None:
    g = completion_request({"model": "lm", "prompt": "x", "ignore_eos": True})
    request = model_request(g, "x", None, inputs=LM, batched=False, request_id="r")
    assert request.parameters == {EMPTY_FINAL: True, "ignore_eos": True}
    with pytest.raises(BadParameter):
        completion_request({"model": "lm", "prompt": "x", "ignore_eos": "yes"})


def test_a_model_without_text_input_is_refused() -> None:
    g = completion_request({"model": "simple", "prompt": "x"})
    with pytest.raises(BadParameter, match="not a text generation model") as info:
        model_request(g, "x", None, inputs={"INPUT0": "INT32"}, batched=True, request_id="r")
    assert info.value.param == "model"


def test_n_choices_per_prompt_with_seeds_counting_up() -> None:
    g = completion_request({"model": "lm", "prompt": ["a", "b"], "n": 2, "seed": 10})
    assert g.choices() == [(0, "a", 10), (1, "a", 11), (2, "b", 10), (3, "b", 11)]
    assert completion_request({"model": "lm", "prompt": "a", "n": 3}).choices() == [(0, "a", None), (1, "a", None),
                                                                                   (2, "a", None)]


def test_chat_prefers_max_completion_tokens_and_renders_the_prompt() -> None:
    g = chat_request({"model": "lm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                      "max_completion_tokens": 9, "stream": True, "stream_options": {"include_usage": True}})
    assert g.sampling.max_tokens == 9 and g.stream and g.include_usage
    assert g.prompts == ("<|user|>\nhi\n<|assistant|>\n",)
    assert chat_request({"model": "lm", "messages": [{"role": "user", "content": "hi"}],
                         "max_tokens": 4}).sampling.max_tokens == 4


@pytest.mark.parametrize("doc, param", [
    ({"prompt": "x"}, "model"),
    ({"model": "", "prompt": "x"}, "model"),
    ({"model": "lm"}, "prompt"),
    ({"model": "lm", "prompt": [1, 2]}, "prompt"),
    ({"model": "lm", "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": "lm", "prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ({"model": "lm", "prompt": "x", "n": 0}, "n"),
    ({"model": "lm", "prompt": "x", "n": 17}, "n"),
    ({"model": "lm", "prompt": "x", "temperature": 2.5}, "temperature"),
    ({"model": "lm", "prompt": "x", "top_p": 0}, "top_p"),
    ({"model": "lm", "prompt": "x", "seed": -1}, "seed"),
    ({"model": "lm", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"model": "lm", "prompt": "x", "stop": 3}, "stop"),
    ({"model": "lm", "prompt": "x", "stream": "yes"}, "stream"),
    ({"model": "lm", "prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"model": "lm", "prompt": "x", "logprobs": 21}, "logprobs"),
    ({"model": "lm", "prompt": "x", "echo": True}, "echo"),
    ({"model": "lm", "prompt": "x", "best_of": 3}, "best_of"),
    ({"model": "lm", "prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
])
def test_bad_or_unsupported_fields_are_refused_by_name(doc: dict, param: str) -> None:
    with pytest.raises(BadParameter) as info:
        completion_request(doc)
    assert info.value.param == param and info.value.http_status == 400


def test_neutral_values_of_unsupported_fields_are_accepted() -> None:
    g = completion_request({"model": "lm", "prompt": "x", "logprobs": None, "echo": False, "best_of": 1,
                            "presence_penalty": 0, "frequency_penalty": 0.0, "user": "me", "stream": False})
    assert g.model == "lm"
    chat_request({"model": "lm", "messages": [{"role": "user", "content": "x"}], "tools": [],
                  "response_format": {"type": "text"}, "logprobs": False})


def _response(parameters: dict, data: bytes | None = None, final: bool = False) -> InferResponse:
    outputs = [] if data is None else [
        Tensor("text_output", "BYTES", (1,), serialize_bytes_tensor(np.array([data], dtype=np.object_)))]
    return InferResponse(model="lm", version="1", id="r", outputs=outputs, parameters=parameters, final=final)


def test_a_chat_to_a_model_with_a_messages_input_sends_the_messages_for_its_own_template() -> None:
    messages = [{"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "hé"}, {"type": "text", "text": "llo"}]}]
    g = chat_request({"model": "lm", "messages": messages})
    own = model_request(g, g.prompts[0], None, inputs={**LM, "messages": "BYTES"}, batched=False, request_id="r")
    [sent] = deserialize_bytes_tensor(_inputs(own)["messages"].data).tolist()
    assert "text_input" not in _inputs(own)
    assert orjson.loads(sent) == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo"}]
    rendered = model_request(g, g.prompts[0], None, inputs=LM, batched=False, request_id="r")
    assert deserialize_bytes_tensor(_inputs(rendered)["text_input"].data).tolist() == [
        b"<|system|>\nBe brief.\n<|user|>\nh\xc3\xa9llo\n<|assistant|>\n"]


def test_logprobs_go_to_the_model_as_a_parameter_and_come_back_in_openais_shapes() -> None:
    g = completion_request({"model": "lm", "prompt": "x", "logprobs": 2})
    assert model_request(g, "x", None, inputs=LM, batched=False, request_id="r").parameters[LOGPROBS] == 2
    chat = chat_request({"model": "lm", "messages": [{"role": "user", "content": "x"}], "logprobs": True,
                         "top_logprobs": 1})
    assert chat.sampling.logprobs == 1
    assert chat_request({"model": "lm", "messages": [{"role": "user", "content": "x"}]}).sampling.logprobs is None
    entry = {"token": "é", "bytes": [195, 169], "logprob": -0.5,
             "top_logprobs": [{"token": "é", "bytes": [195, 169], "logprob": -0.5},
                              {"token": "\ufffd", "bytes": [195], "logprob": -1.5},
                              {"token": "\ufffd", "bytes": [196], "logprob": -2.5}], "offset": 3}
    response = InferResponse(model="lm", version="1", id="r", outputs=[],
                             parameters={LOGPROBS: orjson.dumps(entry).decode()})
    assert token_logprobs(response) == entry
    assert logprobs_json(g, [entry]) == {"tokens": ["é"], "token_logprobs": [-0.5], "text_offset": [3],
                                         "top_logprobs": [{"é": -0.5, "\ufffd": -1.5}]}  # same text: the likelier
    assert logprobs_json(chat, [entry])["content"][0]["top_logprobs"][1] == {"token": "\ufffd", "bytes": [195],
                                                                            "logprob": -1.5}
    assert logprobs_json(completion_request({"model": "lm", "prompt": "x"}), [entry]) is None
    for doc, param in [({"logprobs": 21}, "logprobs"), ({"logprobs": "yes"}, "logprobs"),
                       ({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 21}, "top_logprobs")]:
        with pytest.raises(BadParameter) as caught:
            chat_request({"model": "lm", "messages": [{"role": "user", "content": "x"}], **doc})
        assert caught.value.param == param


def test_token_bytes_and_final_counts_are_read_from_responses() -> None:
    assert token_bytes(_response({}, b"\xc3")) == b"\xc3"
    assert token_bytes(_response({}, None, final=True)) == b""
    final = _response({"finish_reason": "length", "prompt_tokens": 6, "completion_tokens": 4}, None, True)
    assert final_counts(final) == ("length", 6, 4)
    assert final_counts(_response({"finish_reason": 3}, None, True)) == (None, None, None)


def test_whole_answers_of_completion_and_chat() -> None:
    g = completion_request({"model": "lm", "prompt": "x", "n": 2})
    choices = [Choice(0, "ab", "stop"), Choice(1, "c", "length")]
    body = completion_json(g, "cmpl-1", 100, choices, Usage(3, 4))
    assert body == {"id": "cmpl-1", "object": "text_completion", "created": 100, "model": "lm",
                    "choices": [{"index": 0, "text": "ab", "logprobs": None, "finish_reason": "stop"},
                                {"index": 1, "text": "c", "logprobs": None, "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}
    chat = chat_request({"model": "lm", "messages": [{"role": "user", "content": "x"}]})
    body = completion_json(chat, "chatcmpl-1", 100, choices[:1], Usage(3, 2))
    assert body["object"] == "chat.completion"
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "ab"}, "logprobs": None,
                                "finish_reason": "stop"}]


def test_chunks_of_chat_open_with_the_role_and_end_with_an_empty_delta() -> None:
    g = chat_request({"model": "lm", "messages": [{"role": "user", "content": "x"}], "stream": True,
                      "stream_options": {"include_usage": True}})
    first = chunk_json(g, "c", 5, 1, "he", first=True)
    assert first == {"id": "c", "object": "chat.completion.chunk", "created": 5, "model": "lm", "usage": None,
                     "choices": [{"index": 1, "delta": {"role": "assistant", "content": "he"}, "logprobs": None,
                                  "finish_reason": None}]}
    assert chunk_json(g, "c", 5, 1, "y")["choices"][0]["delta"] == {"content": "y"}
    last = chunk_json(g, "c", 5, 1, None, "stop")["choices"][0]
    assert last["delta"] == {} and last["finish_reason"] == "stop"
    assert usage_chunk_json(g, "c", 5, Usage(2, 3)) == {
        "id": "c", "object": "chat.completion.chunk", "created": 5, "model": "lm", "choices": [],
        "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}}


def test_chunks_of_completions_carry_text_and_no_usage_key_unless_asked() -> None:
    g = completion_request({"model": "lm", "prompt": "x", "stream": True})
    chunk = chunk_json(g, "c", 5, 0, "ab")
    assert chunk == {"id": "c", "object": "text_completion", "created": 5, "model": "lm",
                     "choices": [{"index": 0, "text": "ab", "logprobs": None, "finish_reason": None}]}
    assert chunk_json(g, "c", 5, 0, None, "length")["choices"][0] == {"index": 0, "text": "", "logprobs": None,
                                                                       "finish_reason": "length"}


def test_model_list_shape() -> None:
    assert models_json(["a", "b"]) == {"object": "list", "data": [
        {"id": "a", "object": "model", "created": 0, "owned_by": "infergate"},
        {"id": "b", "object": "model", "created": 0, "owned_by": "infergate"}]}


def test_embedding_inputs_are_texts_or_token_ids() -> None:
    assert embedding_request({"model": "e", "input": "hé"}).inputs == ("hé",)
    assert embedding_request({"model": "e", "input": "hé"}).byte_ids() == ((104, 195, 169),)
    assert embedding_request({"model": "e", "input": ["a", "bc"]}).byte_ids() == ((97,), (98, 99))
    assert embedding_request({"model": "e", "input": [5, 6]}).inputs == ((5, 6),)
    assert embedding_request({"model": "e", "input": [[5], [6, 7]]}).inputs == ((5,), (6, 7))
    assert not embedding_request({"model": "e", "input": [[5], [6, 7]]}).texts
    assert embedding_request({"model": "e", "input": "x", "encoding_format": "base64"}).base64
    assert embedding_request({"model": "e", "input": "x", "dimensions": 8}).dimensions == 8
    assert embedding_request({"model": "e", "input": "x", "truncate_prompt_tokens": -1}).truncate == -1
    for bad, param in (({"model": "e"}, "input"), ({"model": "e", "input": ""}, "input"),
                       ({"model": "e", "input": [1.5]}, "input"), ({"model": "e", "input": ["a", [1]]}, "input"),
                       ({"model": "e", "input": [[1], []]}, "input"), ({"model": "e", "input": [[1, -2]]}, "input"),
                       ({"model": "e", "input": ["x"] * 2049}, "input"),
                       ({"model": "e", "input": "x", "encoding_format": "hex"}, "encoding_format"),
                       ({"model": "e", "input": "x", "dimensions": 0}, "dimensions"),
                       ({"model": "e", "input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
                       ({"model": "e", "input": "x", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens")):
        with pytest.raises(BadParameter) as caught:
            embedding_request(bad)
        assert caught.value.param == param, bad


def test_dimensions_are_honoured_only_as_the_models_own_width() -> None:
    check_dimensions(embedding_request({"model": "e", "input": "x"}), 384)
    check_dimensions(embedding_request({"model": "e", "input": "x", "dimensions": 384}), 384)
    with pytest.raises(BadParameter, match="384 dimensions"):
        check_dimensions(embedding_request({"model": "e", "input": "x", "dimensions": 128}), 384)


def test_an_embedding_model_gets_every_input_in_one_request() -> None:
    assert is_embedding_model({"text_input": "BYTES", "input_ids": "INT64"}, ["embedding", "prompt_tokens"])
    assert not is_embedding_model({"TOKENS": "INT64"}, ["HIDDEN"])
    texts = embedding_model_request(embedding_request({"model": "e", "input": ["a", "héllo"]}), request_id="r")
    (tensor,) = texts.inputs
    assert (tensor.name, tensor.datatype, tensor.shape) == ("text_input", "BYTES", (2, 1))
    assert deserialize_bytes_tensor(tensor.data).tolist() == [b"a", "héllo".encode()]
    assert len(texts.inputs) == 1
    ids = embedding_model_request(embedding_request({"model": "e", "input": [[1, 2, 3], [4]],
                                                     "truncate_prompt_tokens": 2}), request_id="r")
    tokens, mask, truncate = ids.inputs
    assert (tokens.name, tokens.shape, mask.name) == ("input_ids", (2, 3), "attention_mask")
    assert np.frombuffer(tokens.data, np.int64).reshape(2, 3).tolist() == [[1, 2, 3], [4, 0, 0]]
    assert np.frombuffer(mask.data, np.int64).reshape(2, 3).tolist() == [[1, 1, 1], [1, 0, 0]]
    assert (truncate.name, truncate.datatype, truncate.shape) == ("truncate_prompt_tokens", "INT32", (2, 1))
    assert np.frombuffer(truncate.data, np.int32).tolist() == [2, 2]
    vectors = np.arange(6, dtype=np.float32).reshape(2, 3)
    response = InferResponse(model="e", version="1", id="r", outputs=[
        Tensor("embedding", "FP32", (2, 3), vectors.tobytes()),
        Tensor("prompt_tokens", "INT32", (2, 1), np.array([[3], [1]], np.int32).tobytes())])
    got, tokens_used = embedding_vectors(embedding_request({"model": "e", "input": [[1, 2, 3], [4]]}), response)
    assert [v.tolist() for v in got] == vectors.tolist() and tokens_used == 4


def test_embeddings_are_the_mean_over_tokens_as_floats_or_base64() -> None:
    hidden = np.arange(12, dtype=np.float32).reshape(1, 3, 4)
    vector = mean_pool(Tensor("HIDDEN", "FP32", (1, 3, 4), hidden.tobytes()))
    assert vector.tolist() == [4.0, 5.0, 6.0, 7.0]
    request = embedding_request({"model": "e", "input": ["abc"]})
    body = embeddings_json(request, [vector], 3)
    assert body == {"object": "list", "model": "e", "usage": {"prompt_tokens": 3, "total_tokens": 3},
                    "data": [{"object": "embedding", "index": 0, "embedding": [4.0, 5.0, 6.0, 7.0]}]}
    request = embedding_request({"model": "e", "input": "abc", "encoding_format": "base64"})
    encoded = embeddings_json(request, [vector], 3)["data"][0]["embedding"]
    assert np.frombuffer(base64.b64decode(encoded), "<f4").tolist() == [4.0, 5.0, 6.0, 7.0]
