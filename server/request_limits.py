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
for it to the deadline. So does one that, once `read_timeout_s` has passed, has sent less
than `min_body_rate` bytes a second on average (a floor like ASP.NET Kestrel's
MinRequestBodyDataRate, whose 240 is the default here; its grace period is 5 s): a body
trickled a byte at a time, each within `read_timeout_s`, held its connection for as long
as the client liked, and a few thousand of them took every file descriptor (fuzz82). (A
header block that stalls is closed by server/http_protocol.py.)

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
    `max_body_bytes` 413 and bodies that stall for `read_timeout_s` or come slower than
    `min_body_rate` bytes a second (after `read_timeout_s`; 0: no floor) 408, in OpenAI
    error shape."""

    def __init__(
        self,
        app: Any,
        *,
        max_header_bytes: int,
        max_body_bytes: int,
        read_timeout_s: float = 30.0,
        min_body_rate: float = 0.0,
    ) -> None:
        self.app = app
        self.max_header_bytes = max_header_bytes
        self.max_body_bytes = max_body_bytes
        self.read_timeout_s = read_timeout_s
        self.min_body_rate = min_body_rate

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
        is_over = body_done = False
        slow_message: str | None = None  # set once the body is too slow
        has_started = False
        loop = asyncio.get_running_loop()
        started_at = loop.time()

        async def limited_receive() -> dict:
            nonlocal received, is_over, slow_message, body_done
            if body_done:  # later reads wait for the client to leave: no deadline
                return await receive()
            wait_s, below_rate = self._wait_for_more(received, loop.time() - started_at)
            try:
                if wait_s <= 0:
                    raise TimeoutError
                async with asyncio.timeout(wait_s):
                    message = await receive()
            except TimeoutError:
                slow_message = (
                    f"the request body came slower than {self.min_body_rate:g} bytes a second"
                    if below_rate
                    else f"the request body stalled for over {self.read_timeout_s:g} s"
                )
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
            if is_over or slow_message:
                return  # whatever the app answers, the client gets our 413 / 408 below
            has_started = has_started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except (_BodyTooLarge, _BodyTooSlow):
            pass
        except Exception:
            if not (is_over or slow_message):
                raise
        if has_started:
            return
        if is_over:
            await self._too_large(send)
        elif slow_message:
            await _refuse(send, 408, slow_message, "request_timeout")

    def _wait_for_more(self, received: int, elapsed_s: float) -> tuple[float, bool]:
        """How long the next piece of a body that has sent `received` bytes in `elapsed_s`
        may take, and whether that is the rate floor's limit (else `read_timeout_s`'s).
        By the floor, `received` bytes may take `read_timeout_s + received / min_body_rate`."""
        if not self.min_body_rate:
            return self.read_timeout_s, False
        left_s = self.read_timeout_s + received / self.min_body_rate - elapsed_s
        if left_s < self.read_timeout_s:
            return left_s, True
        return self.read_timeout_s, False

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
