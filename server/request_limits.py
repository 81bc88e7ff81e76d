"""ASGI middleware capping the request: its header block and its body.

Headers: a request line + headers over `max_header_bytes` (counted as sent, `name:
value\r\n`) gets 431 `request_header_fields_too_large` before the app runs. h11's own
limit (`h11_max_incomplete_event_size`, set in server/cli.py to twice this) only applies
to a header block still incomplete after a read, so alone it let a 70 kB block through
a 64 KiB limit whenever the block arrived in one read; it stays as the backstop that
bounds what is buffered before this check can run.

Body: a `Content-Length` over the limit is refused before the app runs; otherwise the
bytes actually received are counted, so a chunked (or lying) upload is cut off at the
limit with 413 `request_too_large` instead of being buffered whole. A body whose next
bytes take longer than `read_timeout_s` to come gets 408 `request_timeout`: a client that
stalls mid-body held its connection (and its handler) forever, and every drain waited
for it to the deadline. (A header block that stalls is closed by server/http_protocol.py.)

Pure ASGI: a streamed response passes through with one extra call per chunk
(Starlette's BaseHTTPMiddleware would hand every chunk across a task and a memory
stream).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from server.errors import error_body

Scope = dict[str, Any]


class _BodyTooLarge(Exception):
    pass


class _BodyTooSlow(Exception):
    pass


class RequestLimitMiddleware:
    """Wraps an ASGI app; header blocks over `max_header_bytes` get 431, bodies over
    `max_body_bytes` 413 and bodies that stall for `read_timeout_s` 408, in OpenAI error
    shape."""

    def __init__(
        self, app: Any, *, max_header_bytes: int, max_body_bytes: int, read_timeout_s: float = 30.0
    ) -> None:
        self.app = app
        self.max_header_bytes = max_header_bytes
        self.max_body_bytes = max_body_bytes
        self.read_timeout_s = read_timeout_s

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if header_block_bytes(scope) > self.max_header_bytes:
            message = f"the request line and headers are over {self.max_header_bytes} bytes"
            await _refuse(send, 431, message, "request_header_fields_too_large")
            return
        if _declared_length(scope) > self.max_body_bytes:
            await self._too_large(send)
            return
        received = 0
        is_over = is_slow = body_done = False
        has_started = False

        async def limited_receive() -> dict:
            nonlocal received, is_over, is_slow, body_done
            if body_done:  # later reads wait for the client to leave: no deadline
                return await receive()
            try:
                async with asyncio.timeout(self.read_timeout_s):
                    message = await receive()
            except TimeoutError:
                is_slow = True
                raise _BodyTooSlow from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if received > self.max_body_bytes:
                    is_over = True
                    raise _BodyTooLarge
            return message

        async def guarded_send(message: dict) -> None:
            nonlocal has_started
            if is_over or is_slow:
                return  # whatever the app answers, the client gets our 413 / 408 below
            has_started = has_started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except (_BodyTooLarge, _BodyTooSlow):
            pass
        except Exception:
            if not (is_over or is_slow):
                raise
        if has_started:
            return
        if is_over:
            await self._too_large(send)
        elif is_slow:
            message = f"the request body stalled for over {self.read_timeout_s:g} s"
            await _refuse(send, 408, message, "request_timeout")

    async def _too_large(self, send: Any) -> None:
        message = f"the request body is over {self.max_body_bytes} bytes"
        await _refuse(send, 413, message, "request_too_large")


async def _refuse(send: Any, status: int, message: str, code: str) -> None:
    """Answers `status` with an OpenAI error and closes the connection."""
    body = json.dumps(error_body(message, type="invalid_request_error", code=code)).encode()
    headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
    headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def header_block_bytes(scope: Scope) -> int:
    """The request line and headers as sent (`GET /path?query HTTP/1.1\\r\\n`, then
    `name: value\\r\\n` each), from what the server parsed into the scope."""
    query = scope.get("query_string", b"")
    line = len(scope["method"]) + 1 + len(scope.get("raw_path") or scope["path"].encode())
    line += (1 + len(query) if query else 0) + len(" HTTP/1.1\r\n")
    return line + sum(len(name) + len(value) + 4 for name, value in scope.get("headers", ()))


def _declared_length(scope: Scope) -> int:
    """The request's Content-Length, or 0 when it has none (or not a number)."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return int(value) if value.isdigit() else 0
    return 0
