"""Tool calls out of the model's text: Hermes blocks in "auto", the constrained shapes of
"required" and a named function, whatever the chunking of the stream."""

from __future__ import annotations

import json

import pytest

from engine.multimodal.tool_call_history import arguments_as_objects
from server.tool_calls import ToolPlan, tool_plan

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "get_time"}},
]
AUTO = ToolPlan("auto", TOOLS)
TWO_CALLS = (
    "Let me look.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


def run(plan: ToolPlan, text: str, chunk: int) -> tuple[list[str], str, list]:
    extractor = plan.extractor()
    streamed = [extractor.feed(text[i : i + chunk]) for i in range(0, len(text), chunk)]
    rest, calls = extractor.finish()
    return streamed, rest, calls


@pytest.mark.parametrize("chunk", [1, 3, 7, 1000])
def test_auto_streams_content_and_parses_every_block(chunk):
    streamed, rest, calls = run(AUTO, TWO_CALLS, chunk)
    assert "".join(streamed) + rest == "Let me look.\n"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "°C"}),
        ("get_time", {}),
    ]
    assert "°C" in calls[0].arguments  # not \\u-escaped
    assert calls[0].id != calls[1].id and calls[0].id.startswith("call_")


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_text_that_only_looks_like_a_call_is_content(chunk):
    text = "a <tool_ thing and <tool_call"
    streamed, rest, calls = run(AUTO, text, chunk)
    assert calls == [] and "".join(streamed) + rest == text
    # A tail that could still become <tool_call> waits; nothing else does.
    assert "".join(streamed) == "a <tool_ thing and "


def test_a_block_that_does_not_parse_leaves_everything_as_content():
    text = 'ok <tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>'
    streamed, rest, calls = run(AUTO, text, 4)
    assert calls == [] and "".join(streamed) + rest == text


def test_an_unclosed_last_block_still_counts_when_its_json_is_whole():
    text = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n'
    _, rest, calls = run(AUTO, text, 5)
    assert rest == "" and [(c.name, c.arguments) for c in calls] == [
        ("get_time", '{"zone": "UTC"}')
    ]


@pytest.mark.parametrize("chunk", [1, 1000])
def test_a_hermes_block_that_writes_parameters_keeps_its_arguments(chunk):
    """A model that writes Llama 3's key in a Hermes block: the call went out with
    arguments "{}", the model's arguments lost."""
    text = '<tool_call>\n{"name": "get_weather", "parameters": {"city": "Paris"}}\n</tool_call>'
    streamed, rest, calls = run(AUTO, text, chunk)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert "".join(streamed) + rest == ""


def test_required_and_named_shapes():
    required = ToolPlan("required", TOOLS)
    text = (
        '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"a": 1}}]'
    )
    streamed, rest, calls = run(required, text, 3)
    assert set(streamed) == {""} and rest == ""
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_time", "{}"),
        ("get_weather", '{"a": 1}'),
    ]
    assert run(required, '[{"name": "get_ti', 3)[1:] == ('[{"name": "get_ti', [])  # cut short
    named = ToolPlan("named", TOOLS, named="get_weather")
    streamed, rest, calls = run(named, '{"city": "Oslo"}', 4)
    assert set(streamed) == {""} and rest == ""
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Oslo"}')]


def test_finish_reasons():
    [call] = run(AUTO, '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', 9)[2]
    assert AUTO.finish_reason("stop", [call]) == "tool_calls"
    assert AUTO.finish_reason("stop", []) == "stop"
    assert AUTO.finish_reason("length", [call]) == "length"
    assert ToolPlan("named", TOOLS, named="get_time").finish_reason("stop", [call]) == "stop"


def test_plans():
    assert tool_plan(None, "auto", None) is None
    assert tool_plan(TOOLS, "none", None) is None
    assert tool_plan(TOOLS, None, None).mode == "auto"
    plan = tool_plan(TOOLS, {"type": "function", "function": {"name": "get_time"}}, False)
    assert plan.mode == "named" and plan.named == "get_time" and not plan.parallel
    assert json.loads(plan.constraint().json) == {"type": "object"}  # no parameters given


def test_arguments_become_objects_for_the_template():
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [
            {"id": "1", "function": {"name": "f", "arguments": '{"x": 1}'}},
            {"id": "2", "function": {"name": "g", "arguments": "not json"}}]},
    ]  # fmt: skip
    converted = arguments_as_objects(messages)
    calls = converted[1]["tool_calls"]
    assert calls[0]["function"]["arguments"] == {"x": 1}
    assert calls[1]["function"]["arguments"] == "not json"
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"x": 1}'  # untouched


def test_an_empty_tool_calls_list_is_no_calls():
    """fuzz123: `tool_calls: []` reached the template, and Llama 3.1's took it for a call
    (a 400, where vLLM drops the empty list as it drops null)."""
    messages = [{"role": "assistant", "content": "Hi", "tool_calls": []}]
    assert arguments_as_objects(messages) == [{"role": "assistant", "content": "Hi"}]
    assert messages[0]["tool_calls"] == []  # untouched


@pytest.mark.parametrize("arguments", ["", "  ", "null", None])
def test_empty_arguments_are_no_arguments(arguments):
    """An earlier call with `arguments: ""` reached the template as "", and Qwen3's wrote
    `"arguments": }` (fuzz79); vLLM reads empty and null arguments as {}."""
    messages = [{"role": "assistant", "tool_calls": [
        {"id": "1", "function": {"name": "f", "arguments": arguments}}]}]  # fmt: skip
    assert arguments_as_objects(messages)[0]["tool_calls"][0]["function"]["arguments"] == {}


def test_arguments_whose_json_escapes_a_lone_surrogate_stay_text():
    """'{"city": "\\ud800"}' decodes to a lone surrogate, which the tokenizer refused: a
    500 for a conversation that replays such a call. The template gets the text instead."""
    text = '{"city": "\\ud800", "n": [1]}'
    messages = [{"role": "assistant", "tool_calls": [
        {"id": "1", "function": {"name": "f", "arguments": text}}]}]  # fmt: skip
    assert arguments_as_objects(messages)[0]["tool_calls"][0]["function"]["arguments"] == text


def test_streamed_call_deltas_are_openai_chunks():
    from server.openai_replies import ChatCompletionChunk

    [call] = run(AUTO, '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', 4)[2]
    chunk = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m",
             "choices": [{"index": 0, "finish_reason": "tool_calls", "logprobs": None,
                          "delta": {"content": "", "tool_calls": [call.as_dict(0)]}}]}  # fmt: skip
    parsed = ChatCompletionChunk.model_validate(chunk)
    assert parsed.choices[0].delta.tool_calls[0].function.name == "get_time"


def test_a_named_functions_arguments_stream_as_they_come():
    extractor = ToolPlan("named", TOOLS, named="get_weather").extractor()
    pieces = [extractor.feed_stream(text) for text in ['{"ci', 'ty": ', "", '"Oslo"}']]
    assert [content for content, _ in pieces] == ["", "", "", ""]
    first, second, nothing, third = (deltas for _, deltas in pieces)
    assert first == [{"index": 0, "id": first[0]["id"], "type": "function",
                      "function": {"name": "get_weather", "arguments": '{"ci'}}]  # fmt: skip
    assert second == [{"index": 0, "function": {"arguments": 'ty": '}}] and nothing == []
    assert third == [{"index": 0, "function": {"arguments": '"Oslo"}'}}]
    content, last, [call] = extractor.finish_stream()
    assert content == "" and last == []  # all of it went out already
    assert (call.id, call.arguments) == (first[0]["id"], '{"city": "Oslo"}')


@pytest.mark.parametrize("text", ['{"alpha": ', "", '{"a": 1}\n'])
def test_a_named_calls_arguments_are_what_streamed_and_none_written_is_no_call(text):
    """A call cut by max_tokens after '{"alpha": ' streamed that, and answered
    '{"alpha":' unstreamed (fuzz53); nothing written (a stop string, or the budget spent
    thinking) was a call whose arguments, "", are not JSON (fuzz54)."""
    plan = ToolPlan("named", TOOLS, named="get_weather")
    _, rest, calls = run(plan, text, 3)
    assert rest == "" and [c.arguments for c in calls] == ([text] if text else [])
    extractor = plan.extractor()
    deltas = [delta for piece in (text[:4], text[4:]) for delta in extractor.feed_stream(piece)[1]]
    content, last, streamed_calls = extractor.finish_stream()
    assert content == "" and last == []
    assert [c.arguments for c in streamed_calls] == [c.arguments for c in calls]
    assert "".join(d["function"]["arguments"] for d in deltas) == text


def stream(plan: ToolPlan, text: str, chunk: int):
    """Every feed_stream's (content, deltas), then finish_stream's."""
    extractor = plan.extractor()
    pieces = [extractor.feed_stream(text[i : i + chunk]) for i in range(0, len(text), chunk)]
    return pieces, extractor.finish_stream()


@pytest.mark.parametrize("chunk", [1, 5, 1000])
def test_a_hermes_call_goes_out_as_soon_as_its_block_closes(chunk):
    pieces, (content, last, calls) = stream(AUTO, TWO_CALLS, chunk)
    streamed = [delta for _, deltas in pieces for delta in deltas] + last
    assert [(d["index"], d["function"]["name"]) for d in streamed] == [
        (0, "get_weather"), (1, "get_time")]  # fmt: skip
    assert [d["id"] for d in streamed] == [call.id for call in calls]
    assert [json.loads(d["function"]["arguments"]) for d in streamed] == [
        {"city": "Paris", "unit": "°C"}, {}]  # fmt: skip
    assert "".join(text for text, _ in pieces) + content == "Let me look.\n"
    if chunk < len(TWO_CALLS):  # the first call went out before the text was over
        first_end = TWO_CALLS.index("</tool_call>") + len("</tool_call>")
        sent_by = next(i for i, (_, deltas) in enumerate(pieces) if deltas)
        assert sent_by * chunk < first_end <= (sent_by + 1) * chunk


def test_an_unclosed_last_block_goes_out_at_the_end():
    text = TWO_CALLS.removesuffix("</tool_call>")
    pieces, (_, last, calls) = stream(AUTO, text, 4)
    assert [d["function"]["name"] for _, deltas in pieces for d in deltas] == ["get_weather"]
    assert [d["function"]["name"] for d in last] == ["get_time"] and last[0]["index"] == 1
    assert [call.name for call in calls] == ["get_weather", "get_time"]


def test_a_later_block_that_does_not_parse_is_content_once_a_call_went_out():
    bad = '<tool_call>\n{"name": "get_time", "arguments": {\n</tool_call>'
    text = TWO_CALLS.split('<tool_call>\n{"name": "get_time"')[0] + bad
    pieces, (content, last, calls) = stream(AUTO, text, 6)
    assert [call.name for call in calls] == ["get_weather"] and last == []
    assert content.strip() == bad
    # Not streamed, the whole answer is content (no call went out to stand by).
    assert run(AUTO, text, 6)[2] == []


def test_without_parallel_calls_only_the_first_goes_out():
    plan = ToolPlan("auto", TOOLS, parallel=False)
    pieces, (_, last, calls) = stream(plan, TWO_CALLS, 3)
    assert [d["function"]["name"] for _, deltas in pieces for d in deltas] + [
        d["function"]["name"] for d in last] == ["get_weather"]  # fmt: skip
    assert [call.name for call in calls] == ["get_weather"]


REQUIRED_TWO = ('[{"name": "get_weather", "parameters": {"city": "Oslo", "n": [1, {"a": 2}]}}, '
                '{"name": "get_time", "parameters": {}}]')  # fmt: skip
LLAMA_TWO = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "n": '
             '[1, {"a": 2}]}}; {"name": "get_time", "parameters": {}}')  # fmt: skip


@pytest.mark.parametrize("chunk", [1, 4, 1000])
@pytest.mark.parametrize(
    ("plan", "text"),
    [(ToolPlan("required", TOOLS), REQUIRED_TWO),
     (ToolPlan("auto", TOOLS, format="llama3_json"), LLAMA_TWO)],
)  # fmt: skip
def test_json_calls_go_out_as_soon_as_their_objects_close(chunk, plan, text):
    pieces, (content, last, calls) = stream(plan, text, chunk)
    streamed = [delta for _, deltas in pieces for delta in deltas] + last
    assert [(d["index"], d["function"]["name"]) for d in streamed] == [
        (0, "get_weather"), (1, "get_time")]  # fmt: skip
    assert [d["id"] for d in streamed] == [call.id for call in calls]
    assert json.loads(streamed[0]["function"]["arguments"]) == {"city": "Oslo", "n": [1, {"a": 2}]}
    assert content == "" and all(text == "" for text, _ in pieces)
    if chunk < len(text):  # the first call went out before the second one began
        sent_by = next(i for i, (_, deltas) in enumerate(pieces) if deltas)
        assert sent_by * chunk < text.index('"get_time"')


def test_json_calls_that_stop_parsing_leave_the_rest_as_content():
    cut = REQUIRED_TWO[: REQUIRED_TWO.index('"get_time"') + 4]  # max_tokens cut the second
    pieces, (content, last, calls) = stream(ToolPlan("required", TOOLS), cut, 3)
    assert [call.name for call in calls] == ["get_weather"] and last == []
    assert content == cut[cut.index("}}, ") + 2 :]  # the sent call stands
    one = ToolPlan("required", TOOLS, parallel=False)
    pieces, (_, last, calls) = stream(one, '[{"name": "get_time", "parameters": {}}]', 2)
    assert [d["function"]["name"] for _, deltas in pieces for d in deltas] == ["get_time"]
    assert last == [] and [call.name for call in calls] == ["get_time"]


LLAMA = ToolPlan("auto", TOOLS, format="llama3_json")


@pytest.mark.parametrize("chunk", [1, 4, 1000])
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"name": "get_time", "parameters": {"zone": "UTC"}}', [("get_time", '{"zone": "UTC"}')]),
        ('<|python_tag|>{"name": "get_time", "parameters": {}}; '
         '{"name": "get_weather", "arguments": {"city": "a;b"}}',
         [("get_time", "{}"), ("get_weather", '{"city": "a;b"}')]),
        ('  \n{"name": "get_time", "parameters": {}}\n', [("get_time", "{}")]),
    ],
)  # fmt: skip
def test_llama3_json_calls(chunk, text, expected):
    streamed, rest, calls = run(LLAMA, text, chunk)
    assert "".join(streamed) == "" and rest == ""
    assert [(c.name, c.arguments) for c in calls] == expected


@pytest.mark.parametrize("chunk", [1, 4, 1000])
def test_llama3_json_plain_answers_stream_as_content(chunk):
    text = "  The weather is {fine}; no call needed."
    streamed, rest, calls = run(LLAMA, text, chunk)
    assert calls == [] and "".join(streamed) + rest == text
    assert "".join(streamed).startswith("  The")  # streamed as it came, not held to the end
    not_a_call = '{"weather": "fine"}'
    _, rest, calls = run(LLAMA, not_a_call, chunk)
    assert calls == [] and rest == not_a_call  # JSON, but no call: content


def test_the_format_follows_the_chat_template():
    from engine.tiny_model import read_chat_template
    from server.tool_calls import call_format

    llama = 'Environment: ipython\n{{- "<|python_tag|>" + tool_call.name }}'
    assert call_format("auto", read_chat_template()) == "hermes"
    assert call_format("auto", llama) == "llama3_json"
    assert call_format("auto", None) == "hermes"
    assert call_format("hermes", llama) == "hermes"  # an explicit parser wins


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json"])
def test_auto_without_parallel_calls_keeps_the_first_call_only(fmt):
    text = TWO_CALLS if fmt == "hermes" else (
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_time", "parameters": {}}'
    )  # fmt: skip
    for parallel, names in ((True, ["get_weather", "get_time"]), (False, ["get_weather"])):
        plan = ToolPlan("auto", TOOLS, parallel=parallel, format=fmt)
        _, _, calls = run(plan, text, 5)
        assert [call.name for call in calls] == names


@pytest.mark.parametrize(
    "plan,text",
    [
        (AUTO, '<tool_call>\n{"name": "get_time", "arguments": {"zone": "\\ud800 \\udfff"}}\n</tool_call>'),
        (AUTO, '<tool_call>\n{"name": "get_time", "arguments": "{\\"zone\\": \\"\\ud800\\"}"}\n</tool_call>'),
        (LLAMA, '{"name": "get_time", "parameters": {"zone": "\\ud800 \\udfff"}}'),
        (ToolPlan("required", TOOLS), '[{"name": "get_time", "parameters": {"zone": "\\ud800 \\udfff"}}]'),
    ],
)  # fmt: skip
def test_arguments_with_lone_surrogate_escapes_go_out_as_escapes(plan, text):
    """A model may write any \\u escape. Decoded, a lone surrogate cannot be sent as UTF-8
    (the response was a 500, the stream cut): the arguments keep the escape, which is the
    same JSON value."""
    _, rest, calls = run(plan, text, 5)
    assert rest == "" and [c.name for c in calls] == ["get_time"]
    arguments = calls[0].arguments
    arguments.encode("utf-8")  # raised UnicodeEncodeError before the fix
    assert json.loads(arguments)["zone"] in ("\ud800 \udfff", "\ud800")


def test_a_call_whose_name_holds_a_lone_surrogate_is_content():
    text = '<tool_call>\n{"name": "get_\\ud800", "arguments": {}}\n</tool_call>'
    _, rest, calls = run(AUTO, text, 1000)
    assert calls == [] and rest == text


def test_json_nested_past_the_stack_is_no_call_and_no_crash():
    """json.loads raises RecursionError, not ValueError, on "[" * 2000: from a request's
    assistant arguments (a 500 before) or from the model's own answer."""
    deep = "[" * 5000 + "]" * 5000
    messages = [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": deep}}]}]  # fmt: skip
    assert arguments_as_objects(messages)[0]["tool_calls"][0]["function"]["arguments"] == deep
    text = f'<tool_call>\n{{"name": "get_time", "arguments": {deep}}}\n</tool_call>'
    for plan in (AUTO, LLAMA, ToolPlan("required", TOOLS)):
        body = text if plan is AUTO else f'{{"name": "get_time", "parameters": {deep}}}'
        if plan.mode == "required":
            body = f"[{body}]"
        _, rest, calls = run(plan, body, 1000)
        assert calls == [] and rest == body


@pytest.mark.parametrize(
    "parameters",
    [
        {"$defs": {"A": {"type": "integer"}}, "type": "object",
         "properties": {"a": {"$ref": "#/$defs/A"}, "b": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}},
        # a resource of its own: its references resolve against its $id, not the document
        {"$id": "https://example.com/s.json", "type": "object", "$defs": {"A": {"type": "integer"}},
         "properties": {"a": {"$ref": "#/$defs/A"}}, "required": ["a"]},
        # an anchor names a place wherever it sits: not a pointer to rewrite
        {"type": "object", "$defs": {"A": {"$anchor": "aa", "type": "integer"}},
         "properties": {"a": {"$ref": "#aa"}}, "required": ["a"]},
    ],
)  # fmt: skip
def test_required_keeps_each_schemas_references_resolvable(parameters):
    """The "required" grammar nests each tool's schema in an array schema; its references
    must still reach what they named there."""
    from engine.structured_output import grammar_error

    tools = [*TOOLS, {"type": "function", "function": {"name": "f", "parameters": parameters}}]
    assert grammar_error(ToolPlan("required", tools).constraint()) is None


def streamed_message(plan: ToolPlan, text: str, chunk: int) -> tuple[str, list[tuple[str, str]]]:
    """What a client rebuilds from a stream's content and tool-call deltas."""
    extractor = plan.extractor()
    content, calls = "", {}

    def take(deltas):
        for delta in deltas:
            call = calls.setdefault(delta["index"], ["", ""])
            call[0] += delta["function"].get("name") or ""
            call[1] += delta["function"].get("arguments") or ""

    for start in range(0, len(text), chunk):
        piece, deltas = extractor.feed_stream(text[start : start + chunk])
        content += piece
        take(deltas)
    rest, deltas, _ = extractor.finish_stream()
    take(deltas)
    return content + rest, [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("plan, text", [
    (ToolPlan("required", TOOLS),
     '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "param'),
    (AUTO, TWO_CALLS.replace('"arguments": {}}', '"arguments": {')),
    (AUTO, TWO_CALLS),
    (ToolPlan("required", TOOLS), '[{"name": "get_time", "parameters": {}}]'),
])  # fmt: skip
def test_a_whole_answer_splits_as_its_stream_does(plan, text):
    """Cut by max_tokens inside a later call: streamed, the calls closed before were sent
    and the rest was content; the whole answer had no calls and all of it as content."""
    content, calls = plan.split(text)
    whole = (content, [(call.name, call.arguments) for call in calls])
    for chunk in (1, 5, len(text)):
        assert streamed_message(plan, text, chunk) == whole, chunk


def test_a_replayed_call_may_have_null_arguments():
    """`arguments: null` was a 400 ("Input should be a valid string"); vLLM reads it as {}
    (fuzz80)."""
    from server.openai_models import ChatCompletionRequest

    request = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": None}}]}]})  # fmt: skip
    assert request.messages[1].tool_calls[0].function.arguments is None


def test_arguments_at_every_nesting_depth_never_raise():
    """json.dumps overflows the stack one level before json.loads: at that one depth the
    check raised RecursionError, a 500 (fuzz88). Every depth up to past the recursion
    limit either converts or stays text."""
    import sys

    for depth in range(1, sys.getrecursionlimit() + 50):
        text = "[" * depth + "]" * depth
        messages = [{"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": text}}]}]  # fmt: skip
        arguments = arguments_as_objects(messages)[0]["tool_calls"][0]["function"]["arguments"]
        assert arguments == text or isinstance(arguments, list)


@pytest.mark.parametrize("tool_calls", ["abc", 5, [5], [{"function": "f"}]])
def test_tool_calls_of_another_shape_are_left_for_the_template(tool_calls):
    """Only the offline LLM can be given these (the server's are typed): converting them
    raised out of LLM.chat for the whole batch (fuzz88)."""
    messages = [{"role": "assistant", "tool_calls": tool_calls}]
    assert arguments_as_objects(messages) == messages
