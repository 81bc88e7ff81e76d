"""ASGI middleware capping the request body, chunked uploads included.

A `Content-Length` over the limit is refused before the app runs; otherwise the bytes
actually received are counted, so a chunked (or lying) upload is cut off at the limit
with 413 `request_too_large` instead of being buffered whole. Pure ASGI: a streamed
response passes through with one extra call per chunk (Starlette's BaseHTTPMiddleware
would hand every chunk across a task and a memory stream).
"""

from __future__ import annotations

import json
from typing import Any

from server.errors import error_body

Scope = dict[str, Any]


class _BodyTooLarge(Exception):
    pass


class BodyLimitMiddleware:
    """Wraps an ASGI app; HTTP bodies over `max_bytes` get 413 in OpenAI error shape."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if _declared_length(scope) > self.max_bytes:
            await self._too_large(send)
            return
        received = 0
        is_over = False
        has_started = False

        async def limited_receive() -> dict:
            nonlocal received, is_over
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    is_over = True
                    raise _BodyTooLarge
            return message

        async def guarded_send(message: dict) -> None:
            nonlocal has_started
            if is_over:
                return  # whatever the app answers, the client gets our 413 below
            has_started = has_started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except _BodyTooLarge:
            pass
        except Exception:
            if not is_over:
                raise
        if is_over and not has_started:
            await self._too_large(send)

    async def _too_large(self, send: Any) -> None:
        body = json.dumps(
            error_body(
                f"the request body is over {self.max_bytes} bytes",
                type="invalid_request_error",
                code="request_too_large",
            )
        ).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _declared_length(scope: Scope) -> int:
    """The request's Content-Length, or 0 when it has none (or not a number)."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return int(value) if value.isdigit() else 0
    return 0
