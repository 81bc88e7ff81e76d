"""An assistant turn's earlier tool calls, as a chat template expects them.

OpenAI's messages carry a call's `arguments` as a JSON string (what a client sends back
from an answer); chat templates write them with `tojson`, so they need the object. The
server's chat and the offline `LLM.chat` both render through here: offline, a replayed
call reached the template as a string and the prompt was 117 tokens where the server's was
113 (fuzz87), as vLLM's `LLM.chat` converts them too.
"""

from __future__ import annotations

import json
from typing import Any

from engine.unicode_text import lone_surrogate_path

_NOT_JSON = (ValueError, RecursionError)  # RecursionError: "[" * 5000


def arguments_as_objects(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with each assistant tool call's JSON-string arguments as objects, and an
    empty `tool_calls` list left out, as vLLM renders them (the messages themselves
    untouched). A call of another shape, which only the offline `LLM`
    can be given (the server's are typed), is left for the template to refuse as that
    prompt's error: converting it raised out of `LLM.chat` for the whole batch (fuzz88)."""
    result = []
    for message in messages:
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if calls == []:  # no calls, as null is (fuzz123: Llama 3.1's template indexed it)
            message = {key: value for key, value in message.items() if key != "tool_calls"}
        elif calls and isinstance(calls, list):
            message = {**message, "tool_calls": [
                _with_object_arguments(call) if _is_call(call) else call for call in calls
            ]}  # fmt: skip
        result.append(message)
    return result


def _is_call(call: Any) -> bool:
    return isinstance(call, dict) and isinstance(call.get("function") or {}, dict)


def _with_object_arguments(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function") or {}
    arguments = function.get("arguments")
    if arguments is None:  # null (or left out): no arguments
        arguments = {}
    elif isinstance(arguments, str):
        try:  # empty or null: no arguments, as vLLM reads them ("" wrote `"arguments": }`)
            parsed = json.loads(arguments) if arguments.strip() else {}
            parsed = {} if parsed is None else parsed
        except _NOT_JSON:
            parsed = arguments  # not JSON: the template writes the string as it came
        # A "\ud800" escape in the JSON text decodes to a lone surrogate, which no tokenizer
        # takes: the template then writes the JSON text as it came, escape and all.
        arguments = parsed if _is_valid_unicode(parsed) else arguments
    return {**call, "function": {**function, "arguments": arguments}}


def _is_valid_unicode(value: Any) -> bool:
    """Whether every string of a decoded JSON value, keys included, is valid Unicode (a
    value nested as deep as json.loads allows is too deep to walk, one level sooner: then
    no, and the text goes to the template as it came; fuzz88 got a 500)."""
    try:
        return lone_surrogate_path(value) is None
    except RecursionError:
        return False
