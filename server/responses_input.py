"""A Responses request's `instructions` and `input` items as the chat messages they become
(the table in server/responses.py's docstring), checked as OpenAI's item types require,
with where each message came from so that errors can name the Responses field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidRequest

INPUT_ROLES = ("user", "assistant", "system", "developer")
ITEM_STATUSES = ("in_progress", "completed", "incomplete")
_TEXT_PARTS = ("input_text", "output_text")


@dataclass(frozen=True)
class MessageSource:
    """The input item (`input[3]`) a chat message came from: a function_call_output's
    fields have other names; an assistant message of calls has one item a call."""

    param: str
    renames: tuple[tuple[str, str], ...] = ()  # (chat field, Responses field) of the item
    calls: tuple[str, ...] = ()  # tool_calls[k] came from item calls[k]


_OUTPUT_FIELDS = ((".content", ".output"), (".tool_call_id", ".call_id"))


def one_of(values: tuple[str, ...]) -> str:
    """'a', 'b' or 'c'."""
    quoted = [repr(value) for value in values]
    return ", ".join(quoted[:-1]) + " or " + quoted[-1]


def input_messages(
    instructions: str | None, items: str | list[Any]
) -> tuple[list[dict[str, Any]], list[MessageSource]]:
    """The chat messages of a Responses request's `instructions` and `input`, and where
    each one came from."""
    messages: list[dict[str, Any]] = []
    sources: list[MessageSource] = []
    if instructions is not None:
        messages.append({"role": "system", "content": instructions})
        sources.append(MessageSource("instructions", ((".content", ""),)))
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
        sources.append(MessageSource("input", ((".content", ""),)))
        return messages, sources
    if not items:
        raise InvalidRequest("input must not be empty", param="input")
    for i, item in enumerate(items):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequest("an input item must be an object", param=param)
        kind = item.get("type", "message" if "role" in item else None)
        _check_item(item, kind, param)
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
            if messages and _is_reasoning_only(messages[-1]):  # fuzz112: the first was lost
                messages[-1]["reasoning_content"] += "\n" + _reasoning_text(item)
                continue
            messages.append({"role": "assistant", "content": None,
                             "reasoning_content": _reasoning_text(item)})  # fmt: skip
            sources.append(MessageSource(param))
            continue
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item["arguments"]},
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


def _check_item(item: dict[str, Any], kind: Any, param: str) -> None:
    """What OpenAI's input item types require of the fields read here (fuzz100: a call
    without arguments became `{}`, a tool-role message and a bogus status were taken)."""
    if item.get("status") not in (None, *ITEM_STATUSES):
        raise InvalidRequest(f"an item's status must be {one_of(ITEM_STATUSES)}",
                             param=param + ".status")  # fmt: skip
    if kind in ("function_call", "function_call_output") and not item.get("call_id"):
        raise InvalidRequest(f"a {kind} item needs its call_id", param=param + ".call_id")
    if kind == "function_call" and not isinstance(item.get("arguments"), str):
        raise InvalidRequest("a function_call item's arguments are a JSON string",
                             param=param + ".arguments")  # fmt: skip
    if kind == "function_call_output" and item.get("output") is None:
        raise InvalidRequest("a function_call_output item needs its output",
                             param=param + ".output")  # fmt: skip
    if kind == "reasoning":
        _check_reasoning(item, param)
    if kind == "message" and item.get("role") not in INPUT_ROLES:
        raise InvalidRequest(
            f"an input message's role is {one_of(INPUT_ROLES)}; a tool's result is a "
            "function_call_output item",
            param=param + ".role",
        )


def _is_reasoning_only(message: dict[str, Any]) -> bool:
    """Whether `message` is a reasoning item's turn that no answer or call joined (yet)."""
    return (
        "reasoning_content" in message
        and message["content"] is None
        and not message.get("tool_calls")
    )


# A reasoning item's part lists: (field, its parts' type, whether OpenAI requires it).
_REASONING_PARTS = (("summary", "summary_text", True), ("content", "reasoning_text", False))


def _check_reasoning(item: dict[str, Any], param: str) -> None:
    """OpenAI's reasoning item: a `summary` list of summary_text parts and maybe a `content`
    list of reasoning_text parts, each with its text (fuzz112: other shapes were taken,
    their thinking silently empty)."""
    for key, part_type, required in _REASONING_PARTS:
        parts = item.get(key)
        if parts is None and not required:
            continue
        if not isinstance(parts, list):
            raise InvalidRequest(f"a reasoning item's {key} is a list of {part_type} parts",
                                 param=f"{param}.{key}")  # fmt: skip
        for j, part in enumerate(parts):
            if (
                not isinstance(part, dict)
                or part.get("type") != part_type
                or not isinstance(part.get("text"), str)
            ):
                raise InvalidRequest(f"a {part_type} part needs type {part_type!r} and its text",
                                     param=f"{param}.{key}[{j}]")  # fmt: skip


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
    if kind == "refusal":
        return part  # an assistant turn's, as chat reads it (server/chat_messages.py)
    if kind in ("input_file", "input_audio"):
        raise InvalidRequest(f"{kind} parts are not supported", param=param + ".type")
    return part
