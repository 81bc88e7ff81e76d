"""Admission control: bound the work the server accepts, refuse the rest with 503.

The server counts what it has admitted and not yet finished: sequences (a request with
`n` choices is `n` sequences) and prompt tokens (times `n`). A request is admitted only if
ALL its sequences fit — `n > 1` is all-or-nothing — under

    sequences:     running capacity (max_num_seqs) + max_waiting_requests
    prompt tokens: max_waiting_tokens

A request with pre-encoded features to download (s3:// or http(s):// parts) counts apart,
its sequences against `max_feature_requests` alone: the engine holds it while the store
answers (each download up to three times --feature-fetch-timeout-s: waits for a
connection and for room in the byte budget, then the download; a request's parts
--feature-fetch-parallel at a time), and a hung
store filled the budget above until every request, text too, got 503 (fuzz61). Once its
features are in it queues in the engine beside the others, uncounted there: at most
`max_feature_requests` more.

An idle budget admits any one request (so a single large one is never refused forever).
With several API processes (server/api_servers.py) they count together: each process's
admitted work sits in shared memory (`SharedCounts`, made by the launcher), and a request
fits if the sum over all processes leaves room, whichever process it reached. (Each one
admitting a fixed share refused requests at half the capacity when the kernel handed
most connections to one process.) A refused request gets 503 `server_overloaded` with
`Retry-After` (counted by budget: `feature_overloaded` for the feature one). While draining (SIGTERM) every new request gets 503 `server_draining`.
Within a process counting happens on the event loop thread; across processes under the
shared array's lock.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any

from engine.errors import ServerOverloaded, TesseraError


class ServerDraining(ServerOverloaded):
    """The server is shutting down and takes no new requests (HTTP 503)."""

    code = reason = "server_draining"


class FeatureRequestsOverloaded(ServerOverloaded):
    """The budget of requests downloading features is full. The client sees the same 503
    `server_overloaded`; the metric tells it apart, since a slow store fills this budget
    and not the other."""

    reason = "feature_overloaded"


# What each API process counts in the shared array: sequences, prompt tokens, and the
# sequences of requests with features to download.
COUNTS_PER_PROCESS = 3


def shared_counts_array(context: Any, num_processes: int) -> Any:
    """The zeroed, lock-guarded array the API processes admit against together."""
    return context.Array("q", COUNTS_PER_PROCESS * num_processes)


@dataclass
class Ticket:
    """One admitted request's share of the budget; `release()` is idempotent."""

    controller: AdmissionController
    num_sequences: int
    num_tokens: int
    num_feature_sequences: int = 0
    is_released: bool = False

    def release(self) -> None:
        if not self.is_released:
            self.is_released = True
            self.controller._release(self)


@dataclass(frozen=True)
class SharedCounts:
    """What every API process has admitted: `counts` is a lock-guarded shared array
    (`shared_counts_array`) of [sequences, tokens, feature sequences] per process; this
    process is `index`."""

    counts: Any
    index: int

    def totals(self) -> tuple[int, ...]:
        """Each count summed over every process; call under `counts.get_lock()`."""
        raw = self.counts.get_obj()
        return tuple(sum(raw[i::COUNTS_PER_PROCESS]) for i in range(COUNTS_PER_PROCESS))

    def add(self, *counts: int) -> None:
        """Adds to this process's counts; call under `counts.get_lock()`."""
        raw = self.counts.get_obj()
        for i, count in enumerate(counts):
            raw[COUNTS_PER_PROCESS * self.index + i] += count


@dataclass
class AdmissionController:
    """Counts admitted, unfinished work and refuses what does not fit (see module doc).
    `num_sequences` and `num_tokens` are this process's; with `shared` the budgets bound
    the sum over every API process."""

    max_running: int
    max_waiting_requests: int
    max_waiting_tokens: int
    max_feature_requests: int = 256
    num_sequences: int = 0
    num_tokens: int = 0
    num_feature_sequences: int = 0
    is_draining: bool = False
    num_rejected: dict[str, int] = field(default_factory=dict)
    shared: SharedCounts | None = None
    # Requests still preparing their prompt (fetching media...), not yet admitted: a drain
    # waits for them too (server/cli.py).
    num_preparing: int = 0
    _stopping: asyncio.Future | None = None
    _stopped: bool = False
    # What the requests `stop_all` ends get: a drain's ServerDraining unless it says (the
    # engine's death: engine_dead, which a client may retry elsewhere at once).
    stop_failure: TesseraError | None = None

    @property
    def num_in_flight(self) -> int:
        """What a drain waits for: admitted sequences and requests still preparing."""
        return self.num_sequences + self.num_feature_sequences + self.num_preparing

    def stopping(self) -> asyncio.Future:
        """Done once the drain ends what is left (`stop_all`): requests still preparing
        race it (server/app.py). Made on the running loop at first use (again on another
        loop: a test client may run each request on its own)."""
        loop = asyncio.get_running_loop()
        if self._stopping is None or self._stopping.get_loop() is not loop:
            self._stopping = loop.create_future()
            if self._stopped:
                self._stopping.set_result(None)
        return self._stopping

    def stop_all(self, failure: TesseraError | None = None) -> None:
        """The drain's deadline, a second signal, or the engine's death: what still
        prepares gives up, with `failure` (None: ServerDraining)."""
        if failure is not None and self.stop_failure is None:
            self.stop_failure = failure
        self._stopped = True
        stopping = self.stopping()
        if not stopping.done():
            stopping.set_result(None)

    @property
    def max_sequences(self) -> int:
        return self.max_running + self.max_waiting_requests

    def admit(self, *, num_sequences: int, num_tokens: int, fetches: bool = False) -> Ticket:
        """Reserve room for a request of `num_sequences` sequences holding `num_tokens`
        prompt tokens in all (`fetches`: in the budget of requests with features to
        download), or raise ServerOverloaded / ServerDraining."""
        if self.is_draining:
            self._count("draining")
            raise ServerDraining("the server is shutting down; retry on another replica")
        ticket = (Ticket(self, 0, 0, num_sequences) if fetches
                  else Ticket(self, num_sequences, num_tokens))  # fmt: skip
        with self._counting():
            sequences, tokens, feature_sequences = self._totals()
            if fetches:
                self._check_feature_room(feature_sequences, num_sequences)
            else:
                self._check_room(sequences, tokens, num_sequences, num_tokens)
            self._add(ticket.num_sequences, ticket.num_tokens, ticket.num_feature_sequences)
        return ticket

    def _totals(self) -> tuple[int, ...]:
        """What every API process admitted (this one's alone without `shared`); call under
        `_counting()`."""
        if self.shared is None:
            return self.num_sequences, self.num_tokens, self.num_feature_sequences
        return self.shared.totals()

    def _check_feature_room(self, feature_sequences: int, num_sequences: int) -> None:
        if feature_sequences and feature_sequences + num_sequences > self.max_feature_requests:
            self._count("max_feature_requests")
            raise FeatureRequestsOverloaded(
                "the server is at capacity (too many requests downloading features); retry later"
            )

    def _check_room(self, sequences: int, tokens: int, num_sequences: int, num_tokens: int):
        if sequences == 0:
            return  # idle: any one request
        if sequences + num_sequences > self.max_sequences:
            self._count("max_waiting_requests")
            raise ServerOverloaded(
                "the server is at capacity (too many requests waiting); retry later"
            )
        if tokens + num_tokens > self.max_waiting_tokens:
            self._count("max_waiting_tokens")
            raise ServerOverloaded(
                "the server is at capacity (too many prompt tokens waiting); retry later"
            )

    def _counting(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if self.shared is None else self.shared.counts.get_lock()

    def _add(self, num_sequences: int, num_tokens: int, num_feature_sequences: int) -> None:
        self.num_sequences += num_sequences
        self.num_tokens += num_tokens
        self.num_feature_sequences += num_feature_sequences
        if self.shared is not None:
            self.shared.add(num_sequences, num_tokens, num_feature_sequences)

    def start_draining(self) -> None:
        self.is_draining = True

    def _release(self, ticket: Ticket) -> None:
        with self._counting():
            self._add(-ticket.num_sequences, -ticket.num_tokens, -ticket.num_feature_sequences)

    def _count(self, reason: str) -> None:
        self.num_rejected[reason] = self.num_rejected.get(reason, 0) + 1
