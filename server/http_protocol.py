"""uvicorn's h11 protocol with a deadline on each request's header block, and on a
client that stops taking its response.

uvicorn times a connection out only between requests, after a response (its keep-alive
timeout), and any byte that arrives cancels that timer: a client that connects and sends
nothing, or half a header block, held its connection forever (400 such connections held
425 file descriptors). Here a connection must finish each request's header block within
`read_timeout_s` of connecting, or of the first byte of a later request on a kept-alive
connection (of the previous response's end, for bytes that came during it), or it is
closed; an idle kept-alive connection is the keep-alive timeout's
(from its previous response it was `read_timeout_s`'s too, so a keep-alive timeout above
it would not hold). A body that stalls is the ASGI middleware's to answer (408,
server/request_limits.py).

The way out: a client that stops reading with its connection open (every buffer between
full, so the transport pauses the writer) held its request, and that request's admission
room, for as long as it liked; a few such clients refused everyone else with 503s. Once
the transport pauses, the bytes the client has not taken yet (the transport's buffer plus,
on Linux, the socket's send queue) are checked every quarter of `write_timeout_s`; when
none has left for `write_timeout_s` the connection is reset (SO_LINGER 0, then abort).
The response then ends as a disconnect does (its engine requests aborted, its room given
back), and its buffered megabytes go with it: a close would wait for the client to read
them, for ever, and a plain abort would leave the kernel sending its queue in the
background. Progress
is measured in bytes, not sends, so a slow but steady reader of one big event (the
prompt_logprobs of a long prompt) is never cut.

Bytes that are not HTTP/1.1 (a bad chunk size or Content-Length, a header line without a
colon, a header block past h11's limit) are answered in the API's error shape, where
uvicorn wrote a text/plain "Invalid HTTP request received." (fuzz82).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import http
import json
import logging
import socket
import struct
import sys

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from server.errors import error_body
from server.request_log import record_in

logger = logging.getLogger(__name__)

# The unsent bytes of a socket's send queue (Linux's SIOCOUTQ, as termios.TIOCOUTQ).
_SEND_QUEUE_IOCTL = 0x5411 if sys.platform.startswith("linux") else None


def unsent_bytes(transport: asyncio.Transport) -> int:
    """Bytes written to `transport` that its peer has not taken yet: the transport's own
    buffer, plus the socket's send queue where the kernel tells it."""
    pending = transport.get_write_buffer_size()
    sock = transport.get_extra_info("socket")
    if sock is not None and _SEND_QUEUE_IOCTL is not None:
        try:
            queued = fcntl.ioctl(sock.fileno(), _SEND_QUEUE_IOCTL, b"\0\0\0\0")
        except OSError:  # closed meanwhile, or not a TCP socket
            return pending
        pending += struct.unpack("i", queued)[0]
    return pending


def timed_h11_protocol(read_timeout_s: float, write_timeout_s: float = 0) -> type[H11Protocol]:
    """An H11Protocol class whose header blocks must arrive within `read_timeout_s`, and
    whose connections are aborted once their client has taken none of what is written to
    it for `write_timeout_s` (0: never)."""

    class TimedH11Protocol(H11Protocol):
        _header_deadline: asyncio.TimerHandle | None = None
        _write_check: asyncio.TimerHandle | None = None
        _unsent = 0  # at the last check
        _taken_at = 0.0  # when the client last took some of it

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._await_headers()

        def data_received(self, data: bytes) -> None:
            cycle = self.cycle
            if self._header_deadline is None and cycle is not None and cycle.response_complete:
                self._await_headers()  # a later request's first bytes, on a kept-alive connection
            super().data_received(data)
            if self.cycle is not cycle:  # a header block was read: a request began
                self._cancel_deadline()

        def on_response_complete(self) -> None:
            cycle = self.cycle
            super().on_response_complete()  # may begin a pipelined request at once
            if (self.cycle is cycle and not self.transport.is_closing()
                    and self.conn.trailing_data[0]):  # fmt: skip
                # Part of the next request came during this one: its header block is timed
                # from now (it waited out the keep-alive instead; fuzz88).
                self._await_headers()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_deadline()
            self._stop_write_checks()
            super().connection_lost(exc)

        def pause_writing(self) -> None:  # the transport's buffer is over its high mark
            super().pause_writing()
            if write_timeout_s and self._write_check is None:
                self._unsent = unsent_bytes(self.transport)
                self._taken_at = self.loop.time()
                self._write_check = self.loop.call_later(write_timeout_s / 4, self._check_writes)

        def resume_writing(self) -> None:
            super().resume_writing()
            self._stop_write_checks()

        def _check_writes(self) -> None:
            self._write_check = None
            unsent, now = unsent_bytes(self.transport), self.loop.time()
            if unsent < self._unsent:  # the client took some
                self._taken_at = now
            self._unsent = unsent
            if now - self._taken_at < write_timeout_s:
                self._write_check = self.loop.call_later(write_timeout_s / 4, self._check_writes)
                return
            client = "{}:{}".format(*self.client) if self.client else "a client"
            # The request's id too: its own log line (a disconnect) carries that, not the
            # client's address.
            record = record_in(getattr(self, "scope", None) or {})
            if record is not None:
                client += f" (request_id={record.request_id})"
            logger.warning("%s took none of its response for %.0f s (%d bytes waiting): "
                           "connection aborted (write_timeout_s)", client, write_timeout_s,
                           unsent)  # fmt: skip
            sock = self.transport.get_extra_info("socket")
            if sock is not None:  # a reset, not a close: the kernel would go on sending
                with contextlib.suppress(OSError):  # its queue to the client in the background
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.transport.abort()  # connection_lost follows: the response ends as a disconnect

        def send_400_response(self, msg: str) -> None:
            """uvicorn's answer to what h11 cannot read as HTTP (called while handling its
            RemoteProtocolError), with h11's status (431 for a header block past its limit)
            and reason, as an OpenAI error."""
            error = sys.exc_info()[1]
            status = getattr(error, "error_status_hint", 400)
            code = "request_header_fields_too_large" if status == 431 else "invalid_http_request"
            # h11's reason may quote the offending line whole (a 60 kB request line)
            message = f"the request is not valid HTTP/1.1: {error or msg}"[:300]
            body = json.dumps(error_body(message, type="invalid_request_error", code=code))
            headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                       (b"content-length", str(len(body)).encode())]  # fmt: skip
            reason = http.HTTPStatus(status).phrase.encode()
            with contextlib.suppress(h11.LocalProtocolError):  # a response had begun
                for event in (h11.Response(status_code=status, headers=headers, reason=reason),
                              h11.Data(data=body.encode()), h11.EndOfMessage()):  # fmt: skip
                    self.transport.write(self.conn.send(event))
            self.transport.close()
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:
                # The request running on this connection has lost it; said now, as
                # connection_lost would a tick later, so that its answer is not sent into
                # the closed h11 state (uvicorn logged "Exception in ASGI application").
                cycle.disconnected = True
                cycle.message_event.set()

        def _stop_write_checks(self) -> None:
            if self._write_check is not None:
                self._write_check.cancel()
                self._write_check = None

        def _await_headers(self) -> None:
            self._cancel_deadline()
            self._header_deadline = self.loop.call_later(read_timeout_s, self._headers_late)

        def _cancel_deadline(self) -> None:
            if self._header_deadline is not None:
                self._header_deadline.cancel()
                self._header_deadline = None

        def _headers_late(self) -> None:
            self._header_deadline = None
            if self.cycle is not None and not self.cycle.response_complete:
                return  # a request is being answered: never cut it
            self.timeout_keep_alive_handler()  # closes the connection

    return TimedH11Protocol
