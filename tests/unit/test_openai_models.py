"""Request models and the pydantic-error -> OpenAI error mapping."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from engine.errors import ContextLengthExceeded, InvalidRequest
from engine.protocol import StructuredOutput
from server.errors import loc_to_param, validation_error_to_invalid
from server.openai_models import ChatCompletionRequest, CompletionRequest, DetokenizeRequest
from server.sampling_params import build_sampling_params

BASE = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def invalid(body):
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate(body)
    return validation_error_to_invalid(info.value.errors())


def test_parts_and_defaults():
    request = ChatCompletionRequest.model_validate({
        **BASE, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "a"},
            {"type": "image_url", "image_url": {"url": "data:x"}}]}],
        "stop": "END", "unknown_field": 1,
    })
    assert request.stop_list == ["END"] and request.n == 1 and not request.include_usage
    assert request.num_logprobs is None


def test_max_completion_tokens_wins_and_logprobs():
    request = ChatCompletionRequest.model_validate(
        {**BASE, "max_tokens": 5, "max_completion_tokens": 7, "logprobs": True, "top_logprobs": 2})
    assert request.requested_max_tokens == 7 and request.num_logprobs == 2


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({**BASE, "temperature": 3}, "temperature"),
        ({"model": "m"}, "messages"),
        ({**BASE, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "messages[0].content[0].image_url"),
        ({**BASE, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {}}]}]}, "messages[0].content[0].image_url.url"),
        # a part's own field (uuid sits beside image_url): the union's tag is no field
        ({**BASE, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "x"}, "uuid": ""}]}]},
         "messages[0].content[0].uuid"),
        ({**BASE, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
         "messages[0].content[0].text"),
        ({**BASE, "top_logprobs": 50}, "top_logprobs"),
        ({**BASE, "top_logprobs": 2}, "top_logprobs"),  # without logprobs: OpenAI's 400 too
        ({**BASE, "messages": [{"role": "user", "content": [{"type": "video_features",
          "video_features": {"url": "s3://b/k", "grid_thw": [2, 4, 4], "frame_seconds": [-1]}}]}]},
         "messages[0].content[0].video_features.frame_seconds[0]"),
        ({**BASE, "messages": [{"role": "user", "content": [{"type": "video_features",
          "video_features": {"url": "s3://b/k", "grid_thw": [2, 4, 4],
                             "frame_seconds": [0.0, 1e300]}}]}]},  # a 300-digit time
         "messages[0].content[0].video_features.frame_seconds[1]"),
        ({**BASE, "messages": [{"role": "user", "content": [{"type": "video_features",
          "video_features": {"url": "s3://b/k", "grid_thw": [2, 4, 4],
                             "frame_seconds": [0.5] * 5000}}]}]},
         "messages[0].content[0].video_features.frame_seconds"),
        # true and "50000" were read as 1 and 50000 (fuzz69)
        ({**BASE, "mm_processor_kwargs": {"max_pixels": True}}, "mm_processor_kwargs.max_pixels"),
        ({**BASE, "mm_processor_kwargs": {"min_pixels": "5000"}}, "mm_processor_kwargs.min_pixels"),
        ({**BASE, "mm_processor_kwargs": {"fps": "2"}}, "mm_processor_kwargs.fps"),
        # true, "4" and 4.0 were read as 1, 4 and 4 (fuzz61)
        ({**BASE, "messages": [{"role": "user", "content": [{"type": "image_features",
          "image_features": {"url": "s3://b/k", "grid_thw": [True, 4, "4"]}}]}]},
         "messages[0].content[0].image_features.grid_thw[0]"),
        ({**BASE, "messages": [{"role": "user", "content": [{"type": "image_features",
          "image_features": {"url": "s3://b/k", "grid_thw": [1, 4, 4.0]}}]}]},
         "messages[0].content[0].image_features.grid_thw[2]"),
    ],
)
def test_validation_error_param_paths(body, param):
    error = invalid(body)
    assert error.status == 400 and error.param == param


def test_loc_to_param_skips_union_members():
    # pydantic names the member (its tag: "text"), then the field ("text")
    loc = ("body", "messages", 0, "content", "list[tagged-union[A,B]]", 1, "text", "text")
    assert loc_to_param(loc) == "messages[0].content[1].text"
    assert loc_to_param(("body", "tool_choice", "NamedToolChoice", "function")) == (
        "tool_choice.function"
    )


def test_sampling_params_defaults_and_context():
    request = ChatCompletionRequest.model_validate({**BASE, "top_k": -1, "seed": 4})
    params = build_sampling_params(request, num_prompt_tokens=10, max_model_len=100)
    assert params.max_tokens == 90 and params.top_k == 0 and params.seed == 4
    assert params.temperature == 1.0 and params.logprobs is None
    request = ChatCompletionRequest.model_validate({**BASE, "max_tokens": 95})
    with pytest.raises(ContextLengthExceeded) as info:
        build_sampling_params(request, num_prompt_tokens=10, max_model_len=100)
    assert "100" in info.value.message and "95" in info.value.message


def test_completion_logprobs_int():
    request = CompletionRequest.model_validate({"model": "m", "prompt": [1, 2], "logprobs": 3})
    assert request.num_logprobs == 3


def test_logit_bias_becomes_sorted_pairs():
    request = ChatCompletionRequest.model_validate(
        {**BASE, "logit_bias": {"42": -100, "7": 2.5, "007": 3}})
    params = build_sampling_params(request, num_prompt_tokens=10, max_model_len=100)
    assert params.logit_bias == ((7, 3.0), (42, -100.0))  # "007" names token 7 too
    completion = CompletionRequest.model_validate(
        {"model": "m", "prompt": "x", "logit_bias": {"5": 1}})
    assert completion.logit_bias_pairs == ((5, 1.0),)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"logit_bias": {"abc": 1}}, "token ids"),
        ({"logit_bias": {"-3": 1}}, "token ids"),
        ({"logit_bias": {"\u0661": 1}}, "token ids"),  # a non-ASCII digit
        ({"logit_bias": {"9" * 5000: 1}}, "token ids"),
        ({"logit_bias": {"3": 101}}, "[-100, 100]"),
        ({"logit_bias": {"3": "nan"}}, "finite number"),  # param logit_bias.3
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "at most 300"),
        # were ignored (fuzz59): a forced function_call answered in text, audio as text
        ({"function_call": {"name": "f"}}, "use tools and tool_choice"),
        ({"functions": [{"name": "f", "parameters": {}}]}, "use tools and tool_choice"),
        ({"modalities": ["text", "audio"]}, "only text output"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio output is not supported"),
    ],
)
def test_fields_tessera_cannot_honour_are_400_naming_them(fields, message):
    error = invalid({**BASE, **fields})
    field = next(iter(fields))
    assert error.status == 400 and error.param.partition(".")[0] == field
    assert message in error.message


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}},
         (StructuredOutput(json='{"type": "object"}'), "response_format")),
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "n", "schema": {"type": "array"}}}},
         (StructuredOutput(json='{"type": "array"}'), "response_format.json_schema.schema")),
        ({"structured_outputs": {"json": {"type": "integer"}}},
         (StructuredOutput(json='{"type": "integer"}'), "structured_outputs.json")),
        ({"structured_outputs": {"json": '{"type": "null"}'}},
         (StructuredOutput(json='{"type": "null"}'), "structured_outputs.json")),
        ({"structured_outputs": {"json_object": True}},
         (StructuredOutput(json='{"type": "object"}'), "structured_outputs")),
        ({"structured_outputs": {"regex": "a+"}},
         (StructuredOutput(regex="a+"), "structured_outputs.regex")),
        ({"structured_outputs": {"choice": ["x", "y"]}},
         (StructuredOutput(choice=("x", "y")), "structured_outputs")),
        ({"response_format": {"type": "text"}, "structured_outputs": {"regex": "a"}},
         (StructuredOutput(regex="a"), "structured_outputs.regex")),
    ],
)  # fmt: skip
def test_constraints_become_the_engines_structured_output(fields, expected):
    request = ChatCompletionRequest.model_validate({**BASE, **fields})
    assert request.structured_output == expected
    completion = CompletionRequest.model_validate({"model": "m", "prompt": "p", **fields})
    assert completion.structured_output == expected


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}},
         "response_format.json_schema.schema"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "json_object": True}}, "structured_outputs"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"choice": ["x"] * 257}}, "structured_outputs.choice"),
        ({"structured_outputs": {"regex": "a" * 4097}}, "structured_outputs.regex"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
         "structured_outputs"),
    ],
)  # fmt: skip
def test_bad_constraints_are_400_naming_the_field(fields, param):
    error = invalid({**BASE, **fields})
    assert error.status == 400 and error.param == param


def test_plain_text_format_and_tools_that_are_never_called_are_accepted():
    request = ChatCompletionRequest.model_validate({
        **BASE, "response_format": {"type": "text"},
        "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none",
    })
    assert request.response_format.type == "text"


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]},
         "tools[0].function.name"),
        ({"tools": [TOOL] * 129}, "tools"),
        # the tools' own error, not "tool_choice 'required' needs tools"
        ({"tools": [TOOL] * 129, "tool_choice": "required"}, "tools"),
        # two functions of one name: the grammar followed the last, the prompt showed both
        ({"tools": [TOOL, {**TOOL, "function": {**TOOL["function"], "parameters": {}}}]},
         "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        # fuzz99: both were a 200, where OpenAI and vLLM refuse them
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tools": []}, "tools"),
        ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "other"}}},
         "tool_choice"),
        ({"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
         "tool_choice"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"function": {}}]}]},
         "messages[0].tool_calls[0].function.name"),
    ],
)  # fmt: skip
def test_bad_tools_are_400_naming_the_field(fields, param):
    error = invalid({**BASE, **fields})
    assert error.status == 400 and error.param == param
    assert "Value error" not in error.message  # pydantic's tag on our validators' words


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "user", "content": None}, "messages[0].content"),
        ({"role": "system"}, "messages[0].content"),
        ({"role": "function", "name": "f", "content": "4"}, "messages[0]"),
        ({"role": "user", "content": [{"type": "image_url",
          "image_url": {"url": "data:x", "detail": "bogus"}}]},
         "messages[0].content[0].image_url.detail"),
        ({"role": "user", "content": [{"type": "refusal", "refusal": "no"}]},
         "messages[0].content[0]"),
        # fuzz102: it named messages[0].content[0].text, which the client never sent
        ({"role": "assistant", "content": [{"type": "refusal"}]}, "messages[0].content"),
    ],
)  # fmt: skip
def test_messages_openai_refuses_are_400_naming_the_field(message, param):
    """fuzz99: a user's null content was an empty turn and any `detail` was taken, where
    OpenAI and vLLM refuse both; the deprecated `function` role gets words of its own."""
    error = invalid({**BASE, "messages": [message]})
    assert error.status == 400 and error.param == param, error
    assert "Value error" not in error.message


def test_history_saved_from_openai_is_accepted():
    """An assistant turn's `refusal` part is its text (fuzz99: a 400 refused OpenAI's own
    history shape); an assistant or tool turn may have no content."""
    request = ChatCompletionRequest.model_validate({**BASE, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": None},
        {"role": "user", "content": [{"type": "image_url",
                                      "image_url": {"url": "data:x", "detail": "low"}}]},
        # fuzz102: OpenAI's newest detail value (the openai package has it) was refused
        {"role": "user", "content": [{"type": "image_url",
                                      "image_url": {"url": "data:x", "detail": "original"}}]},
    ]})  # fmt: skip
    assert request.messages[1].content[0].text == "I can't."


def test_truncation_side_is_left_or_a_400():
    """vLLM's field was ignored, so "right" kept the last tokens all the same (fuzz103)."""
    fields = {**BASE, "truncate_prompt_tokens": 3}
    assert ChatCompletionRequest.model_validate({**fields, "truncation_side": "left"})
    for side in ("right", "bogus"):
        error = invalid({**fields, "truncation_side": side})
        assert error.param == "truncation_side" and "'left'" in error.message


def test_tool_choice_picks_the_plan_and_its_grammar():
    def plan_of(**fields):
        return ChatCompletionRequest.model_validate({**BASE, "tools": [TOOL], **fields})

    auto = plan_of()
    assert auto.tool_plan.mode == "auto" and auto.structured_output is None
    assert plan_of(tool_choice="none").tool_plan is None
    named = plan_of(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    spec, param = named.structured_output
    assert param == "tools" and json.loads(spec.json) == TOOL["function"]["parameters"]
    required = plan_of(tool_choice="required", parallel_tool_calls=False)
    schema = json.loads(required.structured_output[0].json)
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    [call] = schema["items"]["anyOf"]
    assert call["properties"]["name"] == {"const": "get_weather"}
    # Asking for a JSON answer while the model may still call a tool is fine.
    both = plan_of(response_format={"type": "json_object"})
    assert both.tool_plan.mode == "auto" and both.structured_output[1] == "response_format"



def test_a_truncation_through_the_last_image_names_that_image():
    """Every image before the cut goes, but the one the cut splits is the one to name (the
    400 named the first image's tokens, as "a image")."""
    from engine.protocol import MediaInput, Modality
    from server.generation import PreparedPrompt

    def image(offset: int) -> MediaInput:
        return MediaInput(modality=Modality.IMAGE, content_hash="h", offset=offset,
                          num_tokens=4, grid_thw=(1, 4, 4))  # fmt: skip

    prompt = PreparedPrompt(token_ids=list(range(20)), media=[image(2), image(10)])
    with pytest.raises(InvalidRequest, match=r"cut away an image \(tokens 10-13\)"):
        prompt.keep_last(8)  # the cut falls at 12, inside the second image
    with pytest.raises(InvalidRequest, match=r"an image \(tokens 2-5\)"):
        prompt.keep_last(10)  # at 10: the second image stays whole, the first goes
    assert prompt.keep_last(20) is prompt


@pytest.mark.parametrize("fields, param", [
    ({"suffix": "\n    return result\n"}, "suffix"),
    ({"best_of": 4}, "best_of"),
    ({"best_of": 1, "n": 2}, "best_of"),
])  # fmt: skip
def test_completion_fields_that_change_the_answer_and_are_not_served_are_refused(fields, param):
    """`suffix` (fill in the middle) and `best_of` were ignored: a 200 with the answer
    given without them, so a FIM client got a wrong answer with no sign (vLLM refuses a
    suffix; OpenAI refuses best_of below n)."""
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"model": "m", "prompt": "def f():", **fields})
    assert validation_error_to_invalid(info.value.errors()).param == param


def test_completion_fields_that_change_nothing_are_accepted():
    for fields in ({"suffix": None}, {"suffix": ""}, {"best_of": 1}, {"best_of": 3, "n": 3}):
        CompletionRequest.model_validate({"model": "m", "prompt": "x", **fields})


def test_a_body_of_millions_of_items_is_refused_before_they_are_validated():
    """Each item of a list was validated before its length was checked (2.4 M empty text
    parts in a 62 MB chat: 44 s of the event loop, every other stream frozen). The items
    here are invalid: validated one by one, each would be an error of its own."""
    from server.field_limits import DEFAULT_FIELD_LIMITS
    from server.openai_models import TokenizeRequest

    parts = [{"type": "bogus"}] * 200_000
    cases = [
        (ChatCompletionRequest, {**BASE, "messages": [{"role": "user", "content": parts}]},
         "messages"),
        (ChatCompletionRequest, {**BASE, "messages": [{"role": "bogus"}] * 200_000}, "messages"),
        (TokenizeRequest, {"messages": [{"role": "user", "content": parts}]}, "messages"),
        (CompletionRequest, {"model": "m", "prompt": [[0]] * 200_000}, "prompt"),
        (CompletionRequest, {"model": "m", "prompt": "x",
                             "logit_bias": {str(i): "x" for i in range(200_000)}}, "logit_bias"),
        (ChatCompletionRequest, {**BASE, "tools": [{"type": "bogus"}] * 200_000}, "tools"),
        (ChatCompletionRequest, {**BASE, "stop_token_ids": ["x"] * 200_000}, "stop_token_ids"),
        (ChatCompletionRequest, {**BASE, "bad_words": [7] * 200_000}, "bad_words"),
        (ChatCompletionRequest, {**BASE, "stop": [7] * 200_000}, "stop"),
        (ChatCompletionRequest, {**BASE, "messages": [
            {"role": "assistant", "tool_calls": [{"bogus": 1}] * 200_000}]},
         "messages[0].tool_calls"),
        (ChatCompletionRequest, {**BASE, "structured_outputs": {"choice": [7] * 200_000}},
         "structured_outputs.choice"),
        (TokenizeRequest, {"messages": [{"role": "user", "content": "a"}],
                           "tools": [7] * 200_000}, "tools"),
        # token ids, then strings: the union tried over every item held the loop 20 s
        (CompletionRequest, {"model": "m", "prompt": [0] + ["a"] * 200_000}, "prompt"),
    ]  # fmt: skip
    for model, body, param in cases:
        with pytest.raises(ValidationError) as info:
            model.model_validate(body)
        assert len(info.value.errors()) == 1, param
        assert validation_error_to_invalid(info.value.errors()).param == param
    few = [{"type": "text", "text": "a"}] * DEFAULT_FIELD_LIMITS.max_content_parts
    ChatCompletionRequest.model_validate({**BASE, "messages": [{"role": "user", "content": few}]})


def test_a_responses_input_of_millions_of_parts_is_refused_before_they_are_read():
    from server.responses import ResponsesRequest

    items = [{"role": "user", "content": [{"type": "bogus"}] * 200_000}]
    with pytest.raises(ValidationError) as info:
        ResponsesRequest.model_validate({"model": "m", "input": items})
    assert validation_error_to_invalid(info.value.errors()).param == "input"


def test_an_explicit_null_is_the_fields_default():
    """OpenAI's types and vLLM take null for these; it was a 400 (fuzz59)."""
    chat = ChatCompletionRequest.model_validate(
        {**BASE, "n": None, "stream": None, "logprobs": None, "modalities": ["text"]})
    assert (chat.n, chat.stream, chat.logprobs) == (1, False, False)
    options = {"include_usage": None, "continuous_usage_stats": None}  # fuzz108: a 400
    streamed = ChatCompletionRequest.model_validate({**BASE, "stream": True, "stream_options": options})
    assert not streamed.include_usage and not streamed.continuous_usage
    completion = CompletionRequest.model_validate(
        {"model": "m", "prompt": "x", "n": None, "stream": None, "echo": None})
    assert (completion.n, completion.stream, completion.echo) == (1, False, False)


def test_a_completion_writes_16_tokens_unless_asked_otherwise():
    """OpenAI's documented default and vLLM's: it ran to the end of the context (1177
    tokens, 75 s on a CPU, fuzz59). An explicit null still asks for all the room left."""
    completion = CompletionRequest.model_validate({"model": "m", "prompt": "x"})
    assert build_sampling_params(completion, num_prompt_tokens=3, max_model_len=100).max_tokens == 16
    unbounded = CompletionRequest.model_validate({"model": "m", "prompt": "x", "max_tokens": None})
    assert build_sampling_params(unbounded, num_prompt_tokens=3, max_model_len=100).max_tokens == 97


@pytest.mark.parametrize(
    "model, fields, param",
    [
        (CompletionRequest, {"prompt": [True, 5]}, "prompt"),
        (CompletionRequest, {"prompt": [5, False]}, "prompt"),
        (CompletionRequest, {"prompt": [[5], [6, True]]}, "prompt"),
        (CompletionRequest, {"prompt": [5, "6"]}, "prompt"),
        (CompletionRequest, {"prompt": "hi", "stop_token_ids": [True]}, "stop_token_ids"),
        (CompletionRequest, {"prompt": "hi", "allowed_token_ids": [7, False]}, "allowed_token_ids"),
        (DetokenizeRequest, {"tokens": [3, True]}, "tokens"),
    ],
)
def test_a_token_id_is_an_integer_never_a_boolean_or_a_string(model, fields, param):
    """`prompt: [true]` was read as token 1 and `"6"` as token 6: pydantic's lax ints take
    booleans and numeric strings. OpenAI refuses both."""
    with pytest.raises(ValidationError) as info:
        model.model_validate({"model": "m", **fields})
    assert validation_error_to_invalid(info.value.errors()).param.startswith(param)


def test_a_tool_of_another_type_is_refused_by_its_type():
    """A `custom` tool was refused as "missing required field 'tools[0].function'", which
    sends its writer looking for a field their tool type does not have."""
    error = invalid({**BASE, "tools": [{"type": "custom", "custom": {"name": "grep"}}]})
    assert error.status == 400 and error.param == "tools[0]"
    assert error.message.endswith("only function tools are supported, not 'custom'")


@pytest.mark.parametrize(
    "model, fields, param",
    [
        (CompletionRequest, {"prompt": "hi", "logprobs": False}, "logprobs"),
        (CompletionRequest, {"prompt": "hi", "logprobs": True}, "logprobs"),
        (CompletionRequest, {"prompt": "hi", "logprobs": "3"}, "logprobs"),
        (CompletionRequest, {"prompt": "hi", "prompt_logprobs": False}, "prompt_logprobs"),
        (ChatCompletionRequest, {"logprobs": True, "top_logprobs": True}, "top_logprobs"),
        (ChatCompletionRequest, {"logprobs": 1}, "logprobs"),
        (ChatCompletionRequest, {"return_tokens_as_token_ids": "yes"}, "return_tokens_as_token_ids"),
    ],
)
def test_the_logprob_fields_take_their_own_types_only(model, fields, param):
    """`logprobs: false` on a completion was read as 0 (the chosen token's logprob) and
    turned logprobs on; `true` and `"3"` were 1 and 3 (fuzz77). OpenAI refuses them."""
    body = {"model": "m", **fields}
    if model is ChatCompletionRequest:
        body["messages"] = BASE["messages"]
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    assert validation_error_to_invalid(info.value.errors()).param == param
