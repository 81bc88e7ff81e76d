"""Structured outputs over HTTP: OpenAI's `response_format` (json_object, json_schema) and
vLLM's `structured_outputs` (json, regex, choice, grammar) on a real server. The tiny model's
weights are random, so whatever it says in these shapes comes from the grammar; the
tokens themselves are checked against transformers in tests/parity."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from tests.e2e.conftest import MODEL_NAME
from tests.e2e.test_errors_api import assert_error

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "sunny": {"type": "boolean"},
        "rank": {"enum": [1, 2, 3]},
    },
    "required": ["city", "sunny", "rank"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}
MESSAGES = [{"role": "user", "content": "What is the weather like?"}]


def create(client, **kwargs):
    return client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, **kwargs)


def test_json_schema_stream_and_not(client):
    response = create(client, max_tokens=64, temperature=0, response_format=RESPONSE_FORMAT)
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    chunks = list(create(client, max_tokens=64, temperature=0, stream=True,
                         response_format=RESPONSE_FORMAT))  # fmt: skip
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == choice.message.content


def test_json_object_with_sampling_and_n(client):
    response = create(client, max_tokens=96, temperature=1.0, seed=4, n=3,
                      response_format={"type": "json_object"})  # fmt: skip
    for choice in response.choices:
        if choice.finish_reason == "stop":  # a random object may outrun max_tokens
            assert isinstance(json.loads(choice.message.content), dict)
        else:
            assert choice.message.content.startswith("{")


def test_json_mode_is_any_object_whatever_schema_rides_along(client):
    """`json_object` with a `json_schema` key was held to that schema: an integer schema
    answered "0", not an object (vLLM ignores the schema in JSON mode)."""
    response = create(client, max_tokens=48, temperature=0, response_format={
        "type": "json_object", "json_schema": {"name": "n", "schema": {"type": "integer"}}})  # fmt: skip
    assert response.choices[0].message.content.startswith("{")


def test_vllm_regex_and_choice(client):
    regex = r"(red|blue) [0-9]{3}"
    response = create(client, max_tokens=32, temperature=1.0, seed=1,
                      extra_body={"structured_outputs": {"regex": regex}})  # fmt: skip
    assert re.fullmatch(regex, response.choices[0].message.content)
    choices = ["positive", "negative", "neutral"]
    response = create(client, max_tokens=32, temperature=0,
                      extra_body={"structured_outputs": {"choice": choices}})  # fmt: skip
    assert response.choices[0].message.content in choices
    completion = client.completions.create(
        model=MODEL_NAME, prompt="The answer is", max_tokens=32, temperature=0,
        extra_body={"structured_outputs": {"choice": choices}},
    )  # fmt: skip
    assert completion.choices[0].text in choices


def test_vllm_grammar_in_lark_or_gbnf(client):
    """vLLM's `structured_outputs.grammar` (fuzz116: a 400 here), in Lark or in llama.cpp's
    GBNF, as llguidance reads them; on /v1/completions too."""
    lark = 'start: "The answer is " ANSWER "."\nANSWER: /[0-9]{2}/'
    response = create(client, max_tokens=32, temperature=1.0, seed=2,
                      extra_body={"structured_outputs": {"grammar": lark}})  # fmt: skip
    assert response.choices[0].finish_reason == "stop"
    assert re.fullmatch(r"The answer is [0-9]{2}\.", response.choices[0].message.content)
    gbnf = 'root ::= word (" " word)?\nword ::= "red" | "blue"'
    completion = client.completions.create(
        model=MODEL_NAME, prompt="Colours:", max_tokens=32, temperature=0,
        extra_body={"structured_outputs": {"grammar": gbnf}},
    )  # fmt: skip
    assert re.fullmatch(r"(red|blue)( (red|blue))?", completion.choices[0].text)


@pytest.mark.parametrize(
    ("guided", "structured"),
    [
        ({"guided_json": SCHEMA}, {"json": SCHEMA}),
        ({"guided_regex": r"(red|blue) [0-9]{3}"}, {"regex": r"(red|blue) [0-9]{3}"}),
        ({"guided_choice": ["yes", "no"]}, {"choice": ["yes", "no"]}),
        ({"guided_grammar": 'root ::= "yes" | "no"'}, {"grammar": 'root ::= "yes" | "no"'}),
    ],
)
def test_vllms_older_guided_fields_constrain_as_structured_outputs(client, guided, structured):
    """guided_json / guided_regex / guided_choice (vLLM before 0.10) are still sent by
    clients: the same constraint, not an ignored field."""
    answers = [
        create(client, max_tokens=48, temperature=0.7, seed=3, extra_body=extra)
        .choices[0]
        .message.content
        for extra in (guided, {"structured_outputs": structured})
    ]
    assert answers[0] == answers[1]
    free = create(client, max_tokens=48, temperature=0.7, seed=3).choices[0].message.content
    assert free != answers[0]


def test_constrained_and_free_requests_share_steps(client):
    def constrained(seed: int) -> str:
        return create(client, max_tokens=64, temperature=0.8, seed=seed,
                      response_format=RESPONSE_FORMAT).choices[0].message.content  # fmt: skip

    def free(seed: int) -> str:
        return create(client, max_tokens=16, temperature=0.8, seed=seed,
                      extra_body={"ignore_eos": True}).choices[0].message.content  # fmt: skip

    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda i: (constrained if i % 2 else free)(i), range(6)))
    for text in answers[1::2]:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert not all(text.startswith("{") for text in answers[::2])


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": 7}},
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": "start: x"}}, "structured_outputs.grammar"),
        ({"guided_grammar": "start: x"}, "structured_outputs.grammar"),  # x is no rule
        ({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs.grammar"),
        ({"guided_json": {}, "guided_whitespace_pattern": " *"}, "guided_whitespace_pattern"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"guided_regex": "a", "structured_outputs": {"regex": "a"}}, "guided_regex"),
        ({"guided_regex": "a(b"}, "structured_outputs.regex"),
        ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "guided_choice"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs",
        ),
    ],
)
def test_bad_constraints_are_400(http, fields, param):
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 4, **fields}
    assert_error(http.post("/v1/chat/completions", json=body), 400, param=param)


def test_a_bad_schema_does_not_disturb_the_server(client):
    with pytest.raises(openai.BadRequestError):
        create(client, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}})  # fmt: skip
    response = create(client, max_tokens=4, temperature=0)
    assert response.choices[0].message.content


def test_a_grammar_past_its_limits_is_a_400_naming_the_field_and_others_go_on(client, http):
    """`a{1000000}` passes the server's check but not the engine's lexer fuel."""
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 4,
            "structured_outputs": {"regex": "a{1000000}"}}  # fmt: skip
    error = assert_error(http.post("/v1/chat/completions", json=body), 400,
                         param="structured_outputs.regex")  # fmt: skip
    assert "grammar failed" in error["message"]
    assert error["code"] == "invalid_value"  # as a grammar refused up front (it was null)
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert "grammar failed" in events[-2] and events[-1] == "data: [DONE]"
    assert create(client, max_tokens=4, temperature=0).choices[0].message.content


def test_long_chains_of_rules_or_refs_leave_the_server_up(http):
    """fuzz118: a Lark chain of 3000 rules (67 KB) or a schema of 3000 chained $refs
    (228 KB) overflowed llguidance's stack and killed the server. The grammar is now past
    --max-structured-output-grammar-chars (a 400); the schema builds on a larger stack."""
    rules = [f'r{i}: "x" r{i + 1} | "y"' for i in range(3000)]
    grammar = "\n".join(["start: r0", *rules, 'r3000: "z"'])
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}}
            for i in range(3000)}  # fmt: skip
    defs["d3000"] = {"type": "string"}
    chain = {"type": "json_schema", "json_schema": {"name": "c", "schema": {
        "$ref": "#/$defs/d0", "$defs": defs}}}  # fmt: skip
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 4}
    refused = http.post("/v1/chat/completions",
                        json={**body, "structured_outputs": {"grammar": grammar}})  # fmt: skip
    assert_error(refused, 400, param="structured_outputs.grammar")
    assert "--max-structured-output-grammar-chars" in refused.json()["error"]["message"]
    assert http.post("/v1/chat/completions", json={**body, "response_format": chain}).is_success
    huge = {**chain["json_schema"]["schema"], "description": "x" * 600_000}
    too_long = {**body, "response_format": {"type": "json_schema",
                                            "json_schema": {"name": "h", "schema": huge}}}  # fmt: skip
    assert_error(http.post("/v1/chat/completions", json=too_long), 400,
                 param="response_format.json_schema.schema")  # fmt: skip
    tool = {"type": "function", "function": {"name": "f", "parameters": huge}}
    forced = {**body, "tools": [tool], "tool_choice": "required"}  # the tools' grammar
    assert_error(http.post("/v1/chat/completions", json=forced), 400, param="tools")
    assert http.get("/health").status_code == 200
