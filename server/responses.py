"""OpenAI's Responses API (`POST /v1/responses`), as a chat completion underneath.

`chat_request` translates a Responses request into the chat completion request that
/v1/chat/completions would take, so that the prompt, images and videos, tools, grammars and
sampling all go the chat's way:

    instructions                      a system message first
    input: "text"                     one user message
    input: [items]                    messages, in order:
      {"role", "content": str | [parts]}   (role "developer" as chat takes it)
        input_text / output_text      -> text
        input_image {image_url, detail, uuid}
                                      -> image_url (http(s) or data: URL)
        image_url, video_url, image_features, video_features, text
                                      as on /v1/chat/completions (Tessera's own parts)
      function_call {call_id, name, arguments}
                                      -> an assistant message's tool_calls (consecutive
                                         calls share one message)
      function_call_output {call_id, output}
                                      -> a "tool" message
    max_output_tokens                 max_tokens
    text.format                       response_format (text, json_object, json_schema)
    tools [{type: function, name, description, parameters, strict}]
                                      the chat's {"type": "function", "function": {...}}
    tool_choice {type: function, name}
                                      {"type": "function", "function": {"name"}}
    top_logprobs, or include "message.output_text.logprobs"
                                      logprobs
    seed, stop, top_k, min_p, penalties, min_tokens, ignore_eos, logit_bias,
    stop_token_ids, skip_special_tokens, mm_processor_kwargs, structured_outputs,
    priority, chat_template(_kwargs), cache_salt, bad_words, allowed_token_ids,
    truncate_prompt_tokens            passed through (vLLM takes them too)

Errors name the Responses field (`input[2].content[1]`, `max_output_tokens`), not the chat
field it became (`responses_param`). Nothing is stored: `previous_response_id`,
`conversation`, `prompt` and `background` are a 400 (send the conversation in `input`).
server/responses_input.py turns the input items into messages; server/response_events.py
shapes the answer.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from pydantic import ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from engine.errors import InvalidRequest, TesseraError
from server.chat_messages import RequestModel, few_enough_messages, few_enough_tools
from server.errors import validation_error_to_invalid
from server.field_limits import check_count
from server.openai_models import ChatCompletionRequest, null_is_the_default
from server.responses_input import MessageSource, input_messages, one_of
from server.sampling_params import GrammarRefused
from server.structured_output_fields import JsonSchemaFormat

# Chat fields a Responses request may carry as extras, as vLLM's Responses endpoint does.
PASSTHROUGH_FIELDS = (
    "seed",
    "stop",
    "include_stop_str_in_output",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "logit_bias",
    "stop_token_ids",
    "skip_special_tokens",
    "mm_processor_kwargs",
    "structured_outputs",
    "priority",
    "chat_template",
    "chat_template_kwargs",
    "cache_salt",
    "bad_words",
    "allowed_token_ids",
    "truncate_prompt_tokens",
)
LOGPROBS_INCLUDE = "message.output_text.logprobs"
VERBOSITIES = ("low", "medium", "high")
REASONING_SUMMARIES = ("auto", "concise", "detailed")
DEFAULT_SCHEMA_NAME = JsonSchemaFormat.model_fields["name"].default
# Chat field names -> the Responses fields they came from, for error messages.
_RENAMED = {
    "max_tokens": "max_output_tokens",
    "tool_choice.function.name": "tool_choice.name",
    "tool_choice.function": "tool_choice",
    "response_format.json_schema.schema": "text.format.schema",
    "response_format.json_schema": "text.format",
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
}


class ResponsesRequest(RequestModel):
    """The fields of a Responses request that Tessera reads (others are ignored, as on
    chat; the passthrough fields come in as extras)."""

    model_config = ConfigDict(extra="allow")

    model: str
    instructions: str | None = None  # before `input`: its check counts them (one message)
    input: str | list[Any]
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    _null_stream = field_validator("stream", mode="before")(null_is_the_default)
    text: dict[str, Any] | None = None
    tools: list[Any] | None = None
    _few_enough_tools = field_validator("tools", mode="before")(few_enough_tools)
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0)  # <= --max-logprobs
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None  # its `effort` as chat's `reasoning_effort`
    service_tier: str | None = None  # read for its type only
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool | None = None
    truncation: str | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    prompt: Any = None
    background: bool | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _few_enough_items(cls, items: Any, info: ValidationInfo) -> Any:
        """Input items become messages, and the instructions one more: as many, with as
        many content parts, are allowed (counted here, before the chat's own check, whose
        error was renamed word by word: "at most 2 input are allowed")."""
        if isinstance(items, list) and info.data.get("instructions"):
            check_count(len(items) + 1, "max_messages", "messages (input items and instructions)")
        return few_enough_messages(items)

    @property
    def wants_logprobs(self) -> bool:
        return self.top_logprobs is not None or LOGPROBS_INCLUDE in (self.include or ())

    @property
    def text_echo(self) -> dict[str, Any]:
        """`text` as the answer repeats it: a json_schema format left unnamed carries the
        name the chat gives it (the openai client's types require one; fuzz100)."""
        text = self.text or {"format": {"type": "text"}}
        text_format = text.get("format")
        if isinstance(text_format, dict) and text_format.get("type") == "json_schema":
            text = {**text, "format": {"name": DEFAULT_SCHEMA_NAME, **text_format}}
        return text


@dataclass(frozen=True)
class ChatTranslation:
    """A Responses request as a chat request, and where each chat message came from."""

    chat: ChatCompletionRequest
    message_sources: tuple[MessageSource, ...]  # where chat message i came from

    @contextmanager
    def responses_params(self) -> Iterator[None]:
        """Re-raises errors of the chat pipeline naming the Responses field."""
        try:
            yield
        except TesseraError as exc:
            raise self.renamed(exc) from exc.__cause__

    def renamed(self, exc: TesseraError) -> TesseraError:
        """`exc` naming the Responses field instead of the chat one."""
        return renamed(exc, self.message_sources)


# A chat tool call's fields, as a function_call item names them.
_CALL_FIELDS = ((".function.name", ".name"), (".function.arguments", ".arguments"),
                (".id", ".call_id"), (".function", ""))  # fmt: skip


def _renamed_path(path: str, renames: tuple[tuple[str, str], ...]) -> str:
    for chat_name, name in renames:
        if path == chat_name or path.startswith((chat_name + ".", chat_name + "[")):
            return name + path[len(chat_name) :]
    return path


def responses_param(
    chat_param: str | None, message_sources: tuple[MessageSource, ...]
) -> str | None:
    """`chat_param` (a chat request's field path) as the Responses field it came from."""
    if chat_param is None:
        return None
    if chat_param == "messages":  # the conversation as a whole
        return "input"
    found = re.match(r"messages\[(\d+)\](.*)", chat_param)
    if found:
        index, rest = int(found.group(1)), found.group(2)
        if index >= len(message_sources):
            return "input" + rest
        source = message_sources[index]
        call = re.match(r"\.tool_calls\[(\d+)\](.*)", rest)
        if call and int(call.group(1)) < len(source.calls):
            return source.calls[int(call.group(1))] + _renamed_path(call.group(2), _CALL_FIELDS)
        return source.param + _renamed_path(rest, source.renames)
    found = re.match(r"tools\[(\d+)\]\.function(.*)", chat_param)
    if found:
        return f"tools[{found.group(1)}]{found.group(2)}"
    for chat_name, name in _RENAMED.items():
        if chat_param == chat_name or chat_param.startswith(chat_name + "."):
            return name + chat_param[len(chat_name) :]
    return chat_param


def renamed(exc: TesseraError, message_sources: tuple[MessageSource, ...]) -> TesseraError:
    """`exc` naming the Responses fields instead of the chat ones, in `param` and message:
    the failing field, and any other renamed one the message mentions ("min_tokens must
    not exceed max_tokens")."""
    chat_param = exc.param
    param = responses_param(chat_param, message_sources)
    if isinstance(exc, GrammarRefused):  # llguidance's detail quotes the client's schema
        return GrammarRefused(param, exc.detail)
    message = exc.message
    if chat_param is not None and param != chat_param:
        message = _with_field_renamed(message, chat_param, param)
    for chat_name, name in _RENAMED.items():
        if "." not in chat_name:
            message = _with_field_renamed(message, chat_name, name)
    exc.param, exc.message, exc.args = param, message, (message,)
    return exc


def _with_field_renamed(message: str, chat_field: str, field: str) -> str:
    # the chat field, quoted ('messages[0]') or bare ("invalid response_format..."), but
    # not inside a flag ("--max-messages") or a longer name
    found = rf"(?<![\w.\[-]){re.escape(chat_field)}(?![\w\[])"
    return re.sub(found, field, message)


def chat_request(body: ResponsesRequest) -> ChatTranslation:
    """The chat completion request that does what `body` asks; InvalidRequest naming the
    Responses field where it asks for what Tessera does not do."""
    _refuse_stored_state(body)
    if body.text and body.text.get("verbosity") not in (None, *VERBOSITIES):
        raise InvalidRequest(
            f"text.verbosity must be {one_of(VERBOSITIES)}", param="text.verbosity"
        )
    for key in ("summary", "generate_summary"):  # echoed back, so they must be OpenAI's
        if (body.reasoning or {}).get(key) not in (None, *REASONING_SUMMARIES):
            raise InvalidRequest(
                f"reasoning.{key} must be {one_of(REASONING_SUMMARIES)}", param=f"reasoning.{key}"
            )
    messages, sources = input_messages(body.instructions, body.input)
    chat: dict[str, Any] = {"model": body.model, "messages": messages, "stream": body.stream}
    for name in PASSTHROUGH_FIELDS:
        if body.model_extra and name in body.model_extra:
            chat[name] = body.model_extra[name]
    _copy_sampling(body, chat)
    if body.text and body.text.get("format") is not None:
        chat["response_format"] = _response_format(body.text["format"])
    if body.tools:
        chat["tools"] = [_tool(tool, i) for i, tool in enumerate(body.tools)]
    if body.tool_choice is not None and (body.tools or body.tool_choice != "auto"):
        # "auto" is the Responses API's default, which a client may send with no tools
        chat["tool_choice"] = _tool_choice(body.tool_choice)
    try:
        validated = ChatCompletionRequest.model_validate(chat)
    except ValidationError as exc:
        raise renamed(validation_error_to_invalid(exc.errors()), tuple(sources)) from None
    return ChatTranslation(validated, tuple(sources))


def _refuse_stored_state(body: ResponsesRequest) -> None:
    for name in ("previous_response_id", "conversation", "prompt"):
        if getattr(body, name) is not None:
            raise InvalidRequest(
                f"{name} is not supported: Tessera stores no responses; send the whole "
                "conversation in 'input'",
                param=name,
            )
    if body.background:
        raise InvalidRequest("background responses are not supported", param="background")
    if body.truncation not in (None, "disabled"):
        raise InvalidRequest(
            "only truncation 'disabled' is supported: an input longer than the context is a 400",
            param="truncation",
        )


def _copy_sampling(body: ResponsesRequest, chat: dict[str, Any]) -> None:
    if body.max_output_tokens is not None:
        chat["max_tokens"] = body.max_output_tokens
    for name in ("temperature", "top_p", "parallel_tool_calls", "user"):
        value = getattr(body, name)
        if value is not None:
            chat[name] = value
    if body.reasoning and body.reasoning.get("effort") is not None:
        chat["reasoning_effort"] = body.reasoning["effort"]
    if body.wants_logprobs:
        chat["logprobs"] = True
        chat["top_logprobs"] = body.top_logprobs or 0


def _response_format(text_format: Any) -> Any:
    if not isinstance(text_format, dict) or text_format.get("type") != "json_schema":
        return text_format  # text, json_object, or wrong: the chat's validation says
    schema = {key: text_format[key] for key in ("name", "description", "schema", "strict")
              if key in text_format}  # fmt: skip
    return {"type": "json_schema", "json_schema": schema}


def _tool(tool: Any, index: int) -> Any:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise InvalidRequest(
            f"only function tools are supported, not {kind!r}", param=f"tools[{index}].type"
        )
    function = {key: tool[key] for key in ("name", "description", "parameters", "strict")
                if key in tool}  # fmt: skip
    return {"type": "function", "function": function}


def _tool_choice(tool_choice: Any) -> Any:
    if isinstance(tool_choice, dict):
        if tool_choice.get("type") != "function":
            raise InvalidRequest(
                "tool_choice must be 'none', 'auto', 'required' or a function",
                param="tool_choice",
            )
        return {"type": "function", "function": {"name": tool_choice.get("name")}}
    return tool_choice
