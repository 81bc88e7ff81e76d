"""Tool calls over HTTP: the tools reach the prompt through the chat template (as
transformers renders it), a named or "required" tool choice constrains the answer to
calls, and in "auto" the server parses the model's <tool_call> blocks. The tiny model's
weights are random, so "auto" is driven by a regex that makes it write a call."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from tests.e2e.conftest import MODEL_NAME, run_server

transformers = pytest.importorskip("transformers")

WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}, "days": {"enum": [1, 2, 3]}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Forecast",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]  # fmt: skip
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "Weather in Paris for two days?"}]


def create(client, **kwargs):
    kwargs = {"max_tokens": 96, "temperature": 0, "tools": TOOLS, **kwargs}
    return client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, **kwargs)


def streamed(client, **kwargs) -> tuple[str, list[dict], list]:
    """Content, tool calls (accumulated by index as clients do) and finish reasons; each
    call also counts the chunks its pieces came in."""
    content, calls, reasons = "", {}, []
    for chunk in create(client, stream=True, **kwargs):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(
                delta.index, {"id": "", "name": "", "arguments": "", "chunks": 0}
            )
            call["id"] += delta.id or ""
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
            call["chunks"] += 1
        reasons.append(choice.finish_reason)
    return content, [calls[i] for i in sorted(calls)], [r for r in reasons if r]


def check_calls(calls) -> None:
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_a_named_function_is_called(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    response = create(client, tool_choice=choice)
    message = response.choices[0].message
    assert message.content is None and response.choices[0].finish_reason == "stop"
    [call] = message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    check_calls(message.tool_calls)
    content, calls, reasons = streamed(client, tool_choice=choice)
    assert content == "" and reasons == ["stop"]
    assert [(c["name"], c["arguments"]) for c in calls] == [
        ("get_weather", call.function.arguments)
    ]
    assert calls[0]["chunks"] > 3  # the arguments streamed as they were generated


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function",
                                                      "function": {"name": "get_weather"}}])  # fmt: skip
def test_a_forced_calls_stream_has_no_content_from_its_first_chunk(client, tool_choice):
    """fuzz120: the role chunk said `content: ""`, so the openai SDK's stream helper ended
    with content "" where the answer (and OpenAI's stream) has null."""
    kwargs = {"max_tokens": 96, "temperature": 0, "tools": TOOLS, "tool_choice": tool_choice}
    plain = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, **kwargs)
    with client.chat.completions.stream(model=MODEL_NAME, messages=MESSAGES, **kwargs) as stream:
        final = stream.get_final_completion()
    assert plain.choices[0].message.content is None
    assert final.choices[0].message.content is None
    assert final.choices[0].message.tool_calls[0].function.arguments == (
        plain.choices[0].message.tool_calls[0].function.arguments
    )
    chunks = list(create(client, stream=True, tool_choice=tool_choice, logprobs=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    # every chunk, those that carry only logprobs too (fuzz121: they said "")
    assert [c.choices[0].delta.content for c in chunks if c.choices] == [None] * len(chunks)


def test_required_calls_one_or_more_tools(client):
    response = create(client, tool_choice="required", temperature=1.0, seed=3)
    assert response.choices[0].finish_reason == "tool_calls"
    calls = response.choices[0].message.tool_calls
    assert calls and all(c.function.name in SCHEMAS for c in calls)
    check_calls(calls)
    single = create(client, tool_choice="required", parallel_tool_calls=False)
    assert len(single.choices[0].message.tool_calls) == 1
    content, streamed_calls, reasons = streamed(client, tool_choice="required", temperature=1.0,
                                                seed=3)  # fmt: skip
    assert content == "" and reasons == ["tool_calls"]
    assert [(c["name"], c["arguments"], c["chunks"]) for c in streamed_calls] == [
        (c.function.name, c.function.arguments, 1) for c in calls]  # each whole, as it closed


def test_required_calls_keep_to_schemas_with_local_references(client):
    """pydantic's tools (openai.pydantic_function_tool): "$ref": "#/$defs/..." and a "#"
    that recurses. "required" nests each schema in an array schema, where such references
    pointed at the array's root: a 400 "Pointer '/$defs/Color' does not exist"."""
    paint = {
        "$defs": {"Color": {"enum": ["red", "blue"]}},
        "type": "object",
        "properties": {"color": {"$ref": "#/$defs/Color"},
                       "inner": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
        "required": ["color", "inner"],
        "additionalProperties": False,
    }  # fmt: skip
    tools = [*TOOLS, {"type": "function", "function": {"name": "paint", "parameters": paint}}]
    for seed in range(3):
        response = create(client, tools=tools, tool_choice="required", temperature=1.0,
                          seed=seed, max_tokens=200)  # fmt: skip
        assert response.choices[0].finish_reason == "tool_calls"
        for call in response.choices[0].message.tool_calls:
            schema = {**SCHEMAS, "paint": paint}[call.function.name]
            jsonschema.validate(json.loads(call.function.arguments), schema)


def test_auto_parses_the_calls_the_model_writes(client):
    regex = (
        r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
        r'\{"city": "(Paris|Oslo)", "days": [12]\}\}\n</tool_call>'
    )
    forced = {"structured_outputs": {"regex": regex}}
    response = create(client, extra_body=forced)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking.\n"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    check_calls([call])
    content, calls, reasons = streamed(client, extra_body=forced)
    assert content == "Checking.\n" and reasons == ["tool_calls"]
    assert [(c["name"], c["arguments"]) for c in calls] == [
        ("get_weather", call.function.arguments)
    ]
    # Without a call in the answer, auto is plain chat.
    plain = create(client, extra_body={"structured_outputs": {"choice": ["No tool needed."]}})
    assert plain.choices[0].message.content == "No tool needed."
    assert plain.choices[0].message.tool_calls is None
    assert plain.choices[0].finish_reason == "stop"


def test_a_streamed_call_comes_before_its_finish_as_openai_sends_them(client):
    """The last call shared its chunk with finish_reason, and the openai SDK's stream
    helper never said that call's arguments were done; its chunks said content "" where
    OpenAI says null (the SDK's final message then had content '' where the whole answer
    has None)."""
    regex = r'<tool_call>\n\{"name": "get_time", "arguments": \{"zone": "UTC"\}\}\n</tool_call>'
    chunks = [c.choices[0] for c in create(client, stream=True,
              extra_body={"structured_outputs": {"regex": regex}}) if c.choices]  # fmt: skip
    with_calls = [c for c in chunks if c.delta.tool_calls]
    assert with_calls and all(c.finish_reason is None for c in with_calls)
    assert all(c.delta.content is None for c in with_calls)
    assert chunks[-1].finish_reason == "tool_calls" and not chunks[-1].delta.tool_calls
    with client.chat.completions.stream(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS,
                                        max_tokens=96, temperature=0,
                                        extra_body={"structured_outputs": {"regex": regex}}) as stream:  # fmt: skip
        done = [e for e in stream if e.type == "tool_calls.function.arguments.done"]
        final = stream.get_final_completion().choices[0].message
    assert [e.name for e in done] == ["get_time"] and not final.content


def test_tools_and_earlier_calls_reach_the_prompt_as_transformers_renders_them(client, model_dir):
    conversation = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]  # fmt: skip
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    for tool_choice, tools in (("auto", TOOLS), ("none", None)):
        rendered = [
            {**m, "tool_calls": [{**c, "function": {**c["function"],
                                                    "arguments": json.loads(c["function"]["arguments"])}}
                                 for c in m["tool_calls"]]} if m.get("tool_calls") else m
            for m in conversation
        ]  # fmt: skip
        text = hf_tokenizer.apply_chat_template(
            rendered, tools=tools, tokenize=False, add_generation_prompt=True
        )
        expected = hf_tokenizer(text, add_special_tokens=False)["input_ids"]
        response = client.chat.completions.create(
            model=MODEL_NAME, messages=conversation, tools=TOOLS, tool_choice=tool_choice,
            max_tokens=2, temperature=0,
        )  # fmt: skip
        assert response.usage.prompt_tokens == len(expected), tool_choice
    # /tokenize counts what the chat runs, tools included (vLLM's takes them too; they
    # were ignored: 27 tokens for a 290-token prompt).
    url = str(client.base_url).removesuffix("/v1/") + "/tokenize"
    body = {"model": MODEL_NAME, "messages": conversation, "tools": TOOLS}
    counted = httpx.post(url, json=body, timeout=30).json()["count"]
    with_tools = hf_tokenizer.apply_chat_template(rendered, tools=TOOLS, tokenize=False,
                                                  add_generation_prompt=True)  # fmt: skip
    assert counted == len(hf_tokenizer(with_tools, add_special_tokens=False)["input_ids"])


def test_an_earlier_call_whose_arguments_escape_a_lone_surrogate_is_answered(client):
    """Its JSON text decodes to a lone surrogate that no tokenizer takes: that was a 500
    (chat and Responses alike); the template now gets the arguments' text as it came."""
    arguments = '{"city": "\\ud800"}'  # valid JSON text: the escape, not the surrogate
    conversation = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]  # fmt: skip
    response = client.chat.completions.create(model=MODEL_NAME, messages=conversation,
                                              tools=TOOLS, max_tokens=2)  # fmt: skip
    assert response.usage.completion_tokens >= 1  # answered (EOS may come first)
    replayed = client.responses.create(model=MODEL_NAME, max_output_tokens=2, input=[
        *MESSAGES,
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": arguments},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}])  # fmt: skip
    assert replayed.usage.output_tokens >= 1


@pytest.fixture(scope="module")
def llama_client(model_dir, tmp_path_factory):
    openai = pytest.importorskip("openai")
    log = tmp_path_factory.mktemp("llama_tools") / "server.log"
    with run_server(model_dir, log, "--tool-call-parser", "llama3_json") as handle:
        yield openai.OpenAI(base_url=handle.base_url + "/v1", api_key="unused", max_retries=0)


def test_llama3_json_calls_are_parsed_when_that_parser_is_set(llama_client):
    regex = r'\{"name": "get_time", "parameters": \{"zone": "(UTC|CET)"\}\}'
    forced = {"structured_outputs": {"regex": regex}}
    response = create(llama_client, extra_body=forced)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_time"
    check_calls([call])
    content, calls, reasons = streamed(llama_client, extra_body=forced)
    assert content == "" and reasons == ["tool_calls"]
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_time", call.function.arguments)]
    text = {"structured_outputs": {"choice": ["Sunny, no call needed."]}}
    content, calls, reasons = streamed(llama_client, extra_body=text)
    assert (content, calls, reasons) == ("Sunny, no call needed.", [], ["stop"])
