"""One log line every few seconds, not thousands a second, while the listening socket
cannot accept for want of file descriptors.

When a process's descriptors run out, every `accept()` fails with EMFILE. CPython 3.11's
selector loop (`BaseSelectorEventLoop._accept_connection`) then reports the error to the
loop's exception handler, schedules a retry, and goes on trying the same accept up to the
listen backlog (uvicorn's 2048) times in that tick, where later versions stop at the first
failure (CPython gh-151615). Each report is a full traceback: fuzz82 counted 300,869 of
them, 137 MB of log, in 30 s while slow clients held every descriptor. Here those reports
are counted and one line says how many there were, at most every `interval_s`, the last
of a burst included (a line is due at the end of the interval in which failures went
unreported); every other loop error goes to the default handler as before.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

logger = logging.getLogger(__name__)

ACCEPT_FAILURE = "socket.accept() out of system resource"


class AcceptErrorThrottle:
    """A loop exception handler: accept failures for want of resources are counted and
    logged as one warning at most every `interval_s`; any other error goes to the
    default handler."""

    def __init__(self, interval_s: float = 5.0) -> None:
        self.interval_s = interval_s
        self.num_unlogged = 0
        self._last_logged = float("-inf")
        self._last_error: object = None
        # The line due at the end of this interval for failures it has not reported yet:
        # without it, a shortage that ends within the interval would go unreported.
        self._pending_report: asyncio.TimerHandle | None = None

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") != ACCEPT_FAILURE:
            loop.default_exception_handler(context)
            return
        self.num_unlogged += 1
        self._last_error = context.get("exception")
        wait = self._last_logged + self.interval_s - time.monotonic()
        if wait <= 0:
            self._report()
        elif self._pending_report is None:
            self._pending_report = loop.call_later(wait, self._report)

    def _report(self) -> None:
        if self._pending_report is not None:
            self._pending_report.cancel()
            self._pending_report = None
        if not self.num_unlogged:
            return
        self._last_logged = time.monotonic()
        logger.warning(
            "cannot accept connections: %s (%d time(s) since the last report); the process "
            "is out of file descriptors or memory, most likely from many open connections",
            self._last_error,
            self.num_unlogged,
        )
        self.num_unlogged = 0


def throttle_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """Installs `AcceptErrorThrottle` as `loop`'s exception handler."""
    loop.set_exception_handler(AcceptErrorThrottle())
