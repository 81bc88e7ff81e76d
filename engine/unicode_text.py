"""Lone UTF-16 surrogates in text: valid Unicode never holds one, UTF-8 cannot encode one,
and a tokenizer refuses it (a TypeError). JSON may escape one (`"\\ud800"`) and Python may
build one (`"\\ud800"` in source); either way it must be refused as the request's (or the
offline prompt's) own error before the tokenizer sees it. Used by the server's body check
(server/unicode_check.py) and the offline `LLM` (engine/llm.py)."""

from __future__ import annotations

from typing import Any


def is_valid_unicode(text: str) -> bool:
    """False where `text` holds a lone surrogate, which UTF-8 cannot encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def lone_surrogate_path(value: Any, path: str = "") -> str | None:
    """The path (`messages[0].content`) of the first string in a decoded JSON value, key or
    value, that holds a lone surrogate; None when there is none. Only dicts, lists and
    strings are looked into (an offline prompt's images and bytes are skipped)."""
    if isinstance(value, str):
        return None if is_valid_unicode(value) else path
    if isinstance(value, dict):
        for key, item in value.items():
            child = f"{path}.{key}" if path else str(key)
            if isinstance(key, str) and not is_valid_unicode(key):
                return path or "(key)"
            found = lone_surrogate_path(item, child)
            if found is not None:
                return found
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            found = lone_surrogate_path(item, f"{path}[{index}]")
            if found is not None:
                return found
    return None
