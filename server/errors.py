"""The ONE place where errors become OpenAI error bodies.

Every error response is `{"error": {"message", "type", "param", "code"}}`. Typed errors
(`engine.errors.TesseraError`) carry their own status/type/code; pydantic validation
errors become 400 `invalid_value` naming the field path (`messages[0].content`), never 422;
unknown routes are 404 in the same shape; anything unexpected is a 500 whose message leaks
no internals.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.errors import (
    EngineDeadError,
    InvalidRequest,
    ServerOverloaded,
    TesseraError,
    error_from_info,
)
from engine.protocol import ErrorInfo
from server.admission import ServerDraining

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1  # seconds, on every 503 that says "try again"
# 503s of a server on its way out: the client's keep-alive connection must not stay with it
# (a pool would send its retries down the same connection, to the same dying process,
# instead of opening one that a load balancer gives to another replica).
LEAVING_CODES = (EngineDeadError.code, ServerDraining.code)

_MEDIA_PARAM = re.compile(r"media\[(\d+)\]")  # how the engine names a request's media item
# Loc components pydantic adds for union members; they are not part of the field path.
_TYPE_LOC_NAMES = {"str", "int", "float", "bool", "list", "dict", "none", "function-after"}


def error_body(
    message: str, *, type: str, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def tessera_error_body(exc: TesseraError) -> dict[str, Any]:
    return error_body(exc.message, type=exc.type, code=exc.code, param=exc.param)


def error_info_to_exception(info: ErrorInfo, media_params: Sequence[str] = ()) -> TesseraError:
    """An engine-side per-request failure, as the typed error the server raises. The
    engine names a media item `media[i]`; `media_params[i]` is the request field it came
    from, which the error names instead."""
    param = info.param
    if param is not None and (found := _MEDIA_PARAM.fullmatch(param)) is not None:
        index = int(found.group(1))
        param = media_params[index] if index < len(media_params) else param
    return error_from_info(info, param)


def loc_to_param(loc: Sequence[Any]) -> str | None:
    """('body', 'messages', 0, 'content') -> 'messages[0].content'."""
    parts = list(loc)
    if parts and parts[0] in ("body", "query", "path"):
        parts = parts[1:]
    param = ""
    tag_next = False  # the next name is a tagged union's tag, not a field
    for part in parts:
        if isinstance(part, int):
            param += f"[{part}]"
        elif isinstance(part, str):
            if tag_next:
                tag_next = False
                continue
            if "tagged-union[" in part:  # a union member named by pydantic: then its tag
                tag_next = True
                continue
            if part in _TYPE_LOC_NAMES or "[" in part or part.startswith(("function-", "json-")):
                continue
            if part[:1].isupper():  # a union's model member (NamedToolChoice): no field name
                continue
            if param.endswith(part) and param.rsplit(".", 1)[-1] == part:
                continue  # a tagged union repeats the discriminator value as a loc component
            param += f".{part}" if param else part
    return param or None


def validation_error_to_invalid(errors: Sequence[dict[str, Any]]) -> InvalidRequest:
    """The first pydantic error, as an InvalidRequest naming the field path."""
    if not errors:
        return InvalidRequest("invalid request body")
    # In a union (content: str | list[part]) the deepest error names the real culprit.
    first = max(errors, key=lambda e: len(loc_to_param(e.get("loc", ())) or ""))
    param = loc_to_param(first.get("loc", ()))
    if first.get("type") == "json_invalid":  # FastAPI puts the parser's reason in ctx
        reason = (first.get("ctx") or {}).get("error")
        message = "request body is not valid JSON" + (f": {reason}" if reason else "")
        return InvalidRequest(message[:300], code="invalid_json")
    message = first.get("msg", "invalid value")
    if first.get("type") == "value_error":  # our validators' own words, without pydantic's tag
        message = message.removeprefix("Value error, ")
    if param is None:  # the body itself: empty, or JSON that is not an object
        missing = first.get("type") == "missing"
        return InvalidRequest("the request needs a JSON object as its body" if missing
                              else f"invalid request body: {message}")  # fmt: skip
    if first.get("type") == "missing":
        return InvalidRequest(f"missing required field {param!r}", param=param)
    return InvalidRequest(f"invalid value for {param!r}: {message}", param=param)


def json_error(status: int, body: dict[str, Any]) -> JSONResponse:
    return JSONResponse(status_code=status, content=body)


def install_error_handlers(app: FastAPI) -> None:
    """Register the exception handlers that produce OpenAI-shaped errors."""

    @app.exception_handler(TesseraError)
    async def _tessera(_: Request, exc: TesseraError) -> JSONResponse:
        response = json_error(exc.status, tessera_error_body(exc))
        if isinstance(exc, ServerOverloaded):
            response.headers["Retry-After"] = str(RETRY_AFTER_S)
        if exc.code in LEAVING_CODES:
            response.headers["Connection"] = "close"
        return response

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        invalid = validation_error_to_invalid(exc.errors())
        return json_error(400, tessera_error_body(invalid))

    @app.exception_handler(ValidationError)
    async def _validation(_: Request, exc: ValidationError) -> JSONResponse:
        invalid = validation_error_to_invalid(exc.errors())
        return json_error(400, tessera_error_body(invalid))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            body = error_body("not found", type="invalid_request_error", code="not_found")
        elif exc.status_code == 405:
            body = error_body(
                "method not allowed", type="invalid_request_error", code="method_not_allowed"
            )
        else:
            kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
            code = "request_too_large" if exc.status_code == 413 else None
            body = error_body(str(exc.detail), type=kind, code=code)
        response = json_error(exc.status_code, body)
        response.headers.update(exc.headers or {})  # a 405's Allow, say
        return response

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error", exc_info=exc)
        body = error_body("internal server error", type="server_error", code="internal_error")
        return json_error(500, body)
