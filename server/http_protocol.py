"""uvicorn's h11 protocol with a deadline on each request's header block.

uvicorn times a connection out only between requests, after a response (its keep-alive
timeout), and any byte that arrives cancels that timer: a client that connects and sends
nothing, or half a header block, held its connection forever (400 such connections held
425 file descriptors). Here a connection must finish each request's header block within
`read_timeout_s` of connecting, or of its previous response, or it is closed. A body that
stalls is the ASGI middleware's to answer (408, server/request_limits.py).
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol


def timed_h11_protocol(read_timeout_s: float) -> type[H11Protocol]:
    """An H11Protocol class whose header blocks must arrive within `read_timeout_s`."""

    class TimedH11Protocol(H11Protocol):
        _header_deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._await_headers()

        def data_received(self, data: bytes) -> None:
            cycle = self.cycle
            super().data_received(data)
            if self.cycle is not cycle:  # a header block was read: a request began
                self._cancel_deadline()

        def on_response_complete(self) -> None:
            cycle = self.cycle
            super().on_response_complete()  # may begin a pipelined request at once
            if self.cycle is cycle and not self.transport.is_closing():
                self._await_headers()  # the next request's, on this kept-alive connection

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_deadline()
            super().connection_lost(exc)

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
