"""Responses input items as the chat messages they become: a reasoning item fed back
(OpenAI's loop: input += response.output) is the thinking of the assistant turn it came
with, and errors name the Responses field of an input_image or a tool_choice."""

from __future__ import annotations

import pytest

from engine.errors import InvalidRequest
from server.responses import ResponsesRequest, chat_request, responses_param

CALL = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}", "id": "fc_1"}
THOUGHT = {"type": "reasoning", "id": "rs_1", "summary": [],
           "content": [{"type": "reasoning_text", "text": "I should call f."}]}  # fmt: skip
USER = {"role": "user", "content": "hi"}


def messages_of(items: list) -> list[dict]:
    translation = chat_request(ResponsesRequest(model="m", input=items))
    return [message.model_dump(exclude_none=True) for message in translation.chat.messages]


def test_a_reasoning_item_fed_back_is_the_thinking_of_its_turn():
    """It was a 400 ("input items of type 'reasoning' are not supported"), so a reasoning
    model's own output could not be sent back."""
    output = {"type": "function_call_output", "call_id": "c1", "output": "42"}
    messages = messages_of([USER, THOUGHT, CALL, output])
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
    assert messages[1]["reasoning_content"] == "I should call f."
    assert messages[1]["tool_calls"][0]["function"]["name"] == "f"

    answer = {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "Hello."}]}  # fmt: skip
    summary = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Greet."}]}
    messages = messages_of([USER, summary, answer, USER])
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert messages[1]["reasoning_content"] == "Greet."
    assert messages[1]["content"][0]["text"] == "Hello."


def test_a_reasoning_item_that_no_turn_followed_is_left_out():
    assert [m["role"] for m in messages_of([USER, THOUGHT, USER])] == ["user", "user"]


@pytest.mark.parametrize(
    ("chat_param", "items", "param"),
    [
        ("messages[0].content[1].image_url.url",
         [{"role": "user", "content": [{"type": "input_text", "text": "x"},
                                       {"type": "input_image", "image_url": "u"}]}],
         "input[0].content[1].image_url"),
        ("messages[0].content[0].image_url.detail",
         [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}],
         "input[0].content[0].detail"),
        ("messages[2].content[0].image_url.url",
         [USER, CALL, {"type": "function_call_output", "call_id": "c1",
                       "output": [{"type": "input_image", "image_url": "u"}]}],
         "input[2].output[0].image_url"),
        ("tool_choice.function.name", [USER], "tool_choice.name"),
    ],
)  # fmt: skip
def test_errors_name_an_input_image_and_a_tool_choice_as_responses_does(chat_param, items, param):
    """They named the chat's fields: image_url.url, image_url.detail, function.name."""
    translation = chat_request(ResponsesRequest(model="m", input=items))
    assert responses_param(chat_param, translation.message_sources) == param


@pytest.mark.parametrize("message, param, expected", [
    ("min_tokens (10) must not exceed max_tokens (4)", "min_tokens",
     "min_tokens (10) must not exceed max_output_tokens (4)"),
    ("a named tool_choice is a format of its own: leave response_format out", "tool_choice",
     "a named tool_choice is a format of its own: leave text.format out"),
])  # fmt: skip
def test_an_error_names_every_renamed_field_it_mentions_as_responses_does(message, param, expected):
    """Only the failing field was renamed: a Responses client read about max_tokens and
    response_format, which it never sent (fuzz54)."""
    translation = chat_request(ResponsesRequest(model="m", input=[USER]))
    error = translation.renamed(InvalidRequest(message, param=param))
    assert error.message == expected and str(error) == expected


def test_a_grammar_error_keeps_the_clients_own_text():
    """The message-wide rename rewrote llguidance's quote of the schema: a $ref to
    '/definitions/max_tokens' came back as '/definitions/max_output_tokens' (fuzz57)."""
    from server.sampling_params import GrammarRefused

    translation = chat_request(ResponsesRequest(model="m", input=[USER]))
    detail = "unknown $ref '#/definitions/max_tokens' near response_format"
    error = translation.renamed(GrammarRefused("response_format", detail))
    assert error.param == "text.format" and error.message == f"invalid text.format: {detail}"


def test_an_input_image_with_chats_url_object_is_told_the_string_form():
    """{"image_url": {"url": ...}} (chat's form) got "an input_image needs an image_url",
    though it had one (fuzz69)."""
    items = [{"role": "user", "content": [{"type": "input_image", "image_url": {"url": "u"}}]}]
    with pytest.raises(InvalidRequest, match="image_url is a string") as error:
        chat_request(ResponsesRequest(model="m", input=items))
    assert error.value.param == "input[0].content[0].image_url"


def test_tool_choice_auto_without_tools_stays_the_default():
    """The Responses API's default, "auto", which a client may send with no tools: the
    chat underneath refuses it without tools (as OpenAI's chat does), so it is left out."""
    translation = chat_request(ResponsesRequest(model="m", input=[USER], tool_choice="auto"))
    assert translation.chat.tool_choice is None
    with pytest.raises(InvalidRequest) as refused:
        chat_request(ResponsesRequest(model="m", input=[USER], tool_choice="required"))
    assert refused.value.param == "tool_choice"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"input": [USER, {**CALL, "arguments": None}]}, "input[1].arguments"),
        ({"input": [USER, {k: v for k, v in CALL.items() if k != "arguments"}]},
         "input[1].arguments"),
        ({"input": [USER, {**CALL, "arguments": {"a": 1}}]}, "input[1].arguments"),
        ({"input": [USER, CALL, {"type": "function_call_output", "call_id": "c1"}]},
         "input[2].output"),
        ({"input": [{**USER, "status": "done"}]}, "input[0].status"),
        ({"input": [USER, {"role": "tool", "content": "42"}]}, "input[1].role"),
        ({"input": [USER], "text": {"verbosity": "bogus"}}, "text.verbosity"),
    ],
)  # fmt: skip
def test_input_items_and_options_openai_refuses_are_400_naming_the_field(fields, param):
    """fuzz100: each was a 200 (a call without arguments ran as `{}`), where OpenAI's item
    types and vLLM refuse them."""
    with pytest.raises(InvalidRequest) as refused:
        chat_request(ResponsesRequest(model="m", **fields))
    assert refused.value.param == param


def test_option_types_are_checked_and_null_stream_is_the_default():
    from pydantic import ValidationError

    assert ResponsesRequest(model="m", input="x", stream=None).stream is False
    for fields in ({"reasoning": "high"}, {"service_tier": 3}):
        with pytest.raises(ValidationError):
            ResponsesRequest(model="m", input="x", **fields)
    finished = {**CALL, "status": "completed"}
    translation = chat_request(ResponsesRequest(model="m", input=[USER, finished],
                                                text={"verbosity": "low"}))  # fmt: skip
    assert translation.chat.messages[1].tool_calls[0].function.arguments == "{}"


def test_an_assistants_refusal_part_fed_back_is_its_text():
    """A history saved from OpenAI: chat read the part as the assistant's text, Responses
    refused it (fuzz102)."""
    answer = {"type": "message", "role": "assistant",
              "content": [{"type": "refusal", "refusal": "I can't."}]}  # fmt: skip
    messages = messages_of([USER, answer, USER])
    assert messages[1]["content"] == [{"type": "text", "text": "I can't."}]


def test_consecutive_reasoning_items_are_one_thinking():
    """[user, R1, R2, answer] rendered R2's text alone: each reasoning item was a turn of
    its own, the answer joined the last, and the first was dropped (fuzz112)."""
    second = {**THOUGHT, "id": "rs_2",
              "content": [{"type": "reasoning_text", "text": "Then answer."}]}  # fmt: skip
    answer = {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "Hello."}]}  # fmt: skip
    messages = messages_of([USER, THOUGHT, second, answer])
    assert [m["role"] for m in messages] == ["user", "assistant"]
    assert messages[1]["reasoning_content"] == "I should call f.\nThen answer."


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"summary": "text"}, "input[1].summary"),
        ({"summary": [{"type": "summary_text", "text": 5}]}, "input[1].summary[0]"),
        ({"summary": [{"type": "output_text", "text": "x"}]}, "input[1].summary[0]"),
        ({"summary": [], "content": "text"}, "input[1].content"),
        ({"content": [{"type": "reasoning_text", "text": "x"}]}, "input[1].summary"),
    ],
)  # fmt: skip
def test_malformed_reasoning_items_are_400_naming_the_field(fields, param):
    """They were taken, their thinking silently empty; OpenAI's item type and vLLM refuse
    them (fuzz112)."""
    item = {"type": "reasoning", **fields}
    with pytest.raises(InvalidRequest) as refused:
        chat_request(ResponsesRequest(model="m", input=[USER, item]))
    assert refused.value.param == param
