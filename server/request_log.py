"""One log line per HTTP request, and the request id that ties it to the client.

`RequestLogMiddleware` (pure ASGI, outermost) takes the request id from the `x-request-id`
header when it is a sane one (visible ASCII, at most 128 characters) or makes one up,
returns it in the `x-request-id` response header, and once the response has been sent
(the whole stream, for SSE) logs on the `tessera.request` logger::

    request_id=4f1c.. method=POST route=/v1/chat/completions status=200 prompt_tokens=12
    completion_tokens=8 latency_s=0.412

A response whose end never went out (the client left mid-stream, or
`--write-timeout-s` reset a client that stopped reading) keeps the status it started
with, since that is what the client saw, and adds `aborted=True`.

With `--log-format json` the same fields are top-level keys of the JSON line
(engine.logging_utils.JsonFormatter merges `extra={"fields": ...}`). Only the route
TEMPLATE is logged, never the raw path or query, and no header but the request id is
read, so API keys and URLs with secrets in them never reach the log. Handlers add token
counts through `record_of(request)`.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

from starlette.datastructures import MutableHeaders
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

REQUEST_ID_HEADER = "x-request-id"
MAX_REQUEST_ID_CHARS = 128
_SCOPE_KEY = "tessera.request_log"
_ARRIVED_KEY = "tessera.arrived"  # time.monotonic() when the request's headers came in

logger = logging.getLogger("tessera.request")


@dataclass
class RequestLogRecord:
    """What the log line of one HTTP request says; filled in while it is served."""

    request_id: str
    method: str
    route: str = "unmatched"
    status: int = 500  # until a response starts
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    latency_s: float = 0.0
    aborted: bool | None = None  # True: the response started but its end was never sent

    def as_text(self) -> str:
        return " ".join(
            f"{key}={value}" for key, value in asdict(self).items() if value is not None
        )


def valid_request_id(value: str | None) -> str | None:
    """`value` if it is 1..128 visible ASCII characters (no spaces or controls), else None."""
    if not value or len(value) > MAX_REQUEST_ID_CHARS:
        return None
    if all("!" <= char <= "~" for char in value):
        return value
    return None


def record_of(request: Any) -> RequestLogRecord | None:
    """The log record of a Starlette request (None outside the middleware, e.g. in tests)."""
    return record_in(request.scope)


def record_in(scope: Scope) -> RequestLogRecord | None:
    """The log record of a request's ASGI scope."""
    return scope.get(_SCOPE_KEY)


def arrival_of(request: Any) -> float:
    """time.monotonic() when the request arrived (now, outside the middleware). Latency
    metrics start here, so they include the API process's own work: reading and parsing the
    body, fetching and preprocessing media, rendering and tokenizing the prompt."""
    return request.scope.get(_ARRIVED_KEY) or time.monotonic()


class RequestLogMiddleware:
    """Assigns the request id, echoes it in the response, logs one line per request."""

    def __init__(
        self,
        app: ASGIApp,
        on_finished: Callable[[RequestLogRecord], None] | None = None,
        known_routes: Callable[[], Iterable[BaseRoute]] = tuple,
    ) -> None:
        self.app = app
        self.on_finished = on_finished  # e.g. the http_requests_total counter
        self.known_routes = known_routes  # to name the route of a request refused before routing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        record = RequestLogRecord(request_id=_request_id(scope), method=scope["method"])
        scope[_SCOPE_KEY] = record
        scope[_ARRIVED_KEY] = start

        started = ended = False

        async def send_with_id(message: Message) -> None:
            nonlocal started, ended
            if message["type"] == "http.response.start":
                record.status = message["status"]
                MutableHeaders(scope=message).append(REQUEST_ID_HEADER, record.request_id)
                started = True
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                ended = True

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            if started and not ended:
                record.aborted = True
            record.route = _route_template(scope, self.known_routes)
            record.latency_s = round(time.monotonic() - start, 6)
            fields = {k: v for k, v in asdict(record).items() if v is not None}
            logger.info("%s", record.as_text(), extra={"fields": fields})
            if self.on_finished is not None:
                self.on_finished(record)


def _route_template(scope: Scope, known_routes: Callable[[], Iterable[BaseRoute]]) -> str:
    """The template of the route that served the request, or of the one its path names
    when it was refused before routing (a 413 or 431 from server/request_limits.py counts
    under /v1/chat/completions, not "unmatched"); "unmatched" when no route has the path."""
    route = scope.get("route")
    if route is not None:
        return route.path
    for candidate in known_routes():  # listed only for a request that was never routed
        path = getattr(candidate, "path", None)  # an included router has none
        if path is not None and candidate.matches(scope)[0] is not Match.NONE:
            return path  # Match.PARTIAL: the path, another method (a 405)
    return "unmatched"


def _request_id(scope: Scope) -> str:
    for name, value in scope.get("headers", ()):
        if name == REQUEST_ID_HEADER.encode():
            given = valid_request_id(value.decode("latin-1"))
            if given is not None:
                return given
            break
    return uuid.uuid4().hex
