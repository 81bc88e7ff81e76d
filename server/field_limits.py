"""How much a request's fields may hold: server settings (`--max-messages`,
`--max-stop-strings`, ...), read by the request models' validators while a body is
validated. Each violation is a 400 naming the field and the setting.

pydantic builds a model's schema once, at import, so a limit that is a setting cannot be a
`Field(max_length=...)`. The validators ask `field_limits()` instead: the limits of the app
whose route is validating the body (`BoundedJsonRoute` applies `app.state.field_limits`
around its routes, server/json_body.py), or the defaults outside one (the offline `LLM`,
tests). Counts of long lists are checked before their items are validated (`mode="before"`):
pydantic checks a list's length only after validating every item, and a 62 MB body of 2.4 M
empty text parts held the event loop for 44 s that way.

Constants where they are used: the limits OpenAI's API itself defines (a function name's 64
characters, a bias in [-100, 100]), and those of small fields no real request comes near (a
cache salt's 256 characters, 64 chat_template_kwargs, a video's 4096 frame_seconds).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FieldLimits:
    """The defaults are the settings' (server/settings.py takes them from here): wide enough
    for real clients, small enough that no single request ties up the server."""

    max_messages: int = 2048
    max_content_parts: int = 8192  # content parts of all messages together
    max_tools: int = 128  # tools, and tool calls in one message
    max_stop_strings: int = 16
    max_stop_string_chars: int = 512  # each stop string, bad word and structured-output choice
    max_stop_token_ids: int = 256
    max_bad_words: int = 128
    max_logit_bias_tokens: int = 300  # as OpenAI's API allows
    max_prompts_per_request: int = 1024  # /v1/completions batches
    max_request_chat_template_chars: int = 64 * 1024
    max_structured_output_choices: int = 256
    max_structured_output_regex_chars: int = 4096
    # llguidance builds a grammar recursively (engine/structured_output.py): these bound
    # the stack a chain of $refs or rules can take, and GBNF's conversion time.
    max_structured_output_schema_chars: int = 512 * 1024
    max_structured_output_grammar_chars: int = 16 * 1024

    @classmethod
    def of(cls, settings: Any) -> FieldLimits:
        """The limits a ServerSettings holds (its fields of the same names)."""
        return cls(
            **{field.name: getattr(settings, field.name) for field in dataclasses.fields(cls)}
        )


DEFAULT_FIELD_LIMITS = FieldLimits()
_CURRENT: ContextVar[FieldLimits] = ContextVar("field_limits", default=DEFAULT_FIELD_LIMITS)


def field_limits() -> FieldLimits:
    """The limits of the request being validated (the defaults outside a server's route)."""
    return _CURRENT.get()


@contextmanager
def applying(limits: FieldLimits) -> Iterator[None]:
    """Validate with `limits` inside this block (and in the tasks it starts)."""
    token = _CURRENT.set(limits)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def _flag(setting: str) -> str:
    return "--" + setting.replace("_", "-")


def check_count(count: int, setting: str, what: str) -> None:
    """ValueError unless `count` of `what` (say "stop strings") is within the limit
    `setting` (a FieldLimits field) names."""
    limit = getattr(field_limits(), setting)
    if count > limit:
        raise ValueError(
            f"at most {limit} {what} are allowed (the server's {_flag(setting)}), got {count}"
        )


def check_lengths(items: Any, setting: str, what: str) -> None:
    """ValueError if a string among `items` (one string or a list) is longer than the limit
    `setting` names; `what` is one item's name (say "a stop string")."""
    limit = getattr(field_limits(), setting)
    for item in [items] if isinstance(items, str) else items if isinstance(items, list) else ():
        if isinstance(item, str) and len(item) > limit:
            raise ValueError(
                f"{what} may have at most {limit} characters (the server's {_flag(setting)}), "
                f"got {len(item)}"
            )


def bounded(
    count: tuple[str, str] | None = None, lengths: tuple[str, str] | None = None
) -> Callable[[Any], Any]:
    """A field's `mode="before"` validator: a list's (or mapping's) length within `count` =
    (setting, what: "stop strings"), and each of its strings (or the string itself) within
    `lengths` = (setting, one item's name: "a stop string"). Use:
    `_few_stops = field_validator("stop", mode="before")(bounded(...))`."""

    def check(value: Any) -> Any:
        if count is not None and isinstance(value, list | dict):
            check_count(len(value), *count)
        if lengths is not None:
            check_lengths(value, *lengths)
        return value

    return check
