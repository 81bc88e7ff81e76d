"""Refuses request bodies whose JSON strings hold a lone UTF-16 surrogate.

JSON may escape any UTF-16 code unit (`"\\ud800"`), and Python's decoder turns a lone one
(or its raw bytes, ED A0 80) into a `str` that cannot be encoded as UTF-8: the tokenizer refuses it (a TypeError), and
a response that echoes it fails to encode. Valid Unicode never holds one, so such a body
gets 400 naming the field, before the route reads it. A surrogate pair (`"\\ud83d\\ude00"`)
decodes to its one character and passes.

The check costs one regex scan of the raw body for a surrogate escape (C speed, ~2 ms for
10 MB); only a body that has one is decoded a second time to find the field.
"""

from __future__ import annotations

import json
import re

from fastapi import Request

from engine.errors import InvalidRequest
from engine.unicode_text import lone_surrogate_path

# "\u" then D800-DFFF, either case: every escape that could make a surrogate. An escaped
# backslash before it ("\\ud800", the text \ud800) matches too; the decode then finds none.
# Or a surrogate's own bytes (ED A0-BF: CESU-8), which no valid UTF-8 holds and which
# Python's JSON decoder takes (surrogatepass).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


def check_body(body: bytes) -> None:
    """Raises InvalidRequest if the JSON body holds a lone surrogate (see the module)."""
    if not _SURROGATE_ESCAPE.search(body):
        return
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return  # not JSON: the route's own parsing says so
    path = lone_surrogate_path(value)
    if path is not None:
        raise InvalidRequest(
            f"{path!r} holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), "
            "which is not valid Unicode",
            param=path,
        )


async def check_request_text(request: Request) -> None:
    """A router dependency (after the API key's): `check_body` on a POST's body, before
    FastAPI validates it into the route's model. Starlette caches the bytes it reads."""
    if request.method == "POST":
        check_body(await request.body())
