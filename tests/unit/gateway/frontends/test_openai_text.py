"""The OpenAI API's text handling without sockets: the chat template, token
bytes joined into whole characters, stop strings found across tokens and
never leaked in part, and the error bodies in OpenAI's shape."""

from __future__ import annotations

import orjson
import pytest

from gateway.frontends.openai_errors import error_body, from_error, openai_error_response
from gateway.frontends.openai_text import BadParameter, StopMatcher, TextJoiner, render_chat
from protos.errors import InvalidArgument, ModelNotFound, Overloaded, QuotaExceeded, Unauthenticated, Unavailable


def test_chat_template_renders_each_message_and_opens_the_assistants_turn() -> None:
    prompt = render_chat([{"role": "system", "content": "Be brief."},
                          {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
                          {"role": "assistant", "content": "Hello."},
                          {"role": "developer", "content": "Rule."}])
    assert prompt == ("<|system|>\nBe brief.\n<|user|>\nHi there\n<|assistant|>\nHello.\n"
                      "<|system|>\nRule.\n<|assistant|>\n")


@pytest.mark.parametrize("messages, words", [
    ([], "non-empty list"),
    ("hi", "non-empty list"),
    ([{"role": "wizard", "content": "x"}], "role must be one of"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "only text content parts"),
    ([{"role": "user", "content": 3}], "content must be a string"),
    (["hi"], "must be an object"),
])
def test_chat_messages_that_cannot_be_rendered_are_refused_naming_messages(messages: object, words: str) -> None:
    with pytest.raises(BadParameter) as info:
        render_chat(messages)
    assert words in info.value.message and info.value.param == "messages"
    assert isinstance(info.value, InvalidArgument)


def test_a_character_split_over_tokens_comes_out_whole_in_the_chunk_that_completes_it() -> None:
    joiner = TextJoiner()
    data = "aé€😀".encode()
    out = [joiner.feed(data[i:i + 1]) for i in range(len(data))]
    assert "".join(out) + joiner.flush() == "aé€😀"
    assert out == ["a", "", "é", "", "", "€", "", "", "", "😀"]


def test_an_unfinished_or_invalid_sequence_becomes_a_replacement_character() -> None:
    joiner = TextJoiner()
    assert joiner.feed(b"ok\xff") == "ok\ufffd"
    assert joiner.feed(b"\xe2\x82") == ""
    assert joiner.flush() == "\ufffd"


def _run(matcher: StopMatcher, pieces: list[str]) -> str:
    out = "".join(matcher.feed(p) for p in pieces)
    return out + matcher.flush()


def test_stop_string_across_pieces_is_cut_with_everything_after_it() -> None:
    matcher = StopMatcher(("END",))
    assert matcher.feed("abcE") == "abc"  # "E" may begin the stop string: held back
    assert matcher.feed("N") == ""
    assert matcher.feed("Dtail") == "" and matcher.stopped
    assert matcher.feed("more") == "" and matcher.flush() == ""


def test_held_text_that_is_no_stop_string_goes_out_and_the_earliest_stop_wins() -> None:
    assert _run(StopMatcher(("END",)), ["abE", "Nx", "yz"]) == "abENxyz"
    assert _run(StopMatcher(("EN",)), ["abE"]) == "abE"  # the text ended: what was held goes out
    matcher = StopMatcher(("cd", "b"))
    assert _run(matcher, ["abcd"]) == "a" and matcher.stopped
    assert _run(StopMatcher(()), ["a", "b"]) == "ab"


def test_stop_strings_of_several_characters_and_overlaps() -> None:
    matcher = StopMatcher(("aab",))
    assert matcher.feed("aaa") == "a"  # "aa" could still begin "aab"
    assert matcher.feed("b") == "" and matcher.stopped


def test_error_bodies_name_type_param_and_code() -> None:
    assert error_body(400, "bad", "n") == {"error": {"message": "bad", "type": "invalid_request_error",
                                                     "param": "n", "code": None}}
    assert error_body(401, "who")["error"]["code"] == "invalid_api_key"
    assert error_body(500, "oops")["error"]["type"] == "server_error"


@pytest.mark.parametrize("error, status, code", [
    (ModelNotFound("Request for unknown model: 'x' is not found"), 404, "model_not_found"),
    (BadParameter("'n' must be", "n"), 400, None),
    (QuotaExceeded("over", retry_after_s=2.5), 429, "rate_limit_exceeded"),
    (Overloaded("full", retry_after_s=1.0), 429, "overloaded"),
    (Unavailable("no replica"), 503, "service_unavailable"),
    (Unauthenticated("missing or invalid API key"), 401, "invalid_api_key"),
])
def test_project_errors_answer_with_openai_status_and_shape(error: Exception, status: int, code: str | None) -> None:
    response = from_error(error)  # type: ignore[arg-type]
    body = orjson.loads(response.body)  # type: ignore[arg-type]
    assert response.status == status
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == code and body["error"]["message"] == error.message  # type: ignore[attr-defined]
    if status in (429, 503):
        assert response.headers["Retry-After"] in ("1", "3")
    assert openai_error_response(400, "x").content_type == "application/json"
