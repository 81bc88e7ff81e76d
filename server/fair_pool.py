"""FairPool: a thread pool for blocking work that takes turns between owners.

The API process decodes and preprocesses media on a few threads. A plain executor is
first come, first served: a request of four 8000x8000 PNGs queued all four, and another
request's small image waited behind every one of them (15-28 s; fuzz69). Capping each
request at half the threads fixed that, but made a request alone on an idle server wait
for threads nobody used (fuzz73).

FairPool keeps a queue per owner (a request). Whenever a thread comes free it starts the
next job of the owner with the fewest jobs running (among equals, the one served least
recently), so
an owner alone uses every thread, two owners share them evenly, and a newcomer's first
job starts on the next thread that comes free. Jobs are not pre-empted: a running decode
finishes.
"""

from __future__ import annotations

import asyncio
import collections
import functools
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class FairPool:
    """`await run(owner, fn, *args)`: `fn(*args)` on one of `workers` threads, in turn
    with other owners' jobs. Used from one event loop; `shutdown()` at the end."""

    def __init__(self, workers: int, name: str) -> None:
        self.workers = workers
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
        self._queues: dict[Hashable, collections.deque] = {}  # owner -> queued jobs, in order
        self._running: collections.Counter[Hashable] = collections.Counter()
        self._served: dict[Hashable, int] = {}  # owner -> when its last job started
        self._starts = 0
        self._is_shut = False

    async def run(self, owner: Hashable, fn: Callable[..., Any], *args: Any) -> Any:
        """The result of `fn(*args)`. Cancelled while queued, the job never runs; while
        running, it finishes on its thread and its result is dropped."""
        if self._is_shut:
            raise RuntimeError("the pool is shut down")
        future = asyncio.get_running_loop().create_future()
        self._queues.setdefault(owner, collections.deque()).append((fn, args, future))
        self._start_jobs()
        return await future

    def shutdown(self) -> None:
        """Queued jobs are cancelled (their callers get CancelledError); running ones finish
        on their threads, their results dropped."""
        self._is_shut = True
        for queue in self._queues.values():
            for _, _, future in queue:
                future.cancel()
        self._queues.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _start_jobs(self) -> None:
        while not self._is_shut and self._queues and self._running.total() < self.workers:
            owner = min(self._queues, key=self._turn)
            queue = self._queues[owner]
            fn, args, future = queue.popleft()
            if not queue:
                del self._queues[owner]
            if future.cancelled():  # its request left while it queued
                self._forget_if_idle(owner)
                continue
            self._running[owner] += 1
            self._starts += 1
            self._served[owner] = self._starts
            done = self._executor.submit(fn, *args)
            done.add_done_callback(functools.partial(self._report, owner, future))

    def _turn(self, owner: Hashable) -> tuple[int, int]:
        return self._running[owner], self._served.get(owner, 0)

    def _forget_if_idle(self, owner: Hashable) -> None:
        """An owner with nothing queued or running is forgotten (the bookkeeping of a
        request that left or failed stayed for the life of the process; fuzz74)."""
        if owner not in self._running and owner not in self._queues:
            self._served.pop(owner, None)

    def _report(self, owner: Hashable, future: asyncio.Future, done: Future) -> None:
        """On the worker thread: hands the job's end to the event loop."""
        future.get_loop().call_soon_threadsafe(self._finished, owner, future, done)

    def _finished(self, owner: Hashable, future: asyncio.Future, done: Future) -> None:
        self._running[owner] -= 1
        if not self._running[owner]:
            del self._running[owner]
        self._forget_if_idle(owner)
        try:
            _settle(future, done)
        finally:  # whatever the job raised, the others' jobs go on
            self._start_jobs()


def _settle(future: asyncio.Future, done: Future) -> None:
    """`future` as the thread's `done` ended."""
    if done.cancelled():  # shut down before it ran
        future.cancel()
    elif future.cancelled():  # its caller left: the result is dropped
        return
    elif (error := done.exception()) is None:
        future.set_result(done.result())
    else:
        try:
            future.set_exception(error)
        except TypeError:  # StopIteration, which a future refuses
            future.set_exception(RuntimeError(f"the job raised {error!r}"))
