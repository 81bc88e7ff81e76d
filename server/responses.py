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
server/response_events.py shapes the answer.
"""

from __future__ import annotations

import dataclasses
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
from server.openai_models import ChatCompletionRequest
from server.sampling_params import GrammarRefused

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
_TEXT_PARTS = ("input_text", "output_text")
# Chat field names -> the Responses fields they came from, for error messages.
_RENAMED = {
    "max_tokens": "max_output_tokens",
    "tool_choice.function.name": "tool_choice.name",
    "tool_choice.function": "tool_choice",
    "response_format.json_schema.schema": "text.format.schema",
    "response_format.json_schema": "text.format",
    "response_format": "text.format",
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
    text: dict[str, Any] | None = None
    tools: list[Any] | None = None
    _few_enough_tools = field_validator("tools", mode="before")(few_enough_tools)
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0)  # <= --max-logprobs
    include: list[str] | None = None
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


@dataclass(frozen=True)
class MessageSource:
    """The input item (`input[3]`) a chat message came from: a function_call_output's
    fields have other names; an assistant message of calls has one item a call."""

    param: str
    renames: tuple[tuple[str, str], ...] = ()  # (chat field, Responses field) of the item
    calls: tuple[str, ...] = ()  # tool_calls[k] came from item calls[k]


# A chat tool call's fields, as a function_call item names them.
_CALL_FIELDS = ((".function.name", ".name"), (".function.arguments", ".arguments"),
                (".id", ".call_id"), (".function", ""))  # fmt: skip
_OUTPUT_FIELDS = ((".content", ".output"), (".tool_call_id", ".call_id"))


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
    messages, sources = _messages(body)
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
    if body.wants_logprobs:
        chat["logprobs"] = True
        chat["top_logprobs"] = body.top_logprobs or 0


def _messages(body: ResponsesRequest) -> tuple[list[dict[str, Any]], list[MessageSource]]:
    messages: list[dict[str, Any]] = []
    sources: list[MessageSource] = []
    if body.instructions is not None:
        messages.append({"role": "system", "content": body.instructions})
        sources.append(MessageSource("instructions", ((".content", ""),)))
    if isinstance(body.input, str):
        messages.append({"role": "user", "content": body.input})
        sources.append(MessageSource("input", ((".content", ""),)))
        return messages, sources
    if not body.input:
        raise InvalidRequest("input must not be empty", param="input")
    for i, item in enumerate(body.input):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequest("an input item must be an object", param=param)
        kind = item.get("type", "message" if "role" in item else None)
        if kind in ("function_call", "function_call_output") and not item.get("call_id"):
            raise InvalidRequest(f"a {kind} item needs its call_id", param=param + ".call_id")
        if kind == "message":
            message = _message(item, param)
            renames = _image_renames(item.get("content"), ".content")
            if messages and _is_reasoning_only(messages[-1]) and message["role"] == "assistant":
                # the answer its reasoning item came before: one assistant turn
                messages[-1]["content"] = message["content"]
                sources[-1] = MessageSource(param, renames)
                continue
            messages.append(message)
            sources.append(MessageSource(param, renames))
            continue
        elif kind == "reasoning":
            # Fed back from an earlier response (OpenAI's loop: input += response.output):
            # the thinking of the assistant turn that follows, as chat's reasoning_content.
            messages.append({"role": "assistant", "content": None,
                             "reasoning_content": _reasoning_text(item)})  # fmt: skip
            sources.append(MessageSource(param))
            continue
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")},
            }
            previous = messages[-1] if messages else None
            if previous is not None and previous["role"] == "assistant":
                # One assistant turn: its text and its calls, or consecutive calls.
                previous["tool_calls"] = [*(previous.get("tool_calls") or ()), call]
                sources[-1] = dataclasses.replace(sources[-1], calls=(*sources[-1].calls, param))
                continue
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            sources.append(MessageSource(param, calls=(param,)))
            continue
        elif kind == "function_call_output":
            output = item.get("output")
            content = _content(output, param + ".output") if isinstance(output, list) else output
            messages.append(
                {"role": "tool", "tool_call_id": item.get("call_id"), "content": content}
            )
            renames = _image_renames(output, ".output") + _OUTPUT_FIELDS
            sources.append(MessageSource(param, renames))
            continue
        else:
            raise InvalidRequest(
                f"input items of type {kind!r} are not supported (message, reasoning, "
                "function_call and function_call_output are)",
                param=param + ".type",
            )
    # A reasoning item that no answer or call followed (a turn cut in its thinking) is
    # no turn of its own.
    kept = [i for i, message in enumerate(messages) if not _is_reasoning_only(message)]
    return [messages[i] for i in kept], [sources[i] for i in kept]


def _is_reasoning_only(message: dict[str, Any]) -> bool:
    """Whether `message` is a reasoning item's turn that no answer or call joined (yet)."""
    return (
        "reasoning_content" in message
        and message["content"] is None
        and not message.get("tool_calls")
    )


def _reasoning_text(item: dict[str, Any]) -> str:
    """A reasoning item's text: its reasoning_text parts, else its summary's."""
    for key in ("content", "summary"):
        parts = item.get(key)
        if isinstance(parts, list):
            texts = [part.get("text") for part in parts if isinstance(part, dict)]
            if any(isinstance(text, str) for text in texts):
                return "\n".join(text for text in texts if isinstance(text, str))
    return ""


def _image_renames(parts: Any, field: str) -> tuple[tuple[str, str], ...]:
    """An input_image part's fields as chat names them (`image_url.url`, `image_url.detail`)
    and as its Responses item does (`image_url`, `detail`), `field` holding the parts."""
    if not isinstance(parts, list):
        return ()
    renames: list[tuple[str, str]] = []
    for j, part in enumerate(parts):
        if isinstance(part, dict) and part.get("type") == "input_image":
            chat, item = f".content[{j}].image_url", f"{field}[{j}]"
            renames += [(chat + ".url", item + ".image_url"), (chat + ".detail", item + ".detail"),
                        (chat, item + ".image_url")]  # fmt: skip
    return tuple(renames)


def _message(item: dict[str, Any], param: str) -> dict[str, Any]:
    message = {"role": item.get("role"), "content": item.get("content")}
    if isinstance(message["content"], list):
        message["content"] = _content(message["content"], param + ".content")
    return message


def _content(parts: list[Any], param: str) -> list[Any]:
    return [_part(part, f"{param}[{j}]") for j, part in enumerate(parts)]


def _part(part: Any, param: str) -> Any:
    if not isinstance(part, dict):
        return part  # the chat's validation says what is wrong with it
    kind = part.get("type")
    if kind in _TEXT_PARTS:
        return {"type": "text", "text": part.get("text")}
    if kind == "input_image":
        url = part.get("image_url")
        if url is not None and not isinstance(url, str):  # chat's {"url": ...} form
            raise InvalidRequest(
                "an input_image's image_url is a string (an http(s)://, data: or file:// URL)",
                param=param + ".image_url",
            )
        if not url:
            if part.get("file_id") is not None:
                raise InvalidRequest(
                    "file_id images are not supported: send image_url (http(s) or data: URL)",
                    param=param + ".file_id",
                )
            if part.get("uuid") is None:
                raise InvalidRequest("an input_image needs an image_url", param=param)
        image: dict[str, Any] = {"type": "image_url"}
        if url:
            image["image_url"] = {"url": url, "detail": part.get("detail")}
        if part.get("uuid") is not None:
            image["uuid"] = part["uuid"]
        return image
    if kind in ("input_file", "input_audio", "refusal"):
        raise InvalidRequest(f"{kind} parts are not supported", param=param + ".type")
    return part


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
