"""ByteBudget: an asyncio semaphore counted in bytes, served first come, first served.

The feature fetcher (engine/feature_fetcher.py) reserves a download's declared length
before it reads the body, and gives it back once the file is checked: the bytes of all
downloads together stay under `--feature-fetch-max-bytes-in-flight`, where each file's
cap alone let 64 connections per storage kind hold 64 x 256 MiB (fuzz61).

First come, first served: a large reservation at the head of the queue is not passed by
smaller ones behind it, which could otherwise keep it waiting for ever.
"""

from __future__ import annotations

import asyncio
from collections import deque


class ByteBudget:
    """`acquire(n)` waits until `n` more bytes fit under `capacity` (a request for more
    than the capacity waits for it all); `release(n)` gives them back. One event loop."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self._waiters: deque[tuple[int, asyncio.Future]] = deque()

    async def acquire(self, num_bytes: int) -> int:
        """Reserves `num_bytes` (at most the capacity) and returns the number reserved,
        the amount to `release`. Cancelled while waiting, it reserves nothing."""
        num_bytes = min(num_bytes, self.capacity)
        if not self._waiters and self.used + num_bytes <= self.capacity:
            self.used += num_bytes
            return num_bytes
        waiter = (num_bytes, asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        try:
            await waiter[1]
        except asyncio.CancelledError:
            if waiter[1].done() and not waiter[1].cancelled():  # granted as it was cancelled
                self.release(num_bytes)
            else:
                if waiter in self._waiters:  # else `_grant` dropped it already
                    self._waiters.remove(waiter)
                self._grant()  # the ones behind it may fit now
            raise
        return num_bytes

    def release(self, num_bytes: int) -> None:
        self.used -= num_bytes
        self._grant()

    def _grant(self) -> None:
        while self._waiters and self.used + self._waiters[0][0] <= self.capacity:
            num_bytes, future = self._waiters.popleft()
            if future.done():  # cancelled, its task not yet told: it reserves nothing
                continue
            self.used += num_bytes
            future.set_result(None)
