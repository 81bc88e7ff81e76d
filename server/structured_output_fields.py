"""The request fields that constrain the answer: OpenAI's `response_format`, vLLM's
`structured_outputs` and its older `guided_*` names (server/openai_models.py's
SamplingFields carries them), and the engine's `StructuredOutput` they make.

Keys of vLLM's `structured_outputs` that Tessera does not implement are refused rather
than ignored: an ignored constraint would let the answer go free without a word.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.errors import InvalidRequest
from engine.protocol import StructuredOutput
from server.chat_messages import RequestModel
from server.field_limits import bounded, check_lengths

ANY_JSON_OBJECT = '{"type": "object"}'  # response_format json_object
# vLLM's older request fields -> the `structured_outputs` key each one is
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}  # fmt: skip


def short_enough_schema(schema: Any) -> Any:
    """A `mode="before"` validator: a JSON schema (a mapping, or its JSON text) within
    --max-structured-output-schema-chars, as JSON (engine/structured_output.py says why)."""
    text = json.dumps(schema) if isinstance(schema, dict) else schema
    check_lengths(text, "max_structured_output_schema_chars", "a JSON schema")
    return schema


class JsonSchemaFormat(RequestModel):
    name: str = Field(default="response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # the grammar is always enforced strictly

    _short_enough_schema = field_validator("schema_", mode="before")(short_enough_schema)


class ResponseFormat(RequestModel):
    """OpenAI's `response_format`: plain text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a 'json_schema' object with a 'schema'")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: exactly one of a JSON Schema (or `json_object`), a
    regular expression, a list of choices or a grammar (Lark or GBNF: fuzz116). Other vLLM
    keys (structural tags, whitespace patterns) are a 400 rather than silently ignored."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = Field(default=None, min_length=1)
    grammar: str | None = None

    _short_enough_regex = field_validator("regex", mode="before")(
        bounded(lengths=("max_structured_output_regex_chars", "a regex"))
    )
    _short_enough_grammar = field_validator("grammar", mode="before")(
        bounded(lengths=("max_structured_output_grammar_chars", "a grammar"))
    )
    _short_enough_schema = field_validator("json_", mode="before")(short_enough_schema)
    _few_enough_choices = field_validator("choice", mode="before")(
        bounded(("max_structured_output_choices", "choices"), ("max_stop_string_chars", "a choice"))
    )

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [
            self.json_ is not None,
            bool(self.json_object),
            self.regex is not None,
            self.choice is not None,
            self.grammar is not None,
        ]
        if sum(given) != 1:
            raise ValueError("give exactly one of json, json_object, regex, choice and grammar")
        return self


def with_guided_fields_mapped(data: dict[str, Any]) -> dict[str, Any]:
    """A request body with vLLM's older names of `structured_outputs` (`guided_json`,
    `guided_regex`, `guided_choice`, `guided_grammar`), which clients still send, mapped
    onto it: ignoring
    one as an unknown field would drop the constraint without a word."""
    if data.get("guided_whitespace_pattern") is not None:  # as structured_outputs' own
        raise InvalidRequest(
            "guided_whitespace_pattern is not supported: JSON is laid out as json.dumps writes it",
            param="guided_whitespace_pattern",
        )
    given = [name for name in GUIDED_FIELDS if data.get(name) is not None]
    if not given:
        return data
    if len(given) > 1 or data.get("structured_outputs") is not None:
        raise InvalidRequest(
            f"give one of {', '.join(GUIDED_FIELDS)} and structured_outputs", param=given[-1]
        )
    name = given[0]
    response_format = data.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") not in (None, "text"):
        # named as sent (fuzz119: the error named structured_outputs, which it did not send)
        raise InvalidRequest(f"give either response_format or {name}, not both", param=name)
    return {**data, "structured_outputs": {GUIDED_FIELDS[name]: data[name]}}


def structured_output_of(
    structured: StructuredOutputs | None, response_format: ResponseFormat | None
) -> tuple[StructuredOutput, str] | None:
    """The engine's constraint and the field it came from, or None for free text (at most
    one of the two fields is given: SamplingFields checks it)."""
    if structured is not None:
        if structured.json_object:
            return StructuredOutput(json=ANY_JSON_OBJECT), "structured_outputs"
        if structured.json_ is not None:
            schema = structured.json_
            text = schema if isinstance(schema, str) else json.dumps(schema)
            return StructuredOutput(json=text), "structured_outputs.json"
        if structured.regex is not None:
            return StructuredOutput(regex=structured.regex), "structured_outputs.regex"
        if structured.grammar is not None:
            return StructuredOutput(grammar=structured.grammar), "structured_outputs.grammar"
        return StructuredOutput(choice=tuple(structured.choice or ())), "structured_outputs"
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object" or response_format.json_schema is None:
        # JSON mode: any object, whatever `json_schema` rides along (vLLM ignores it)
        return StructuredOutput(json=ANY_JSON_OBJECT), "response_format"
    schema = json.dumps(response_format.json_schema.schema_)
    return StructuredOutput(json=schema), "response_format.json_schema.schema"
