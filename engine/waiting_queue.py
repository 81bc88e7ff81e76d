"""The scheduler's queue of requests waiting to run: arrival order (a preempted request
first), or with `--scheduling-policy priority` by each request's urgency."""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.request import Request


class WaitingQueue:
    """The requests waiting to run, in arrival order; a preempted request goes first.
    `peek` is the next to try."""

    def __init__(self) -> None:
        self._items: deque[Request] = deque()

    def push(self, request: Request) -> None:  # a new arrival
        self._items.append(request)

    def push_front(self, request: Request) -> None:  # a preempted request
        self._items.appendleft(request)

    def peek(self) -> Request:
        return self._items[0]

    def pop(self) -> Request:
        return self._items.popleft()

    def remove(self, request: Request) -> None:
        self._items.remove(request)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items)

    def __contains__(self, request: object) -> bool:
        return request in self._items


class PriorityQueue(WaitingQueue):
    """By `Request.urgency`: priority, then arrival (a preempted request keeps its place)."""

    def push(self, request: Request) -> None:
        bisect.insort(self._items, request, key=lambda r: r.urgency)

    def push_front(self, request: Request) -> None:
        self.push(request)
