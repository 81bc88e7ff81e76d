"""Request field limits are settings (`--max-messages`, `--max-stop-strings`, ...): each one
bounds its field at its default, a server set lower refuses what the default takes, the
refusal is a 400 naming the field and the flag, and long lists are counted before their
items are validated. They were constants until 2026-11-27."""

from __future__ import annotations

import dataclasses

import pytest
from pydantic import ValidationError

from server.errors import validation_error_to_invalid
from server.field_limits import DEFAULT_FIELD_LIMITS, FieldLimits, applying, field_limits
from server.openai_models import ChatCompletionRequest, CompletionRequest
from server.settings import SettingsError, load_settings
from tests.unit.fake_engine import client_for

USER = {"role": "user", "content": "hi"}
CHAT = {"model": "m", "messages": [USER]}


def _tools(count: int) -> list[dict]:
    return [{"type": "function", "function": {"name": f"f{index}"}} for index in range(count)]


def _chat(**fields):
    return ChatCompletionRequest, {**CHAT, **fields}


# Per setting: the model and a body of `count` items (or characters), and the param named.
CASES = {
    "max_messages": lambda count: (*_chat(messages=[USER] * count), "messages"),
    "max_content_parts": lambda count: (
        *_chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}] * count}]),
        "messages",
    ),
    "max_tools": lambda count: (*_chat(tools=_tools(count)), "tools"),
    "max_stop_strings": lambda count: (*_chat(stop=["x"] * count), "stop"),
    "max_stop_string_chars": lambda count: (*_chat(stop="x" * count), "stop"),
    "max_stop_token_ids": lambda count: (*_chat(stop_token_ids=[1] * count), "stop_token_ids"),
    "max_bad_words": lambda count: (*_chat(bad_words=["x"] * count), "bad_words"),
    "max_logit_bias_tokens": lambda count: (
        *_chat(logit_bias={str(token): 1 for token in range(count)}),
        "logit_bias",
    ),
    "max_prompts_per_request": lambda count: (
        CompletionRequest,
        {"model": "m", "prompt": ["a"] * count},
        "prompt",
    ),
    "max_request_chat_template_chars": lambda count: (
        *_chat(chat_template="x" * count),
        "chat_template",
    ),
    "max_structured_output_choices": lambda count: (
        *_chat(structured_outputs={"choice": ["a"] * count}),
        "structured_outputs.choice",
    ),
    "max_structured_output_regex_chars": lambda count: (
        *_chat(structured_outputs={"regex": "a" * count}),
        "structured_outputs.regex",
    ),
    "max_structured_output_grammar_chars": lambda count: (
        *_chat(structured_outputs={"grammar": "a" * count}),
        "structured_outputs.grammar",
    ),
    # a schema as its JSON text (a mapping counts as json.dumps writes it: tests/e2e)
    "max_structured_output_schema_chars": lambda count: (
        *_chat(structured_outputs={"json": "a" * count}),
        "structured_outputs.json",
    ),
}


def _refusal(model, body) -> tuple[str | None, str]:
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    error = validation_error_to_invalid(info.value.errors())
    return error.param, error.message


def test_every_limit_has_a_case():
    assert set(CASES) == {field.name for field in dataclasses.fields(FieldLimits)}


@pytest.mark.parametrize("setting", sorted(CASES))
def test_each_limit_bounds_its_field_at_its_default_and_at_a_setting(setting):
    default = getattr(DEFAULT_FIELD_LIMITS, setting)
    model, body, param = CASES[setting](default)
    model.model_validate(body)  # the limit itself is allowed
    model, body, _ = CASES[setting](default + 1)
    refused_param, message = _refusal(model, body)
    flag = "--" + setting.replace("_", "-")
    assert refused_param == param and f"at most {default} " in message and flag in message
    lowered = dataclasses.replace(DEFAULT_FIELD_LIMITS, **{setting: 2})
    model, body, _ = CASES[setting](3)
    model.model_validate(body)  # within the default
    with applying(lowered):
        assert _refusal(model, body)[0] == param
        model.model_validate(CASES[setting](2)[1])
    assert field_limits() is DEFAULT_FIELD_LIMITS  # the block put the defaults back


def test_bad_words_and_choices_share_the_stop_strings_length():
    lowered = dataclasses.replace(DEFAULT_FIELD_LIMITS, max_stop_string_chars=3)
    with applying(lowered):
        assert _refusal(*_chat(bad_words=["abcd"]))[0] == "bad_words"
        assert _refusal(*_chat(structured_outputs={"choice": ["abcd"]}))[0] == (
            "structured_outputs.choice"
        )
        assert _refusal(*_chat(stop=["ab", "abcd"]))[0] == "stop"
        ChatCompletionRequest.model_validate({**CHAT, "bad_words": ["abc"], "stop": "abc"})


def test_the_limits_are_positive_settings():
    settings = load_settings(["--max-stop-strings", "4", "--model", "m"], environ={})
    limits = FieldLimits.of(settings)
    assert limits.max_stop_strings == 4
    assert limits.max_messages == DEFAULT_FIELD_LIMITS.max_messages
    with pytest.raises(SettingsError, match="max_tools"):
        load_settings(["--max-tools", "0", "--model", "m"], environ={})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from engine.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def test_a_server_applies_its_own_limits_on_every_route(model_dir):
    """The app's limits reach the models FastAPI validates its bodies with, on each route
    that takes the field; a server left at the defaults takes the same bodies."""
    chat = {"model": "tiny", "max_tokens": 1, "messages": [USER] * 3}
    bodies = [
        ("/v1/chat/completions", {**chat, "messages": [USER], "stop": ["a", "b", "c"]}, "stop"),
        ("/v1/chat/completions", chat, "messages"),
        ("/v1/completions", {"model": "tiny", "max_tokens": 1, "prompt": ["a"] * 3}, "prompt"),
        ("/v1/responses", {"model": "tiny", "max_output_tokens": 1, "input": [USER] * 3},
         "input"),
        ("/tokenize", {"model": "tiny", "messages": [USER] * 3}, "messages"),
    ]  # fmt: skip
    client, _ = client_for(model_dir, max_stop_strings=2, max_messages=2,
                        max_prompts_per_request=2)  # fmt: skip
    with client:
        for route, body, param in bodies:
            response = client.post(route, json=body)
            assert response.status_code == 400, (route, response.text)
            error = response.json()["error"]
            assert error["param"] == param and "(the server's --max-" in error["message"], error
    default_client, _ = client_for(model_dir)
    with default_client:
        for route, body, _ in bodies:
            response = default_client.post(route, json=body)
            assert response.status_code == 200, (route, response.text)


def test_responses_count_their_instructions_and_name_the_flag_whole(model_dir):
    """Instructions are one more message: the chat's own check refused them, and its error,
    renamed word by word for Responses, read "at most 2 input are allowed (the server's
    --max-input)" (fuzz49, fuzz51)."""
    client, _ = client_for(model_dir, max_messages=2)
    body = {"model": "tiny", "max_output_tokens": 1, "instructions": "be brief",
            "input": [USER, USER]}  # fmt: skip
    with client:
        error = client.post("/v1/responses", json=body).json()["error"]
        assert error["param"] == "input", error
        assert "--max-messages" in error["message"] and "--max-input" not in error["message"]
        fits = client.post("/v1/responses", json={**body, "input": [USER]})
        assert fits.status_code == 200, fits.text


def test_responses_count_their_tools_before_translating_them():
    """Each tool was translated before the chat's count of them (450 k tools: 2.4 s)."""
    from server.responses import ResponsesRequest

    tools = [{"type": "bogus"}] * 200_000
    with pytest.raises(ValidationError) as info:
        ResponsesRequest.model_validate({"model": "m", "input": "hi", "tools": tools})
    assert len(info.value.errors()) == 1
    assert validation_error_to_invalid(info.value.errors()).param == "tools"
