"""Admission control: bound the work the server accepts, refuse the rest with 503.

The server counts what it has admitted and not yet finished: sequences (a request with
`n` choices is `n` sequences) and prompt tokens (times `n`). A request is admitted only if
ALL its sequences fit — `n > 1` is all-or-nothing — under

    sequences:     running capacity (max_num_seqs) + max_waiting_requests
    prompt tokens: max_waiting_tokens

An idle server admits any one request (so a single large one is never refused forever).
With several API processes (server/api_servers.py) each admits its `share` of every
budget, so that together they admit what one would. A refused request gets 503
`server_overloaded` with `Retry-After`. While draining (SIGTERM)
every new request gets 503 `server_draining`. Counting happens here, on the event loop
thread, so no lock is needed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import ServerOverloaded


def share(total: int, count: int, index: int) -> int:
    """Part `index` of `total` split into `count` parts that differ by at most one and add
    up to `total`."""
    return total // count + (index < total % count)


class ServerDraining(ServerOverloaded):
    """The server is shutting down and takes no new requests (HTTP 503)."""

    code = "server_draining"


@dataclass
class Ticket:
    """One admitted request's share of the budget; `release()` is idempotent."""

    controller: AdmissionController
    num_sequences: int
    num_tokens: int
    is_released: bool = False

    def release(self) -> None:
        if not self.is_released:
            self.is_released = True
            self.controller._release(self)


@dataclass
class AdmissionController:
    """Counts admitted, unfinished work and refuses what does not fit (see module doc)."""

    max_running: int
    max_waiting_requests: int
    max_waiting_tokens: int
    num_sequences: int = 0
    num_tokens: int = 0
    is_draining: bool = False
    num_rejected: dict[str, int] = field(default_factory=dict)

    @property
    def max_sequences(self) -> int:
        return self.max_running + self.max_waiting_requests

    @property
    def is_idle(self) -> bool:
        return self.num_sequences == 0

    def admit(self, *, num_sequences: int, num_prompt_tokens: int) -> Ticket:
        """Reserve room for a request or raise ServerOverloaded / ServerDraining."""
        if self.is_draining:
            self._count("draining")
            raise ServerDraining("the server is shutting down; retry on another replica")
        num_tokens = num_prompt_tokens * num_sequences
        if not self.is_idle:
            if self.num_sequences + num_sequences > self.max_sequences:
                self._count("max_waiting_requests")
                raise ServerOverloaded(
                    "the server is at capacity (too many requests waiting); retry later"
                )
            if self.num_tokens + num_tokens > self.max_waiting_tokens:
                self._count("max_waiting_tokens")
                raise ServerOverloaded(
                    "the server is at capacity (too many prompt tokens waiting); retry later"
                )
        self.num_sequences += num_sequences
        self.num_tokens += num_tokens
        return Ticket(self, num_sequences, num_tokens)

    def start_draining(self) -> None:
        self.is_draining = True

    def _release(self, ticket: Ticket) -> None:
        self.num_sequences -= ticket.num_sequences
        self.num_tokens -= ticket.num_tokens

    def _count(self, reason: str) -> None:
        self.num_rejected[reason] = self.num_rejected.get(reason, 0) + 1
