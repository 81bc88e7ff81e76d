"""OpenAI's Responses API on a real server, through `client.responses` and httpx: each
request answers as the chat completion it translates to (same prompt tokens, same greedy
text), streams Responses' typed events, and names Responses fields in its errors."""

from __future__ import annotations

import json

import jsonschema
import pytest

from bench.local_inputs import picture
from tests.e2e.conftest import MODEL_NAME
from tests.e2e.test_chat_api import data_url
from tests.e2e.test_errors_api import assert_error

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"enum": [1, 2, 3]}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": SCHEMA}  # fmt: skip
GREEDY = {"temperature": 0, "max_output_tokens": 12}


def chat(client, messages, **kwargs):
    return client.chat.completions.create(model=MODEL_NAME, messages=messages, **kwargs)


def respond(client, **kwargs):
    return client.responses.create(model=MODEL_NAME, **kwargs)


def test_text_input_answers_as_the_chat_completion(client):
    response = respond(client, input="Tell me about the sea.", **GREEDY)
    reference = chat(client, [{"role": "user", "content": "Tell me about the sea."}],
                     temperature=0, max_tokens=12)  # fmt: skip
    choice = reference.choices[0]
    assert response.output_text == choice.message.content
    assert response.usage.input_tokens == reference.usage.prompt_tokens
    assert response.usage.output_tokens == reference.usage.completion_tokens
    assert response.object == "response" and response.model == MODEL_NAME
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    if choice.finish_reason == "length":
        assert response.status == "incomplete"
        assert response.incomplete_details.reason == "max_output_tokens"
    else:
        assert response.status == "completed" and response.incomplete_details is None


def test_the_chats_extras_ride_along_as_on_chat(client):
    """include_stop_str_in_output was ignored: the stop string was cut off."""
    full = respond(client, input="Tell me about the sea.", **GREEDY).output_text
    stop = full[len(full) // 2 :][:2]
    extras = {"stop": [stop], "include_stop_str_in_output": True}
    response = respond(client, input="Tell me about the sea.", **GREEDY, extra_body=extras)
    reference = chat(client, [{"role": "user", "content": "Tell me about the sea."}],
                     temperature=0, max_tokens=12, extra_body=extras)  # fmt: skip
    assert response.output_text == reference.choices[0].message.content
    assert response.output_text.endswith(stop)


def test_instructions_images_and_earlier_turns_become_the_chat_messages(client):
    url = data_url(picture(64, 48, 3))
    items = [
        {"role": "user", "content": [
            {"type": "input_text", "text": "What is this?"},
            {"type": "input_image", "image_url": url, "detail": "auto"}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "A picture."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Oslo", "days": 2}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "rain"},
        {"role": "user", "content": "And now?"},
    ]  # fmt: skip
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": url, "detail": "auto"}}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A picture."}],
         "tool_calls": [{"id": "call_1", "type": "function", "function": {
             "name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
        {"role": "user", "content": "And now?"},
    ]  # fmt: skip
    response = respond(client, instructions="Be brief.", input=items, **GREEDY)
    reference = chat(client, messages, temperature=0, max_tokens=12)
    assert response.usage.input_tokens == reference.usage.prompt_tokens
    assert response.output_text == reference.choices[0].message.content
    assert response.instructions == "Be brief."


def test_a_stream_sends_the_typed_events_of_the_same_answer(client):
    whole = respond(client, input="Count with me.", **GREEDY)
    events = list(respond(client, input="Count with me.", stream=True, **GREEDY))
    types = [event.type for event in events]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]  # fmt: skip
    assert types[4 : 4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    assert types[4 + len(deltas) :] == [
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", f"response.{whole.status}",
    ]  # fmt: skip
    assert "".join(d.delta for d in deltas) == whole.output_text
    assert events[-4].text == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage == whole.usage
    assert events[0].response.status == "in_progress" and final.status == whole.status


def test_a_named_function_is_called_with_arguments_in_its_schema(client):
    kwargs = {"input": "Weather?", "tools": [WEATHER], "temperature": 0,
              "tool_choice": {"type": "function", "name": "get_weather"},
              "max_output_tokens": 64}  # fmt: skip
    response = respond(client, **kwargs)
    calls = [item for item in response.output if item.type == "function_call"]
    assert [call.name for call in calls] == ["get_weather"] and response.status == "completed"
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMA)
    assert calls[0].call_id.startswith("call_") and calls[0].id.startswith("fc_")
    events = list(respond(client, stream=True, **kwargs))
    arguments = "".join(
        e.delta for e in events if e.type == "response.function_call_arguments.delta"
    )
    assert arguments == calls[0].arguments
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert done[-1].type == "function_call" and done[-1].arguments == arguments
    assert events[-1].response.output[-1].arguments == arguments


def test_a_call_cut_by_max_output_tokens_is_incomplete(client):
    """Cut short, a named function's arguments are not whole: the item says incomplete as
    the response does (it said completed, streamed and not)."""
    kwargs = {"input": "Weather?", "tools": [WEATHER], "temperature": 0,
              "tool_choice": {"type": "function", "name": "get_weather"},
              "max_output_tokens": 3}  # fmt: skip
    response = respond(client, **kwargs)
    assert response.status == "incomplete"
    assert [item.status for item in response.output if item.type == "function_call"] == [
        "incomplete"
    ]
    events = list(respond(client, stream=True, **kwargs))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert done[-1].type == "function_call" and done[-1].status == "incomplete"
    assert events[-1].response.output[-1].status == "incomplete"


def test_required_tools_and_a_json_schema_format_keep_to_their_grammars(client):
    response = respond(client, input="Weather?", tools=[WEATHER], tool_choice="required",
                       temperature=0, max_output_tokens=96)  # fmt: skip
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and all(call.name == "get_weather" for call in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMA)
    text_format = {"format": {"type": "json_schema", "name": "plan", "schema": SCHEMA}}
    response = respond(client, input="Plan a trip.", text=text_format, temperature=0,
                       max_output_tokens=64)  # fmt: skip
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), SCHEMA)


def test_logprobs_are_the_chat_completions(client):
    response = respond(client, input="Hello", top_logprobs=2, **GREEDY)
    reference = chat(client, [{"role": "user", "content": "Hello"}], temperature=0,
                     max_tokens=12, logprobs=True, top_logprobs=2)  # fmt: skip
    logprobs = response.output[0].content[0].logprobs
    expected = reference.choices[0].logprobs.content
    assert [(lp.token, lp.logprob) for lp in logprobs] == [(e.token, e.logprob) for e in expected]
    assert all(len(lp.top_logprobs) == 2 for lp in logprobs)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": [{"role": "user", "content": [
            {"type": "input_text", "text": "hi"},
            {"type": "input_image", "file_id": "file-1"}]}]}, "input[0].content[1].file_id"),
        ({"instructions": "x", "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]},
         "input[0].content[0]"),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        # an input_image's and a tool_choice's fields as Responses names them
        ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function"}},
         "tool_choice.name"),
        ({"input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": 5}]}]},
         "input[0].content[0].detail"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "hi", "tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}},
         "text.format.schema"),
        ({"input": "hi", "truncation": "auto"}, "truncation"),
        ({"input": []}, "input"),
        # a function_call's fields and a function_call_output's are named as the item has them
        ({"input": [{"role": "user", "content": "hi"},
                    {"type": "function_call", "call_id": "c1", "arguments": "{}"}]},
         "input[1].name"),
        ({"input": [{"role": "user", "content": "hi"},
                    {"type": "function_call", "call_id": "c1", "name": "a", "arguments": 5}]},
         "input[1].arguments"),
        ({"input": [{"role": "user", "content": "hi"},  # two calls, one chat message
                    {"type": "function_call", "call_id": "c1", "name": "a", "arguments": "{}"},
                    {"type": "function_call", "call_id": "c2", "arguments": "{}"}]},
         "input[2].name"),
        ({"input": [{"role": "user", "content": "hi"},
                    {"type": "function_call_output", "call_id": "c1", "output": {"a": 1}}]},
         "input[1].output"),
        ({"input": "hi", "tools": [{"type": "function", "name": "f"}] * 2}, "tools"),
        # a placeholder typed into the text: the conversation as a whole is at fault
        ({"input": [{"role": "user", "content": [{"type": "input_text",
                                                  "text": "<|image_pad|> hi"}]}]}, "input"),
    ],
)  # fmt: skip
def test_bad_requests_name_the_responses_field(http, fields, param):
    response = http.post("/v1/responses", json={"model": MODEL_NAME, **fields})
    assert_error(response, 400, param=param)
    assert "messages" not in response.json()["error"]["message"]


def test_a_grammar_that_fails_while_streaming_names_the_responses_field(http):
    """Found during generation (a schema that requires itself), the stream's error event
    named the chat field, response_format.json_schema.schema."""
    schema = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
    body = {"model": MODEL_NAME, "input": "x", "max_output_tokens": 30, "temperature": 0,
            "stream": True, "text": {"format": {"type": "json_schema", "name": "x",
                                                "schema": schema}}}  # fmt: skip
    events = [json.loads(line.removeprefix("data: "))
              for line in http.post("/v1/responses", json=body).text.splitlines()
              if line.startswith("data: {")]  # fmt: skip
    [error] = [e for e in events if e["type"] == "error"]
    assert error["param"] == "text.format.schema" and "response_format" not in error["message"]


def test_a_bad_format_schema_is_named_as_the_responses_field_in_the_message_too(http):
    """The message said "invalid response_format.json_schema.schema" (the chat's field)."""
    text = {"format": {"type": "json_schema", "name": "x", "schema": {"type": "strng"}}}
    response = http.post("/v1/responses", json={"model": MODEL_NAME, "input": "hi", "text": text})
    error = assert_error(response, 400, param="text.format.schema")
    assert "text.format.schema" in error["message"]
    assert "response_format" not in error["message"]


def test_an_error_in_a_stream_ends_it_with_response_failed(http):
    """A grammar that runs out of its lexer fuel fails once generation starts."""
    body = {"model": MODEL_NAME, "input": "hi", "stream": True, "max_output_tokens": 8,
            "structured_outputs": {"regex": "a{1000000}"}}  # fmt: skip
    with http.stream("POST", "/v1/responses", json=body) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    events = [json.loads(line.removeprefix("data: ")) for line in lines]
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-1]["response"]["status"] == "failed"
    assert "grammar" in events[-1]["response"]["error"]["message"]
    # One of OpenAI's codes (it was the chat's "invalid_value", which fails the SDK's type).
    assert events[-1]["response"]["error"]["code"] == "invalid_prompt"
    assert events[-1]["response"]["id"].startswith("resp_")  # as OpenAI's and vLLM's
    from openai.types.responses import ResponseFailedEvent

    ResponseFailedEvent.model_validate(events[-1])


def test_events_and_responses_validate_against_openai_types(http):
    """The openai client builds its models without validating them: validate strictly here,
    so that a missing or mistyped field fails."""
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    body = {"model": MODEL_NAME, "input": "Weather?", "tools": [WEATHER], "top_logprobs": 1,
            "max_output_tokens": 48, "temperature": 0,
            "tool_choice": {"type": "function", "name": "get_weather"}}  # fmt: skip
    Response.model_validate(http.post("/v1/responses", json=body).json(), strict=False)
    adapter = TypeAdapter(ResponseStreamEvent)
    for fields in ({}, {"tool_choice": "auto"}):
        with http.stream("POST", "/v1/responses", json={**body, **fields, "stream": True}) as r:
            lines = [line for line in r.iter_lines() if line.startswith(("event: ", "data: "))]
        kinds = [line.removeprefix("event: ") for line in lines[::2]]
        events = [json.loads(line.removeprefix("data: ")) for line in lines[1::2]]
        assert kinds == [event["type"] for event in events]
        for event in events:
            adapter.validate_python(event)


@pytest.mark.parametrize(
    "input_",
    [
        [{"role": "user", "content": {"type": "input_text"}}],
        [{"role": "user", "content": [{"type": "input_text"}]}],
        [{"role": "user", "content": [{"type": "input_image", "image_url": {"url": "x"}}]}],
        [{"role": "user", "content": [7]}],
        [{"type": "function_call", "arguments": 5}],
        [{"type": "function_call", "call_id": "c", "name": "f"},
         {"type": "function_call_output", "call_id": "c", "output": {"a": 1}}],
        [{"type": "function_call_output", "output": [{"type": "input_text", "text": "x"}]}],
        [{"type": None}],
        [[]],
        ["hello"],
    ],
)  # fmt: skip
def test_malformed_input_items_are_400s(http, input_):
    response = http.post("/v1/responses", json={"model": MODEL_NAME, "input": input_})
    assert_error(response, 400)
