"""Request bodies as the API routes parse them: bounded before parsing, and every parse
failure the JSON error.

FastAPI parses a route's JSON body with `await request.json()` on the event loop, in one
C call that holds the GIL (a worker thread would not let the loop run either). A body of
tens of megabytes made of many small objects and arrays (5 M `[0]`s in 25 MB: 3 s) held
every other request's stream that long. `BoundedJsonRoute` (FastAPI's documented custom
route class) hands its routes a request whose `json()` first counts the body's `{` and
`[` (C speed) and refuses more than `--max-request-json-containers` with a 413: any text
with that many braces is longer than a context holds, so no answerable request is
refused. The parser's other failures (a 10^5-digit number, nesting past the recursion
limit) become the JSON error every malformed body gets; they were a bare "There was an
error parsing the body". So do `NaN`, `Infinity` and numbers past a float's range (1e400),
which Python's parser takes and JSON does not have: in a free-form field that an answer
echoes (/v1/responses' `text`) they made the answer fail to encode, a 500 (fuzz85).

The route also checks the API key (`app.state.api_key`, server/auth.py) before it reads
the body: as a FastAPI dependency it ran after the parse, so a client without the key had
the server parse a body of up to --max-request-body-bytes and got its 400 or 413 instead
of the 401 (fuzz84). It then applies the app's request field limits
(`app.state.field_limits`, server/field_limits.py) while it validates the body and runs the
handler.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import HTTPException, Request, Response
from fastapi.routing import APIRoute
from starlette.requests import ClientDisconnect

from server.auth import check_api_key
from server.field_limits import DEFAULT_FIELD_LIMITS, applying

DEFAULT_MAX_CONTAINERS = 500_000


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"the number {text[:20]} is past a float's range")
    return value


def parse_json(body: bytes, max_containers: int = DEFAULT_MAX_CONTAINERS) -> Any:
    """`json.loads`, after counting the body's objects and arrays (HTTPException 413 past
    `max_containers`); raises JSONDecodeError for every way the body is not JSON, and for
    numbers no JSON encoder writes back (NaN, infinities, 1e400)."""
    num_containers = body.count(b"{") + body.count(b"[")  # braces in strings count too
    if num_containers > max_containers:
        raise HTTPException(
            status_code=413,
            detail=f"the request body holds {num_containers} JSON objects and arrays, more "
            f"than the {max_containers} a request may have",
        )
    try:
        return json.loads(body, parse_constant=_refuse_constant, parse_float=_finite_float)
    except json.JSONDecodeError:
        raise
    except (ValueError, RecursionError) as exc:  # int digits limit, deep nesting, bad UTF-8
        reason = str(exc) if type(exc) is ValueError else f"{type(exc).__name__}: {exc}"
        raise json.JSONDecodeError(reason[:200], "", 0) from None


class BoundedJsonRequest(Request):
    async def body(self) -> bytes:
        try:
            return await super().body()
        except ClientDisconnect:  # FastAPI makes any failure to read the body a 400
            raise HTTPException(status_code=499, detail="the client went away") from None

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            limit = getattr(self.app.state, "max_json_containers", DEFAULT_MAX_CONTAINERS)
            self._json = parse_json(await self.body(), limit)
        return self._json


class BoundedJsonRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def with_bounded_json(request: Request) -> Response:
            check_api_key(request, getattr(request.app.state, "api_key", None))
            limits = getattr(request.app.state, "field_limits", DEFAULT_FIELD_LIMITS)
            with applying(limits):
                scope = _read_as_json(request.scope)
                return await handler(BoundedJsonRequest(scope, request.receive))

        return with_bounded_json


def _read_as_json(scope: dict) -> dict:
    """The scope with its Content-Type read as JSON's, whatever it said: FastAPI reads only
    a JSON body as JSON. `curl -d` sends form-urlencoded, and such a body got "Input should
    be a valid dictionary or object" (fuzz75); every route here takes JSON."""
    headers = scope.get("headers", [])
    kinds = [value for name, value in headers if name == b"content-type"]
    if kinds and all(b"json" in kind.lower() for kind in kinds):
        return scope
    others = [(name, value) for name, value in headers if name != b"content-type"]
    return {**scope, "headers": [*others, (b"content-type", b"application/json")]}
