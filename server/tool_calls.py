"""Tool calls (OpenAI's `tools` and `tool_choice`) in the Hermes format that Qwen2.5's
chat template teaches (Tessera's built-in template renders it too): the tools are listed in
the system turn, and the model answers

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

or in Llama 3.1's (`llama3_json`, picked when the chat template is Llama's): the answer is
nothing but `{"name": ..., "parameters": {...}}` objects, maybe after <|python_tag|>,
separated by ";".

`tool_choice` picks what happens (the constrained modes are vLLM's):

    "none"      tools are neither shown to the model nor looked for: plain chat
    "auto"      tools go into the prompt; the answer's <tool_call> blocks become tool calls
                (text before the first block stays content; a block that does not parse
                leaves the whole answer as content; parallel_tool_calls false keeps the
                first call only)
    "required"  the output is constrained to a JSON array of one or more
                {"name": <a tool>, "parameters": <its schema>} objects
    {"type": "function", "function": {"name": f}}
                the output is constrained to f's parameters schema: the whole answer is
                f's arguments, which a stream sends as they come

In a stream, content goes out as it comes (up to a <tool_call>). A call goes out whole as
soon as its text closes: a Hermes </tool_call>, or the end of a Llama 3.1 or "required"
JSON object (a later call that does not parse then leaves only itself as content, since
what was sent stands); a named function's arguments go out as they come.

A tool's schema reaches the model only through the chat template: a template that does
not render `tools` (Qwen2-VL's own, for one) leaves "auto" to the model's luck; "required"
and a named function still hold, by the grammar.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from engine.protocol import StructuredOutput
from engine.unicode_text import is_valid_unicode

# The formats the answer's calls are parsed in (--tool-call-parser; "auto" picks by the
# chat template): Qwen2.5's Hermes blocks, or Llama 3.1's bare JSON objects.
TOOL_CALL_FORMATS = ("hermes", "llama3_json")
TOOL_CALL_PARSERS = ("auto", *TOOL_CALL_FORMATS)
PYTHON_TAG = "<|python_tag|>"  # Llama 3.1 may open its calls with it
CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
_CALL_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
ANY_OBJECT: dict[str, Any] = {"type": "object"}
# What json.loads raises on text that is no JSON it can read: RecursionError for arrays or
# objects nested past Python's stack ("[" * 2000), from a request or from the model.
_NOT_JSON = (ValueError, RecursionError)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_dict(self, index: int | None = None) -> dict[str, Any]:
        """OpenAI's shape; with `index` for a streamed delta."""
        call = {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}  # fmt: skip
        return call if index is None else {"index": index, **call}


@dataclass(frozen=True)
class ToolPlan:
    """What one chat request's tools ask for (none when `tool_choice` is "none")."""

    mode: Literal["auto", "required", "named"]
    tools: list[dict[str, Any]]  # OpenAI's tool objects, for the chat template
    named: str | None = None
    parallel: bool = True
    format: str = "hermes"  # how "auto" answers write their calls (TOOL_CALL_FORMATS)

    def constraint(self) -> StructuredOutput | None:
        """The grammar the output must follow, or None (auto)."""
        if self.mode == "auto":
            return None
        schemas = {tool["function"]["name"]: _parameters(tool) for tool in self.tools}
        if self.mode == "named":
            return StructuredOutput(json=json.dumps(schemas[self.named]))
        # Each tool's schema sits in the array schema's $defs, its local references ("#",
        # "#/$defs/Color": pydantic's) rewritten to point into it there.
        defs = {f"tool{i}": _rooted(schema, f"#/$defs/tool{i}") for i, schema in
                enumerate(schemas.values())}  # fmt: skip
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": {"$ref": f"#/$defs/{key}"}},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, key in zip(schemas, defs, strict=True)
        ]
        array: dict[str, Any] = {"$defs": defs, "type": "array", "minItems": 1,
                                 "items": {"anyOf": calls}}  # fmt: skip
        if not self.parallel:
            array["maxItems"] = 1
        return StructuredOutput(json=json.dumps(array))

    def extractor(self) -> ToolCallExtractor:
        return ToolCallExtractor(self)

    def split(self, text: str) -> tuple[str, list[ToolCall]]:
        """A whole answer's content and tool calls (what a non-streamed response shows):
        read as a stream reads it, so that the two agree. A stream sends each call as its
        text closes; an answer cut inside a later call (max_tokens) keeps those, the rest
        content. Read whole, such an answer had no calls and all of it as content."""
        extractor = self.extractor()
        content, _ = extractor.feed_stream(text)
        rest, _, calls = extractor.finish_stream()
        return content + rest, calls

    def finish_reason(self, engine_reason: str | None, calls: list[ToolCall]) -> str | None:
        """OpenAI's: "tool_calls" when the model chose to call (auto, required); a named
        function's call ends as "stop", like OpenAI's forced calls."""
        if calls and engine_reason == "stop" and self.mode != "named":
            return "tool_calls"
        return engine_reason


def call_format(parser: str, chat_template: str | None) -> str:
    """The format of `parser` ("auto": Llama 3.1's when the chat template mentions its
    python tag or ipython environment and not <tool_call>, else Hermes)."""
    if parser != "auto":
        return parser
    template = chat_template or ""
    is_llama = PYTHON_TAG in template or "Environment: ipython" in template
    return "llama3_json" if is_llama and CALL_START not in template else "hermes"


def tool_plan(
    tools: list[dict[str, Any]] | None, tool_choice: Any, parallel_tool_calls: bool | None
) -> ToolPlan | None:
    """The plan of a request's (already validated) `tools` and `tool_choice`."""
    if not tools or tool_choice == "none":
        return None
    parallel = parallel_tool_calls is not False
    if tool_choice is None or tool_choice == "auto":
        return ToolPlan("auto", tools, parallel=parallel)
    if tool_choice == "required":
        return ToolPlan("required", tools, parallel=parallel)
    return ToolPlan("named", tools, named=tool_choice["function"]["name"], parallel=parallel)


class ToolCallExtractor:
    """One choice's text, split into content to send now and the tool calls at its end.

    `feed` returns what may be streamed as content at once: in "auto", text up to a
    <tool_call> (a tail that could start one is held back until it cannot); in the
    constrained modes nothing, since the whole answer is calls. `finish` returns the rest
    of the content and the calls."""

    def __init__(self, plan: ToolPlan) -> None:
        self._plan = plan
        self._held = ""
        self._in_calls = plan.mode != "auto"
        # A named function's one call: its id goes out with the first streamed arguments.
        self._named_call = ToolCall(plan.named, "") if plan.mode == "named" else None
        self._has_streamed = False
        self._is_text = False  # llama3_json: the answer turned out to be plain text
        # A stream in "auto" (Hermes): the calls sent so far, and where their blocks end.
        self._sent_calls: list[ToolCall] = []
        self._sent_end = 0
        # JSON calls (required, llama3_json): how far `_held` was looked at for one that
        # closed. A call closes only with a '}': without one since, there is none to find
        # (decoding the open call again at every token cost O(N^2), fuzz70).
        self._looked_to = 0

    def feed(self, text: str) -> str:
        self._held += text
        if self._in_calls:
            return ""
        if self._plan.format == "llama3_json":
            return self._feed_llama3()
        start = self._held.find(CALL_START)
        if start >= 0:
            self._in_calls = True
            ready, self._held = self._held[:start], self._held[start:]
            return ready
        keep = partial_prefix_length(self._held, CALL_START)
        ready = self._held[: len(self._held) - keep]
        self._held = self._held[len(ready) :]
        return ready

    def _feed_llama3(self) -> str:
        """Llama 3.1 answers either with calls only (a JSON object first, maybe after its
        python tag) or with plain text: the first visible character decides."""
        if self._is_text:
            ready, self._held = self._held, ""
            return ready
        start = self._held.lstrip()
        if not start or PYTHON_TAG.startswith(start):
            return ""  # not decided yet
        if start.startswith(("{", PYTHON_TAG)):
            self._in_calls = True
            return ""
        self._is_text = True
        return self._feed_llama3()

    def finish(self) -> tuple[str, list[ToolCall]]:
        held, self._held = self._held, ""
        if not self._in_calls:
            return held, []
        if self._named_call is not None:
            # Its arguments as streamed, whitespace and all; none written (a stop string,
            # or max_tokens spent thinking) is no call, not one whose arguments are "".
            return "", [dataclasses.replace(self._named_call, arguments=held)] if held else []
        if self._plan.mode == "required":
            calls = _array_calls(held)
        else:
            calls = (
                _llama3_calls(held) if self._plan.format == "llama3_json" else _hermes_calls(held)
            )
            if not self._plan.parallel:
                calls = calls[:1]  # OpenAI's contract: at most one call
        return ("", calls) if calls else (held, [])

    def feed_stream(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """`feed` for a stream: content to send now, and tool-call deltas to send now. A
        named function's arguments stream as they come (its whole answer is them); other
        calls go out whole as soon as their text closes (`_closed_calls`), the rest from
        `finish_stream`."""
        if self._named_call is None or not text:
            content = self.feed(text)
            return content, self._closed_calls()
        self.feed(text)
        if self._has_streamed:
            return "", [{"index": 0, "function": {"arguments": text}}]
        self._has_streamed = True
        first = self._named_call.as_dict(0)
        first["function"]["arguments"] = text
        return "", [first]

    def finish_stream(self) -> tuple[str, list[dict[str, Any]], list[ToolCall]]:
        """`finish` for a stream: the rest of the content, the deltas of the calls not
        streamed yet, and all the calls."""
        sent, after_sent = self._sent_calls, self._held[self._sent_end :]
        content, calls = self.finish()
        if self._has_streamed:
            return content, [], calls
        if sent:
            if not calls:  # a later block did not parse: the sent calls stand, it is text
                return after_sent, [], sent
            calls = sent + calls[len(sent) :]  # the same ids as sent
        new = [call.as_dict(i) for i, call in enumerate(calls) if i >= len(sent)]
        return content, new, calls

    def _closed_calls(self) -> list[dict[str, Any]]:
        """Deltas of the calls whose text closed since the last look (not a named
        function's, which streams its arguments)."""
        if not self._in_calls or self._named_call is not None:
            return []
        if self._plan.mode == "required" or self._plan.format == "llama3_json":
            if "}" not in self._held[self._looked_to :]:
                return []
            self._looked_to = len(self._held)
        deltas = []
        while self._plan.parallel or not self._sent_calls:
            found = self._next_closed_call()
            if found is None:
                break  # not closed yet, or not a call after all: finish() decides
            call, self._sent_end = found
            deltas.append(call.as_dict(len(self._sent_calls)))
            self._sent_calls.append(call)
        return deltas

    def _next_closed_call(self) -> tuple[ToolCall, int] | None:
        """The call whose text closes first after the calls sent, and where it ends."""
        text, start = self._held, self._sent_end
        if self._plan.mode == "required":  # [{"name": ..., "parameters": ...}, ...]
            if not text.lstrip().startswith("["):  # a grammar that did not hold: not calls
                return None
            return _next_object_call(text, start, " \t\r\n[,", as_value=True)
        if self._plan.format == "llama3_json":  # [<|python_tag|>]{...}; {...}
            if start == 0:
                start = len(text) - len(text.lstrip())
                if text.startswith(PYTHON_TAG, start):
                    start += len(PYTHON_TAG)
            return _next_object_call(text, start, " \t\r\n;")
        end = text.find(CALL_END, start)
        if end < 0:
            return None
        end += len(CALL_END)
        calls = _hermes_calls(text[start:end])
        return (calls[0], end) if len(calls) == 1 else None


def check_tools(tools: list[dict[str, Any]] | None, tool_choice: Any) -> None:
    """Raises ValueError where `tool_choice` asks for a call that `tools` cannot give, or
    chooses among no tools at all ("auto" too, as OpenAI and vLLM refuse it; "none" stays
    allowed, as vLLM allows it)."""
    if tool_choice in (None, "none"):
        return
    if not tools:
        raise ValueError(f"tool_choice {_choice_name(tool_choice)} needs tools")
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        if name not in {tool["function"]["name"] for tool in tools}:
            raise ValueError(f"tool_choice names {name!r}, which is not among the tools")


def _choice_name(tool_choice: Any) -> str:
    return repr(tool_choice) if isinstance(tool_choice, str) else "naming a function"


# Schema keywords whose values are data, not schemas: a "$ref" inside them is no reference.
_DATA_KEYWORDS = ("const", "enum", "default", "examples")
# Keywords whose values map names to schemas (a property may be called "const").
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _rooted(schema: Any, root: str) -> Any:
    """`schema` with each local reference ("#" or "#/...", a JSON pointer from its own
    root) made to point from `root`, where it will sit in a larger schema. A subschema with
    an "$id" is a resource of its own, whose references resolve against it: kept as it is;
    so are anchors ("#name"), which name a place wherever it sits."""
    if isinstance(schema, list):
        return [_rooted(item, root) for item in schema]
    if not isinstance(schema, dict) or "$id" in schema:
        return schema
    rooted: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            rooted[key] = root + value[1:]
        elif key in _DATA_KEYWORDS:
            rooted[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            rooted[key] = {name: _rooted(item, root) for name, item in value.items()}
        else:
            rooted[key] = _rooted(value, root)
    return rooted


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or ANY_OBJECT


def _hermes_calls(text: str) -> list[ToolCall]:
    """Every <tool_call> block's {"name", "arguments"}; [] if any block does not parse
    (a truncated last block included)."""
    calls = []
    for block in _CALL_BLOCK.findall(text):
        try:
            call = json.loads(block)
        except _NOT_JSON:
            return []
        made = _tool_call(call, _arguments(call)) if isinstance(call, dict) else None
        if made is None:
            return []
        calls.append(made)
    return calls


def _llama3_calls(text: str) -> list[ToolCall]:
    """Llama 3.1's {"name": ..., "parameters": {...}} objects (after an optional python
    tag, separated by ";"); [] if anything else is there."""
    text = text.strip().removeprefix(PYTHON_TAG)
    calls, position = [], 0
    while text[position:].strip(" \t\r\n;"):
        found = _next_object_call(text, position, " \t\r\n;")
        if found is None:
            return []
        call, position = found
        calls.append(call)
    return calls


_DECODER = json.JSONDecoder()


def _next_object_call(
    text: str, position: int, separators: str, *, as_value: bool = False
) -> tuple[ToolCall, int] | None:
    """The call written as a whole JSON object {"name", "parameters" (or "arguments")}
    after `separators` from `position` on, and where it ends; None when there is none (yet):
    the text is cut short or is not such an object. `as_value`: the "required" grammar's
    {"name", "parameters"}, whose parameters are a value, never JSON text in a string."""
    while position < len(text) and text[position] in separators:
        position += 1
    try:
        call, end = _DECODER.raw_decode(text, position)
    except _NOT_JSON:
        return None
    if not isinstance(call, dict):
        return None
    if as_value:
        made = _tool_call(call, call["parameters"], as_value=True) if "parameters" in call else None
    else:
        made = _tool_call(call, _arguments(call))
    return None if made is None else (made, end)


def _arguments(call: dict[str, Any]) -> Any:
    """A written call's arguments: under "arguments" (Hermes) or "parameters" (Llama 3),
    whichever the model wrote; a model trained on one may write the other, and a call
    that kept only the key it knew lost its arguments ("{}")."""
    return call.get("arguments", call.get("parameters", {}))


def _array_calls(text: str) -> list[ToolCall]:
    """The "required" grammar's [{"name", "parameters"}, ...]; [] if cut short or not that
    shape. The grammar starts once the token ids spell </think>, and the reasoning ends
    at </think> in the text: a model that spelled it with other tokens answered
    unconstrained, and `5` or `[{"name": "f"}]` here was a 500 (fuzz70)."""
    try:
        items = json.loads(text)
    except _NOT_JSON:
        return []
    if not isinstance(items, list) or not all(
        isinstance(item, dict) and "parameters" in item for item in items
    ):
        return []
    calls = [_tool_call(item, item["parameters"], as_value=True) for item in items]
    return [] if any(call is None for call in calls) else calls  # type: ignore[return-value]


def _tool_call(call: dict[str, Any], arguments: Any, *, as_value: bool = False) -> ToolCall | None:
    """The call, or None where its name is no text a response can carry: not a string, or
    one holding a lone surrogate (the model may write any \\u escape)."""
    name = call.get("name")
    if not isinstance(name, str) or not is_valid_unicode(name):
        return None
    return ToolCall(name, _json_text(arguments, as_value=as_value))


def _json_text(arguments: Any, *, as_value: bool = False) -> str:
    """The arguments as JSON text, non-ASCII as is: a string is JSON text already (Hermes'
    "arguments"), unless `as_value` (the "required" grammar's parameters: a string there
    is the value, and went out as bare text; fuzz70). A lone surrogate that the model wrote
    as an escape cannot go out as UTF-8, so it goes back to its six-character escape,
    which inside a JSON string is the same value."""
    is_text = isinstance(arguments, str) and not as_value
    text = arguments if is_text else json.dumps(arguments, ensure_ascii=False)
    if is_valid_unicode(text):
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def partial_prefix_length(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker`."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0
