"""OpenAI-shaped chat messages as chat templates take them, and the rules every message
keeps on both the HTTP API (server/chat_messages.py checks them on the request body, so
the error comes before any media is fetched) and the offline `LLM.chat`, as OpenAI's API
and vLLM's server keep them:

* a `system`, `developer` or `user` message has content (null was an empty turn, fuzz99);
  an assistant turn of tool calls and a tool's result may have none;
* an assistant turn's `refusal` parts (a history saved from OpenAI) are its text;
* the deprecated `function` role is refused, with what to send instead.
"""

from __future__ import annotations

from typing import Any

from engine.errors import InvalidRequest

# "image_pil": vLLM's offline LLM.chat part (a PIL image; no JSON can carry one)
IMAGE_PART_TYPES = {"image", "image_pil", "image_url", "input_image", "image_features"}
VIDEO_PART_TYPES = {"video", "video_url", "video_features"}
ROLES_NEEDING_CONTENT = ("system", "user", "developer")
FUNCTION_ROLE_REFUSED = (
    "the 'function' role (deprecated by OpenAI) is not supported; send a function's result "
    "as a 'tool' message"
)


def content_rule_broken(role: Any, content: Any) -> str | None:
    """What is wrong with a message of `role` holding `content` (None: nothing)."""
    if role == "function":
        return FUNCTION_ROLE_REFUSED
    if content is None and role in ROLES_NEEDING_CONTENT:
        return f"a {role} message needs its content"
    return None


def check_role_and_content(role: Any, content: Any, param: str) -> None:
    broken = content_rule_broken(role, content)
    if broken is not None:
        field = param if role == "function" else param + ".content"
        raise InvalidRequest(broken, param=field)


def refusals_as_text(role: Any, content: list[Any]) -> list[Any]:
    """An assistant's content parts with each `refusal` part as the text it holds (a part
    without its text is left for the caller's part check to refuse)."""
    if role != "assistant":
        return content
    return [
        {"type": "text", "text": part["refusal"]}
        if isinstance(part, dict)
        and part.get("type") == "refusal"
        and isinstance(part.get("refusal"), str)
        else part
        for part in content
    ]


def normalize_messages(
    messages: list[dict], *, join_text: bool = False, developer_as_system: bool = False
) -> list[dict]:
    """Copy OpenAI-shaped messages into what chat templates expect: media parts become
    {"type": "image"} / {"type": "video"}, text parts {"type": "text", "text": ...}. With
    `join_text` (a template that takes content as a string), a content of text parts only
    is their texts joined by newlines, as vLLM joins them. With `developer_as_system` (a
    template that never names the role), a "developer" message is a "system" one: OpenAI's
    name for it since o1, which such a template would drop (Qwen3's) or render as a role
    its model never saw (Qwen2-VL's)."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list", param="messages")
    normalized = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidRequest(
                "each message must be an object with a string role", param=f"messages[{index}]"
            )
        copy = dict(message)
        if developer_as_system and copy["role"] == "developer":
            copy["role"] = "system"
        content = message.get("content")
        check_role_and_content(message["role"], content, f"messages[{index}]")
        if isinstance(content, list):
            content = refusals_as_text(message["role"], content)
            copy["content"] = [
                _normalize_part(part, f"messages[{index}].content[{j}]")
                for j, part in enumerate(content)
            ]
            if join_text and all(part["type"] == "text" for part in copy["content"]):
                copy["content"] = "\n".join(part["text"] for part in copy["content"])
        elif content is not None and not isinstance(content, str):
            raise InvalidRequest(
                "content must be a string or a list of parts", param=f"messages[{index}].content"
            )
        normalized.append(copy)
    return normalized


def _normalize_part(part: Any, param: str) -> dict:
    if not isinstance(part, dict) or not isinstance(part.get("type"), str):
        raise InvalidRequest("each content part must be an object with a type", param=param)
    part_type = part["type"]
    if part_type == "text":
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidRequest("a text part needs a string 'text'", param=param)
        return {"type": "text", "text": text}
    if part_type in IMAGE_PART_TYPES:
        return {"type": "image"}
    if part_type in VIDEO_PART_TYPES:
        return {"type": "video"}
    raise InvalidRequest(f"unsupported content part type {part_type!r}", param=param)
